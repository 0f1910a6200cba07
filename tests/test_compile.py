"""build_tree and walk trace into one graph (no data-dependent Python control flow)."""

import pytest
import torch

import ddtree

from helpers import agreeing_targets, make_logits

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def test_compile_fullgraph_matches_eager():
    """``fullgraph=True``: a graph break (data-dependent control flow, a host read) raises.
    ``aot_eager`` traces and functionalizes the graph as Inductor would, without its code
    generation (no engine compiles these functions; the traceability is what is tested)."""
    torch._dynamo.reset()
    logits = make_logits("ties", 2, 4, 30, 0)
    build = torch.compile(ddtree.build_tree, fullgraph=True, backend="aot_eager")
    walk = torch.compile(ddtree.walk, fullgraph=True, backend="aot_eager")
    for chain_seed in (False, True):
        eager = ddtree.build_tree(logits, 16, chain_seed=chain_seed)
        compiled = build(logits, 16, chain_seed=chain_seed)
        for name in ("tokens", "parents", "depths", "mask", "ancestors", "num_nodes"):
            assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
        for seed in range(8):
            target = agreeing_targets(eager, 30, seed)
            got, want = walk(compiled, target), ddtree.walk(eager, target)
            for name in ("path", "num_accepted", "bonus", "emitted", "accepted"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
