"""CUDA-only: the paged tree attention kernel at Qwen3-8B head shapes in bf16 against a float32
per-slot reference, launched eagerly and replayed from a CUDA graph captured on other values
(the verify graphs capture it once and replay it every step)."""

import pytest
import torch

import ddtree
from ddtree.vllm_plugin.attention.merge import attend_with_lse
from ddtree.vllm_plugin.attention.paged_tree_kernel import paged_tree_attention

pytestmark = pytest.mark.gpu
HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16


def _batch(seed: int, budget: int, contexts: list[int]):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_reqs, slots = len(contexts), budget + 1
    trees = ddtree.build_tree(
        torch.randn(num_reqs, 15, 800, device="cuda", generator=gen) * 3, budget
    )
    num_blocks = 128 * num_reqs
    cache = torch.randn(num_blocks, BLOCK, KV_HEADS, 2 * HEAD, device="cuda", generator=gen)
    kv_cache = cache.bfloat16().permute(0, 2, 1, 3)  # logical view over NHD memory
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    tables = perm.view(num_reqs, 128).int()
    qsl = torch.arange(num_reqs + 1, device="cuda", dtype=torch.int32) * slots
    seq_lens = torch.tensor(contexts, device="cuda", dtype=torch.int32) + slots
    query = torch.randn(num_reqs * slots, HEADS, HEAD, device="cuda", generator=gen).bfloat16()
    tree_rows = torch.arange(num_reqs, device="cuda", dtype=torch.int32)
    return dict(
        query=query,
        kv_cache=kv_cache,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=tables,
        tree_rows=tree_rows,
        depths=trees.depths.int().contiguous(),
        ancestors=trees.ancestors.int().contiguous(),
    ), trees


def _check(args, trees, output, contexts, slots_checked):
    kv_cache, tables, query = args["kv_cache"], args["block_table"], args["query"]
    slots = trees.tokens.shape[1]
    for r, context in enumerate(contexts):
        for i in slots_checked:
            seen = trees.mask[r, i].nonzero().squeeze(1)
            pos = torch.cat([torch.arange(context, device="cuda"), context + seen])
            rows = kv_cache[tables[r, pos // BLOCK].long(), :, pos % BLOCK].float()
            want, _ = attend_with_lse(
                query[r * slots + i][None], rows[..., :HEAD], rows[..., HEAD:], HEAD**-0.5
            )
            got = output[r * slots + i].float()
            torch.testing.assert_close(got, want[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits, scratch", [(1, 0), (4, 4), (2, 4)])
@pytest.mark.parametrize("budget", [63, 255])
def test_paged_tree_kernel_bf16_and_graph_replay(budget, splits, scratch):
    """Also with the context in shares (``context_splits``: a second launch merges them, its
    float32 scratch given, as a graph needs; 2 shares in a slice of a 4-share scratch, as the
    engine's ``DDTREE_CONTEXT_SPLITS=auto`` hands it)."""
    contexts = [300, 1000, 17]
    args, trees = _batch(0, budget, contexts)
    if splits > 1:
        rows = args["query"].shape[0]
        args["context_splits"] = splits
        args["partials"] = (
            torch.empty(rows, HEADS, scratch, HEAD, device="cuda")[:, :, :splits],
            torch.empty(rows, HEADS, scratch, device="cuda")[:, :, :splits],
        )
    output = torch.zeros_like(args["query"])
    paged_tree_attention(output=output, scale=HEAD**-0.5, max_query_len=budget + 1, **args)
    _check(args, trees, output, contexts, (0, 1, 7, budget // 2, budget))

    # Capture on these buffers, then put another step's values into them and replay.
    graph_out = torch.zeros_like(output)
    paged_tree_attention(output=graph_out, scale=HEAD**-0.5, max_query_len=budget + 1, **args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_tree_attention(output=graph_out, scale=HEAD**-0.5, max_query_len=budget + 1, **args)
    contexts2 = [40, 700, 1020]
    args2, trees2 = _batch(1, budget, contexts2)
    for name in ("query", "seq_lens", "block_table", "depths", "ancestors"):
        args[name].copy_(args2[name])
    args["kv_cache"].copy_(args2["kv_cache"])
    args["tree_rows"].copy_(torch.tensor([0, -1, 2], dtype=torch.int32))  # a row without tree
    graph_out.fill_(7.0)
    graph.replay()
    _check(args, trees2, graph_out, [40], (0, 3, budget))
    slots = budget + 1
    assert (graph_out[slots : 2 * slots] == 7.0).all()  # the request without a tree: untouched
    r = 2
    for i in (0, budget):
        seen = trees2.mask[r, i].nonzero().squeeze(1)
        pos = torch.cat([torch.arange(1020, device="cuda"), 1020 + seen])
        rows = args["kv_cache"][args["block_table"][r, pos // BLOCK].long(), :, pos % BLOCK].float()
        want, _ = attend_with_lse(
            args["query"][r * slots + i][None], rows[..., :HEAD], rows[..., HEAD:], HEAD**-0.5
        )
        torch.testing.assert_close(graph_out[r * slots + i].float(), want[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("budget", [63, 255])
def test_flash_context_part_and_graph_replay(budget):
    """``DDTREE_TREE_ATTENTION=flash``: the context part by vLLM's FlashAttention (its output
    and log-sum-exp into persistent buffers), the tree's slots by the kernel; eager and
    replayed from a graph captured on other values."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    from ddtree.vllm_plugin.attention.flash import context_attention

    contexts = [300, 1000, 17]
    args, trees = _batch(0, budget, contexts)
    slots = budget + 1
    impl = SimpleNamespace(
        head_size=HEAD, scale=HEAD**-0.5, vllm_flash_attn_version=get_flash_attn_version()
    )
    metadata = SimpleNamespace(
        query_start_loc=args["query_start_loc"], seq_lens=args["seq_lens"],
        block_table=args["block_table"], max_query_len=slots, max_seq_len=2048,
    )  # fmt: skip
    context = torch.zeros(8, dtype=torch.int32, device="cuda")
    buffer = torch.empty(4 * slots, HEADS, HEAD, dtype=torch.bfloat16, device="cuda")

    def step(output):
        given = context_attention(impl, args["query"], args["kv_cache"], metadata, context, buffer)
        paged_tree_attention(output=output, scale=HEAD**-0.5, max_query_len=slots, **args, **given)

    output = torch.zeros_like(args["query"])
    step(output)
    assert context[:3].tolist() == contexts
    _check(args, trees, output, contexts, (0, 1, 7, budget // 2, budget))

    graph_out = torch.zeros_like(output)
    step(graph_out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_out)
    contexts2 = [40, 700, 1020]
    args2, trees2 = _batch(1, budget, contexts2)
    for name in ("query", "seq_lens", "block_table", "depths", "ancestors"):
        args[name].copy_(args2[name])
    args["kv_cache"].copy_(args2["kv_cache"])
    graph_out.fill_(7.0)
    graph.replay()
    _check(args, trees2, graph_out, contexts2, (0, 3, budget))
