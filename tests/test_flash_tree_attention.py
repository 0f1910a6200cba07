"""The FlashAttention cache layout's reader and KV moves (run on the CPU), and the tree
attention's parts over it (the context part with the reference reader).

The cache is built the way vLLM 0.26's FLASH_ATTN backend allocates it: memory in NHD order
``[num_blocks, block_size, num_kv_heads, 2 * head_size]``, handed to the layer as the logical
view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.
"""

import pytest
import torch

from ddtree.vllm_plugin.attention.cpu import prefix_attention
from ddtree.vllm_plugin.attention.flash import copy_slots, read_paged_kv
from ddtree.vllm_plugin.attention.merge import merge, suffix_attention

HEADS, KV_HEADS, HEAD, BLOCK = 4, 2, 16, 16


def _cache(seq_len: int, gen: torch.Generator, layout: str = "NHD"):
    used = -(-seq_len // BLOCK)
    num_blocks = 2 * used + 3
    if layout == "NHD":
        memory = torch.zeros(num_blocks, BLOCK, KV_HEADS, 2 * HEAD)
        kv_cache = memory.permute(0, 2, 1, 3)  # the logical view vLLM passes
    else:
        kv_cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD)
    table = torch.randperm(num_blocks, generator=gen)[:used].int()
    keys = torch.randn(seq_len, KV_HEADS, HEAD, generator=gen)
    values = torch.randn(seq_len, KV_HEADS, HEAD, generator=gen)
    for p in range(seq_len):  # the slot of position p: block table[p // BLOCK], offset p % BLOCK
        kv_cache[table[p // BLOCK], :, p % BLOCK] = torch.cat([keys[p], values[p]], -1)
    return kv_cache, table, keys, values


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_read_paged_kv_round_trip(layout):
    gen = torch.Generator().manual_seed(0)
    kv_cache, table, keys, values = _cache(75, gen, layout)
    got_k, got_v = read_paged_kv(kv_cache, table, 75)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)


def test_tree_mask_equals_dense_reference():
    gen = torch.Generator().manual_seed(1)
    seq_len, num_queries = 70, 9
    kv_cache, table, keys, values = _cache(seq_len, gen)
    query = torch.randn(num_queries, HEADS, HEAD, generator=gen)
    # root 0; 1, 2 children of 0; 3 child of 1; 4..8 a chain under 2
    parents = [-1, 0, 0, 1, 2, 4, 5, 6, 7]
    tree_mask = torch.zeros(num_queries, num_queries, dtype=torch.bool)
    for i in range(num_queries):
        j = i
        while j >= 0:
            tree_mask[i, j] = True
            j = parents[j]
    context = seq_len - num_queries
    scale = HEAD**-0.5
    out_p, lse_p = prefix_attention(
        query, kv_cache, table[None], [context], [num_queries], scale, read=read_paged_kv
    )
    rows = torch.arange(num_queries)[None]
    out_s, lse_s = suffix_attention(
        query, keys[context:], values[context:], rows, tree_mask[None], scale
    )
    got = merge(out_p, lse_p, out_s, lse_s)
    for i in range(num_queries):
        seen = list(range(context)) + [context + j for j in range(num_queries) if tree_mask[i, j]]
        for h in range(HEADS):
            k, v = keys[seen, h // 2], values[seen, h // 2]
            weights = torch.softmax(query[i, h] @ k.T * HEAD**-0.5, -1)
            torch.testing.assert_close(got[i, h], weights @ v, atol=1e-5, rtol=1e-5)


def test_compact_moves_the_path_and_keeps_the_rest():
    gen = torch.Generator().manual_seed(2)
    start, width = 37, 20
    kv_cache, table, keys, values = _cache(start + width, gen)
    path = torch.tensor([0, 2, 5, 6, 11, 19])

    def slot(pos):
        return table[pos // BLOCK].long() * BLOCK + pos % BLOCK

    copy_slots(kv_cache, slot(start + path), slot(start + torch.arange(len(path))))
    got_k, got_v = read_paged_kv(kv_cache, table, start + width)
    want_k, want_v = keys.clone(), values.clone()
    want_k[start : start + len(path)] = keys[start + path]
    want_v[start : start + len(path)] = values[start + path]
    assert torch.equal(got_k[: start + len(path)], want_k[: start + len(path)])
    assert torch.equal(got_v[: start + len(path)], want_v[: start + len(path)])
    assert torch.equal(got_k[:start], keys[:start])  # the context is untouched
