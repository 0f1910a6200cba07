"""Tree attention over vLLM's paged CPU KV cache agrees with vLLM's own C++ kernel."""

import pytest
import torch

pytest.importorskip("vllm")
from vllm import _custom_ops as ops  # noqa: E402

import ddtree  # noqa: E402
from ddtree.vllm_plugin.cpu_tree_attention import read_paged_kv, tree_attention  # noqa: E402

HEADS, KV_HEADS, HEAD = 4, 2, 64


def _fill_cache(isa, block_size, seq_len, gen):
    num_blocks = 2 * (-(-seq_len // block_size)) + 3
    kv_cache = torch.zeros(num_blocks, KV_HEADS, block_size, 2 * HEAD)
    block_table = torch.randperm(num_blocks, generator=gen)[: -(-seq_len // block_size)].int()
    keys = torch.randn(seq_len, KV_HEADS, HEAD, generator=gen)
    values = torch.randn(seq_len, KV_HEADS, HEAD, generator=gen)
    pos = torch.arange(seq_len)
    slots = (block_table[pos // block_size].long() * block_size + pos % block_size).long()
    view = kv_cache.view(num_blocks, KV_HEADS, block_size * 2, HEAD)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    return kv_cache, block_table, keys, values


@pytest.mark.parametrize("isa, block_size", [("vec16", 16), ("vec", 32)])
def test_read_paged_kv_round_trip(isa, block_size):
    gen = torch.Generator().manual_seed(0)
    kv_cache, table, keys, values = _fill_cache(isa, block_size, 75, gen)
    got_k, got_v = read_paged_kv(kv_cache, table, 75)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)


@pytest.mark.parametrize("isa, block_size", [("vec16", 16), ("vec", 32)])
def test_chain_mask_equals_vllm_causal_kernel(isa, block_size):
    gen = torch.Generator().manual_seed(1)
    seq_len, num_queries = 70, 17
    kv_cache, table, _, _ = _fill_cache(isa, block_size, seq_len, gen)
    query = torch.randn(num_queries, HEADS, HEAD, generator=gen)
    scale = HEAD**-0.5
    qsl = torch.tensor([0, num_queries], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD, seq_lens=seq_lens,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False,
    )  # fmt: skip
    view = kv_cache.view(kv_cache.shape[0], KV_HEADS, block_size * 2, HEAD)
    key_cache, value_cache = view.chunk(2, dim=2)
    want = torch.zeros_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=want,
        query_start_loc=qsl, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=table.view(1, -1), softcap=0.0,
        scheduler_metadata=meta, s_aux=None,
    )  # fmt: skip
    chain = torch.ones(num_queries, num_queries, dtype=torch.bool).tril()
    got = tree_attention(query, kv_cache, table, seq_len, chain, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tree_mask_matches_dense_reference():
    gen = torch.Generator().manual_seed(2)
    tree = ddtree.build_tree(torch.randn(1, 4, 30, generator=gen), 24)
    num_queries, seq_len = 25, 60
    kv_cache, table, keys, values = _fill_cache("vec16", 16, seq_len, gen)
    query = torch.randn(num_queries, HEADS, HEAD, generator=gen)
    got = tree_attention(query, kv_cache, table, seq_len, tree.mask[0], 0.125)
    # Dense reference: explicit softmax over allowed keys, each kv head shared by 2 heads.
    k = keys.repeat_interleave(HEADS // KV_HEADS, 1)
    v = values.repeat_interleave(HEADS // KV_HEADS, 1)
    allowed = torch.cat([torch.ones(num_queries, seq_len - num_queries, dtype=torch.bool),
                         tree.mask[0]], 1)  # fmt: skip
    scores = torch.einsum("qhd,khd->hqk", query, k) * 0.125
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # Rewrite node 3's K/V in the cache: exactly the rows that have node 3 as an ancestor (or
    # are node 3) change.
    slot_pos = seq_len - num_queries + 3
    slot = table[slot_pos // 16].long() * 16 + slot_pos % 16
    view = kv_cache.view(kv_cache.shape[0], KV_HEADS, 32, HEAD)
    key_cache, value_cache = view.chunk(2, dim=2)
    new_k, new_v = torch.randn(2, 1, KV_HEADS, HEAD, generator=gen)
    ops.cpu_attn_reshape_and_cache(new_k, new_v, key_cache, value_cache, slot.view(1), "vec16")
    again = tree_attention(query, kv_cache, table, seq_len, tree.mask[0], 0.125)
    changed = (again - got).abs().amax((1, 2)) > 1e-6
    assert changed.tolist() == tree.mask[0, :, 3].tolist()


@pytest.mark.parametrize("isa, block_size", [("vec16", 16), ("vec", 32)])
def test_compact_moves_the_accepted_path(isa, block_size):
    from ddtree.vllm_plugin.cpu_tree_attention import compact_paged_kv

    gen = torch.Generator().manual_seed(3)
    kv_cache, table, keys, values = _fill_cache(isa, block_size, 90, gen)
    start, path = 40, torch.tensor([0, 2, 5, 9, 30, 49])
    compact_paged_kv(kv_cache, table, start, path, isa)
    got_k, got_v = read_paged_kv(kv_cache, table, 90)
    assert torch.equal(got_k[:start], keys[:start])  # the context is untouched
    assert torch.equal(got_k[start : start + 6], keys[start + path])
    assert torch.equal(got_v[start : start + 6], values[start + path])


def test_amx_layout_is_refused():
    from ddtree.vllm_plugin.cpu_tree_attention import check_isa

    with pytest.raises(NotImplementedError, match="use dtype float32"):
        check_isa("amx")
