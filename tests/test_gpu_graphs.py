"""CUDA-only: DDTree's own graphs (tree stage, KV commit) replay exactly what eager computes;
the tree attention at 512 slots per request (B=511) matches the reference."""

from types import SimpleNamespace

import pytest
import torch

from ddtree.tree import draft_topk
from ddtree.vllm_plugin import graphs
from ddtree.vllm_plugin.attention import flash as flash_tree_attention
from ddtree.vllm_plugin.attention.merge import merge, suffix_attention
from ddtree.vllm_plugin.v1 import propose

pytestmark = pytest.mark.gpu
FIELDS = ("tokens", "parents", "depths", "mask", "scores", "ancestors", "num_nodes")


def _ranked(batch: int, budget: int, vocab: int = 5000, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(batch, 15, vocab, device="cuda", generator=gen) * 3
    return draft_topk(logits, min(budget, vocab))


def test_proposal_graph_matches_eager_across_buckets():
    cache = graphs.GraphCache(propose.proposal)
    kept = {}
    for seed, (batch, budget) in enumerate([(1, 511), (4, 127), (1, 511), (4, 127), (2, 255)]):
        logprobs, token_ids = _ranked(batch, budget, seed=seed)
        got, tokens = cache(logprobs, token_ids, budget=budget, chain_seed=True)
        want, want_tokens = propose.proposal(logprobs, token_ids, budget=budget, chain_seed=True)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(tokens, want_tokens)
        kept[(batch, budget)] = (got.tokens, want.tokens.clone())
    assert len(cache.entries) == 3
    # Another shape's replay must not overwrite a graph's outputs (one shared memory pool).
    for got, want in kept.values():
        assert torch.equal(got, want)


def test_commit_graph_moves_once():
    caches = [torch.randn(64, 4, 16, 32, device="cuda").permute(0, 2, 1, 3) for _ in range(3)]

    def commit(src, dst):
        for kv_cache in caches:
            flash_tree_attention.copy_slots(kv_cache, src, dst)

    cache = graphs.GraphCache(commit, warmup=lambda *m: [m[i | 1] for i in range(len(m))])
    for step in range(3):
        base = 100 + 40 * step
        path = torch.tensor([1, 3, 4, 9], device="cuda")  # accepted slots, increasing
        src = torch.cat([base + path, torch.zeros(4, dtype=torch.long, device="cuda")])
        dst = torch.cat([base + torch.arange(1, 5, device="cuda"), torch.zeros_like(path)])
        want = [c.clone() for c in caches]
        for kv_cache in want:
            flash_tree_attention.copy_slots(kv_cache, src, dst)
        cache(src, dst)
        for got, expected in zip(caches, want, strict=True):
            assert torch.equal(got, expected)
    assert len(cache.entries) == 1


def test_graph_reads_its_inputs_in_place():
    """``inputs_in_place``: the caller refills the tensors the graph was captured with (the
    tree sampler's per-bucket buffers); each replay sees the new values, no copies; another
    tensor is refused."""
    buffers = (torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda"))
    cache = graphs.GraphCache(lambda a, b: a * 2 + b, inputs_in_place=True)
    for step in range(3):
        buffers[0].fill_(step)
        buffers[1].copy_(torch.arange(4.0, device="cuda"))
        got = cache(*buffers)
        assert torch.equal(got, buffers[0] * 2 + buffers[1]), step
    assert len(cache.entries) == 1
    with pytest.raises(ValueError, match="same tensors"):
        cache(torch.zeros(4, device="cuda"), buffers[1])


@pytest.mark.parametrize("kernel", ["merge", "triton"])
def test_tree_attention_at_512_slots_matches_reference(kernel):
    """B = 511: every slot of two requests (contexts 300 and 1000) against SDPA over the
    context + its ancestors, in bf16."""
    import ddtree

    heads, kv_heads, head, block = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(2)
    num_slots, contexts = 512, [300, 1000]
    trees = ddtree.build_tree(torch.randn(2, 15, 1000, device="cuda", generator=gen) * 3, 511)
    kv_cache = torch.randn(400, block, kv_heads, 2 * head, device="cuda", generator=gen)
    kv_cache = kv_cache.bfloat16().permute(0, 2, 1, 3)
    tables = torch.randperm(400, device="cuda", generator=gen)[:200].view(2, 100).int()
    rows = torch.arange(2 * num_slots, device="cuda").view(2, num_slots)
    query = torch.randn(2 * num_slots, heads, head, device="cuda", generator=gen).bfloat16()
    key = torch.randn(2 * num_slots, kv_heads, head, device="cuda", generator=gen).bfloat16()
    value = torch.randn(2 * num_slots, kv_heads, head, device="cuda", generator=gen).bfloat16()
    scale = head**-0.5
    counts = [num_slots, num_slots]
    context = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    output = torch.zeros_like(query)
    if kernel == "triton":
        from ddtree.vllm_plugin.attention import triton_kernel as triton_tree_attention

        triton_tree_attention.tree_attention(
            query,
            key,
            value,
            kv_cache,
            output,
            rows,
            torch.tensor(counts, dtype=torch.int32, device="cuda"),
            trees.mask,
            context,
            tables,
            scale,
        )
    else:
        fa_utils = pytest.importorskip("vllm.v1.attention.backends.fa_utils")
        impl = SimpleNamespace(
            head_size=head, scale=scale, vllm_flash_attn_version=fa_utils.get_flash_attn_version()
        )
        cu = torch.tensor([0, num_slots, 2 * num_slots], dtype=torch.int32, device="cuda")
        out_p, lse_p = flash_tree_attention.prefix_attention(
            impl, query, kv_cache, tables, cu, context, num_slots, max(contexts)
        )
        out_s, lse_s = suffix_attention(query, key, value, rows, trees.mask, scale)
        output = merge(out_p, lse_p, out_s, lse_s)
    for r, length in enumerate(contexts):
        k_ctx, v_ctx = flash_tree_attention.read_paged_kv(kv_cache, tables[r], length)
        seen = trees.mask[r]  # [Q, Q]
        for slot in (0, 1, 100, 255, 256, 300, 511):
            own = seen[slot].nonzero().squeeze(1) + r * num_slots
            keys = torch.cat([k_ctx, key[own]])
            values = torch.cat([v_ctx, value[own]])
            want, _ = _reference(query[r * num_slots + slot], keys, values, scale)
            got = output[r * num_slots + slot].float()
            torch.testing.assert_close(got, want, atol=3e-2, rtol=0)


def _reference(query, keys, values, scale):
    from ddtree.vllm_plugin.attention.merge import attend_with_lse

    out, lse = attend_with_lse(query[None], keys, values, scale)
    return out[0], lse[0]


def test_prepare_captures_without_replaying():
    """``prepare`` (start-up): the capture and its eager warm-up run happen there, on the
    warm-up's harmless inputs; the first served call only replays."""
    runs = []  # per call of fn: (inside a capture, on the served buffer); no host read

    def fn(a, b):
        runs.append((torch.cuda.is_current_stream_capturing(), b is buffers[1]))
        return a * 2 + b

    buffers = (torch.ones(4, device="cuda"), torch.ones(4, device="cuda"))
    cache = graphs.GraphCache(
        fn, warmup=lambda a, b: [a, torch.zeros_like(b)], inputs_in_place=True
    )
    cache.prepare(*buffers)
    # the eager warm-up run on the harmless input, then the capture on the buffers
    assert runs == [(False, False), (True, True)] and len(cache.entries) == 1
    buffers[1].fill_(5.0)
    assert torch.equal(cache(*buffers), torch.full((4,), 7.0, device="cuda"))
    assert len(runs) == 2 and len(cache.entries) == 1  # replayed, not captured again
