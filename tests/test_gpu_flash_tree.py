"""CUDA-only: the FlashAttention context part of tree attention equals the reference (SDPA over
K/V read back from the cache) for a batch of requests, and the whole tree attention runs
without a host sync."""

from types import SimpleNamespace

import pytest
import torch

import ddtree
from ddtree.vllm_plugin.attention import cpu as cpu_tree_attention
from ddtree.vllm_plugin.attention import flash as flash_tree_attention
from ddtree.vllm_plugin.attention.merge import merge, suffix_attention

pytestmark = pytest.mark.gpu
HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16


def _impl():
    fa_utils = pytest.importorskip("vllm.v1.attention.backends.fa_utils")
    version = fa_utils.get_flash_attn_version()
    if version is None:
        pytest.skip("no FlashAttention in this vLLM build")
    return SimpleNamespace(head_size=HEAD, scale=HEAD**-0.5, vllm_flash_attn_version=version)


def test_flash_prefix_matches_reference_and_does_not_sync():
    impl = _impl()
    gen = torch.Generator(device="cuda").manual_seed(0)
    contexts, counts = [700, 37, 1500], [65, 65, 40]
    num_blocks = 400
    memory = torch.randn(num_blocks, BLOCK, KV_HEADS, 2 * HEAD, device="cuda", generator=gen)
    kv_cache = memory.to(torch.bfloat16).permute(0, 2, 1, 3)  # vLLM's logical view (NHD)
    used = [-(-(c + n) // BLOCK) for c, n in zip(contexts, counts, strict=True)]
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    tables = torch.zeros(3, max(used), dtype=torch.int32, device="cuda")
    first = 0
    for r, u in enumerate(used):
        tables[r, :u] = perm[first : first + u]
        first += u
    query = torch.randn(sum(counts), HEADS, HEAD, device="cuda", generator=gen).bfloat16()
    cu = torch.tensor([0, 65, 130, 170], dtype=torch.int32, device="cuda")
    context = torch.tensor(contexts, dtype=torch.int32, device="cuda")

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = flash_tree_attention.prefix_attention(
            impl, query, kv_cache, tables, cu, context, 65, max(contexts)
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want, want_lse = cpu_tree_attention.prefix_attention(
        query,
        kv_cache,
        tables,
        contexts,
        counts,
        impl.scale,
        read=flash_tree_attention.read_paged_kv,
    )
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=0)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=0)


def test_suffix_and_merge_do_not_sync():
    trees = ddtree.build_tree(torch.randn(4, 15, 1000, device="cuda"), 255)
    rows = torch.arange(4 * 256, device="cuda").view(4, 256)
    query = torch.randn(4 * 256, HEADS, HEAD, device="cuda").bfloat16()
    key = torch.randn(4 * 256, KV_HEADS, HEAD, device="cuda").bfloat16()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = suffix_attention(query, key, key, rows, trees.mask, HEAD**-0.5)
        merged = merge(out, lse, out, lse)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(merged, out)


def test_triton_kernel_matches_merged_path_in_bf16():
    from ddtree.vllm_plugin.attention import triton_kernel as triton_tree_attention

    gen = torch.Generator(device="cuda").manual_seed(1)
    num_slots, contexts, counts = 65, [700, 37], [65, 30]
    trees = ddtree.build_tree(torch.randn(2, 15, 1000, device="cuda", generator=gen), 64)
    memory = torch.randn(200, BLOCK, KV_HEADS, 2 * HEAD, device="cuda", generator=gen)
    kv_cache = memory.bfloat16().permute(0, 2, 1, 3)
    tables = torch.randperm(200, device="cuda", generator=gen)[:100].view(2, 50).int()
    num_rows = sum(counts)
    query = torch.randn(num_rows, HEADS, HEAD, device="cuda", generator=gen).bfloat16()
    key = torch.randn(num_rows, KV_HEADS, HEAD, device="cuda", generator=gen).bfloat16()
    value = torch.randn(num_rows, KV_HEADS, HEAD, device="cuda", generator=gen).bfloat16()
    rows = torch.full((2, num_slots), 65, dtype=torch.long, device="cuda")
    rows[0] = torch.arange(65, device="cuda")
    rows[1, :30] = torch.arange(65, 95, device="cuda")
    limit = torch.tensor(counts, device="cuda")[:, None]
    scheduled = torch.arange(num_slots, device="cuda") < limit
    flat_slots = scheduled.flatten().nonzero().squeeze(1)
    flat_rows = rows.flatten()[flat_slots]
    context = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    impl = SimpleNamespace(scale=HEAD**-0.5)  # the reference needs no vLLM
    out_p, lse_p = cpu_tree_attention.prefix_attention(
        query[flat_rows],
        kv_cache,
        tables,
        contexts,
        counts,
        impl.scale,
        read=flash_tree_attention.read_paged_kv,
    )
    out_s, lse_s = suffix_attention(query, key, value, rows, trees.mask, impl.scale)
    want = merge(out_p, lse_p, out_s[flat_slots], lse_s[flat_slots])
    output = torch.zeros_like(query)
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
        impl.scale,
    )
    torch.testing.assert_close(output[flat_rows].float(), want, atol=2e-2, rtol=0)
