"""CUDA-only: ddtree.kernels at real shapes (V=151,936, D=15, budgets 16..1024, batch 1..32,
bf16 and float32 logits, tie-heavy ones too) against the torch path and ddtree.reference, and the
whole fused step captured in a CUDA graph with no host sync."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.tree import DraftTree

from helpers import KINDS, agreeing_targets, make_logits
from kernel_checks import (
    TREE_FIELDS,
    WALK_FIELDS,
    check_build_vs_reference,
    check_compact_kv,
    check_tree,
    check_vocab,
    check_walk,
    clustered_logits,
)

pytestmark = pytest.mark.gpu

VOCAB, DEPTH = 151936, 15
BUDGETS = (16, 64, 255, 1024)
DTYPES = (torch.bfloat16, torch.float32)


def real_logits(kind: str, batch: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    make = clustered_logits if kind in ("sorted", "block") else make_logits
    return make(kind, batch, DEPTH, VOCAB, seed).to("cuda", dtype)


@settings(max_examples=16, deadline=None)
@given(
    st.integers(1, 32),
    st.sampled_from(BUDGETS),
    st.sampled_from((*KINDS, "sorted", "block")),
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
)
def test_vocab_stage(batch, budget, kind, dtype, seed):
    check_vocab(real_logits(kind, batch, dtype, seed), budget)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 32),
    st.sampled_from(BUDGETS),
    st.sampled_from(KINDS),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_tree_stage(batch, budget, kind, chain_seed, seed):
    from ddtree.tree import draft_topk

    logprobs, ids = draft_topk(real_logits(kind, batch, torch.bfloat16, seed), budget)
    check_tree(logprobs, ids, budget, chain_seed)


@settings(max_examples=8, deadline=None)
@given(
    st.integers(1, 3),  # the reference heap runs per request on the host
    st.sampled_from(BUDGETS),
    st.sampled_from(KINDS),
    st.sampled_from(DTYPES),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_build_and_walk_match_the_reference(batch, budget, kind, dtype, chain_seed, seed):
    tree = check_build_vs_reference(real_logits(kind, batch, dtype, seed), budget, chain_seed)
    check_walk(tree, agreeing_targets(_on_cpu(tree), VOCAB, seed).cuda())
    gen = torch.Generator().manual_seed(seed)
    check_walk(tree, torch.randint(0, VOCAB, tree.tokens.shape, generator=gen).cuda())


def _on_cpu(tree: DraftTree) -> DraftTree:
    return DraftTree(
        **{name: getattr(tree, name).cpu() for name in (*TREE_FIELDS, "ancestor_bits")}
    )


@pytest.mark.parametrize("layout", ["flash", "split"])
def test_compact_kv(layout):
    gen = torch.Generator().manual_seed(0)
    check_compact_kv(layout, num_layers=36, num_reqs=32, moves=15, device="cuda", gen=gen)
    check_compact_kv(layout, num_layers=2, num_reqs=1, moves=1, device="cuda", gen=gen)


@pytest.mark.parametrize("batch, budget", [(1, 255), (32, 1024), (4, 16)])
def test_cuda_graph_step_has_no_host_sync(batch, budget):
    """build_tree_fused + walk_fused + compact_kv captured once under sync-debug "error" mode
    (any host sync raises), replayed on new logits: equal to eager and to the torch path."""
    from ddtree import kernels
    from ddtree.tree import tree_from_ranked

    buffers = kernels.tree_buffers(batch, DEPTH, VOCAB, budget, "cuda")
    acc = kernels.acceptance_buffers(batch, DEPTH, budget + 1, "cuda")
    logits = real_logits("normal", batch, torch.bfloat16, 0)
    target = torch.randint(0, VOCAB, (batch, budget + 1), device="cuda")
    caches = [torch.randn(128, 8, 16, 256, device="cuda").bfloat16() for _ in range(4)]
    layers = kernels.KVLayers(caches)
    src = torch.zeros(batch, DEPTH, dtype=torch.long, device="cuda")

    def step():
        tree = kernels.build_tree_fused(logits, budget, chain_seed=True, buffers=buffers)
        target[:, 0] = tree.tokens[:, 1]  # accept at least one node
        walked = kernels.walk_fused(tree, target, out=acc)
        src.copy_(walked.path[:, 1:].clamp(min=0))
        kernels.compact_kv(layers, src, src)  # moves onto themselves: exercises the launch
        return tree, walked

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            tree_out, acc_out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in range(1, 4):
        logits.copy_(real_logits("normal", batch, torch.bfloat16, seed))
        graph.replay()
        snapshot = {name: getattr(tree_out, name).clone() for name in TREE_FIELDS}
        walked = {name: getattr(acc_out, name).clone() for name in WALK_FIELDS}
        tree, eager = step()
        for name in TREE_FIELDS:
            assert torch.equal(snapshot[name], getattr(tree, name)), name
        for name in WALK_FIELDS:
            assert torch.equal(walked[name], getattr(eager, name)), name
        ref = tree_from_ranked(buffers.logprobs, buffers.token_ids, budget, chain_seed=True)
        for name in TREE_FIELDS:
            assert torch.equal(snapshot[name], getattr(ref, name)), name
        assert int(eager.num_accepted.min()) >= 1
