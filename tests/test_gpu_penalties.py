"""CUDA-only: DDTree's per-node penalties kernel against vLLM's own V2 penalties kernel on
chains, bit for bit (vLLM turns its Triton kernels off without a GPU, so the CPU glue test
checks the tree kernel against a torch reference only)."""

import numpy as np
import pytest
import torch
from test_v2_glue import BUDGET, DEPTH, _penalty_state, chain_tree

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("vocab", [40, 151936])
def test_tree_penalties_on_a_chain_equal_vllms_kernel(vocab):
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.sample.penalties import apply_penalties

    from ddtree.vllm_plugin.v2.engine import TreeTables
    from ddtree.vllm_plugin.v2.penalties import apply_tree_penalties

    gen = torch.Generator().manual_seed(3)
    cpu = _penalty_state(8, vocab, gen)
    state = SimpleNamespace(
        use_penalty=cpu.use_penalty,
        prompt_bin_mask=cpu.prompt_bin_mask.cuda(),
        output_bin_counts=cpu.output_bin_counts.cuda(),
        **{
            name: SimpleNamespace(gpu=getattr(cpu, name).gpu.cuda())
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        },
    )
    tables = TreeTables(8, BUDGET, DEPTH, torch.device("cuda"))
    chain = chain_tree(3, vocab, gen)
    fields = ("tokens", "parents", "depths", "ancestors")
    tables.store(torch.tensor([0, 1, 2]).cuda(), SimpleNamespace(
        **{f: getattr(chain, f).cuda() for f in fields}
    ))  # fmt: skip
    rows = DEPTH + 1  # the chain's slots
    idx = torch.arange(3).repeat_interleave(rows).cuda()
    slots = torch.arange(rows).repeat(3).cuda()
    input_ids = chain.tokens[:, :rows].flatten().cuda()
    logits = (torch.randn(3 * rows, vocab, generator=gen) * 3).cuda()
    ours, theirs = logits.clone(), logits.clone()
    apply_tree_penalties(state, tables, ours, idx, np.arange(3), None, slots)
    apply_penalties(
        theirs, idx, input_ids, slots, state.repetition_penalty.gpu,
        state.frequency_penalty.gpu, state.presence_penalty.gpu, state.prompt_bin_mask,
        state.output_bin_counts,
    )  # fmt: skip
    assert not torch.equal(ours, logits)  # penalties did apply
    assert torch.equal(ours, theirs)
