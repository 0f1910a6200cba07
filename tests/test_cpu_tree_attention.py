"""Tree attention over vLLM's paged CPU KV cache agrees with vLLM's own C++ kernel."""

import pytest
import torch

pytest.importorskip("vllm")
from vllm import _custom_ops as ops  # noqa: E402

import ddtree  # noqa: E402
from ddtree.vllm_plugin.attention.cpu import (  # noqa: E402
    copy_slots,
    prefix_attention,
    read_paged_kv,
)
from ddtree.vllm_plugin.attention.merge import merge, suffix_attention  # noqa: E402

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


def tree_attention(query, kv_cache, table, seq_len, tree_mask, scale, keys, values):
    """One request's tree attention the way the plugin computes it: the cached context part
    (read back from the cache) merged with the dense part over its own new K/V."""
    num_queries = query.shape[0]
    context = seq_len - num_queries
    out_p, lse_p = prefix_attention(query, kv_cache, table[None], [context], [num_queries], scale)
    rows = torch.arange(num_queries)[None]
    new_k, new_v = keys[context:seq_len], values[context:seq_len]
    out_s, lse_s = suffix_attention(query, new_k, new_v, rows, tree_mask[None], scale)
    return merge(out_p, lse_p, out_s, lse_s)


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
    kv_cache, table, keys, values = _fill_cache(isa, block_size, seq_len, gen)
    query = torch.randn(num_queries, HEADS, HEAD, generator=gen)
    scale = HEAD**-0.5
    qsl = torch.tensor([0, num_queries], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD,
        seq_lens=seq_lens,
        dtype=torch.float32,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    view = kv_cache.view(kv_cache.shape[0], KV_HEADS, block_size * 2, HEAD)
    key_cache, value_cache = view.chunk(2, dim=2)
    want = torch.zeros_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=want,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=table.view(1, -1),
        softcap=0.0,
        scheduler_metadata=meta,
        s_aux=None,
    )
    chain = torch.ones(num_queries, num_queries, dtype=torch.bool).tril()
    got = tree_attention(query, kv_cache, table, seq_len, chain, scale, keys, values)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tree_mask_matches_dense_reference():
    gen = torch.Generator().manual_seed(2)
    tree = ddtree.build_tree(torch.randn(1, 4, 30, generator=gen), 24)
    num_queries, seq_len = 25, 60
    kv_cache, table, keys, values = _fill_cache("vec16", 16, seq_len, gen)
    query = torch.randn(num_queries, HEADS, HEAD, generator=gen)
    got = tree_attention(query, kv_cache, table, seq_len, tree.mask[0], 0.125, keys, values)
    # Dense reference: explicit softmax over allowed keys, each kv head shared by 2 heads.
    k = keys.repeat_interleave(HEADS // KV_HEADS, 1)
    v = values.repeat_interleave(HEADS // KV_HEADS, 1)
    allowed = torch.cat(
        [torch.ones(num_queries, seq_len - num_queries, dtype=torch.bool), tree.mask[0]], 1
    )
    scores = torch.einsum("qhd,khd->hqk", query, k) * 0.125
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # Change node 3's K/V: exactly the rows that have node 3 as an ancestor (or are node 3)
    # change.
    keys[seq_len - num_queries + 3], values[seq_len - num_queries + 3] = torch.randn(
        2, KV_HEADS, HEAD, generator=gen
    )
    again = tree_attention(query, kv_cache, table, seq_len, tree.mask[0], 0.125, keys, values)
    changed = (again - got).abs().amax((1, 2)) > 1e-6
    assert changed.tolist() == tree.mask[0, :, 3].tolist()


def test_batched_requests_with_unscheduled_slots_equal_one_by_one():
    """Two requests in one batch (Q = 7 slots, the second with 4 scheduled), mixed in a step
    with other rows, give the same rows as each request alone."""
    gen = torch.Generator().manual_seed(4)
    trees = ddtree.build_tree(torch.randn(2, 3, 20, generator=gen), 6)
    contexts, counts = [33, 21], [7, 4]
    caches = [_fill_cache("vec16", 16, c + n, gen) for c, n in zip(contexts, counts, strict=True)]
    # One shared cache: request 1's blocks after request 0's.
    cache0, table0, k0, v0 = caches[0]
    cache1, table1, k1, v1 = caches[1]
    kv_cache = torch.cat([cache0, cache1])
    tables = torch.nn.utils.rnn.pad_sequence([table0, table1 + cache0.shape[0]], batch_first=True)
    queries = [torch.randn(n, HEADS, HEAD, generator=gen) for n in counts]
    # The step: 2 unrelated rows, request 0's 7 rows, 1 unrelated row, request 1's 4 rows.
    step_q = torch.cat(
        [torch.randn(2, HEADS, HEAD), queries[0], torch.randn(1, HEADS, HEAD), queries[1]]
    )
    step_k = torch.cat(
        [torch.randn(2, KV_HEADS, HEAD), k0[33:], torch.randn(1, KV_HEADS, HEAD), k1[21:]]
    )
    step_v = torch.cat(
        [torch.randn(2, KV_HEADS, HEAD), v0[33:], torch.randn(1, KV_HEADS, HEAD), v1[21:]]
    )
    rows = torch.tensor([[2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13, 10, 10, 10]])
    scheduled = torch.arange(7) < torch.tensor(counts)[:, None]
    flat_slots = scheduled.flatten().nonzero().squeeze(1)
    flat_rows = rows.flatten()[flat_slots]
    out_p, lse_p = prefix_attention(step_q[flat_rows], kv_cache, tables, contexts, counts, 0.125)
    out_s, lse_s = suffix_attention(step_q, step_k, step_v, rows, trees.mask, 0.125)
    got = merge(out_p, lse_p, out_s[flat_slots], lse_s[flat_slots])
    for r in range(2):
        n, c = counts[r], contexts[r]
        cache, table, keys, values = caches[r]
        want = tree_attention(
            queries[r], cache, table, c + n, trees.mask[r, :n, :n], 0.125, keys, values
        )
        first = sum(counts[:r])
        torch.testing.assert_close(got[first : first + n], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa, block_size", [("vec16", 16), ("vec", 32)])
def test_copy_slots_moves_the_accepted_path(isa, block_size):
    gen = torch.Generator().manual_seed(3)
    kv_cache, table, keys, values = _fill_cache(isa, block_size, 90, gen)
    start, path = 40, torch.tensor([0, 2, 5, 9, 30, 49])

    def slot(pos):
        return table[pos // block_size].long() * block_size + pos % block_size

    copy_slots(kv_cache, slot(start + path), slot(start + torch.arange(6)), isa)
    got_k, got_v = read_paged_kv(kv_cache, table, 90)
    assert torch.equal(got_k[:start], keys[:start])  # the context is untouched
    assert torch.equal(got_k[start : start + 6], keys[start + path])
    assert torch.equal(got_v[start : start + 6], values[start + path])


def test_amx_layout_is_refused():
    from ddtree.vllm_plugin.attention.cpu import check_isa

    with pytest.raises(NotImplementedError, match="use dtype float32"):
        check_isa("amx")
