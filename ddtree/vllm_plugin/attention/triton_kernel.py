"""One Triton kernel for a layer's tree attention (GPU, FlashAttention's cache layout).

The merged path (``merge.py`` + ``flash.py``) costs ~50 eager ops per
layer; this kernel does the same in one launch: per (request, block of tree slots, head) an
online softmax over the request's cached context (read through its block table) and then over
its own tree slots (the new K/V of this step, read through the slots' token rows, masked by the
ancestor mask). The GPU default (``DDTREE_TREE_ATTENTION=auto``). Checked against the merged
path with Triton's CPU interpreter (tests/test_triton_tree_attention.py) and in bf16 against a
per-slot reference at 512 slots (tests/test_gpu_graphs.py). The V1 runner's GPU path; the V2
runner's verify graphs use ``paged_tree_kernel``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(scores, v, top, total, acc):
    """Fold a tile of ``scores [BQ, BN]`` (``-inf`` where unseen) and its ``v [BN, hd]`` into
    the running row maxima ``top``, softmax sums ``total`` and outputs ``acc``."""
    new_top = tl.maximum(top, tl.max(scores, 1))
    safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # rows that have seen nothing yet
    probs = tl.exp(scores - safe[:, None])
    rescale = tl.exp(top - safe)
    total = total * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
    return new_top, total, acc


@triton.jit
def _paged_kv(cache_ptr, table_row_ptr, pos, valid, cache_block, kv_head, s_cb, s_ch, s_ct,
              dims, HEAD_DIM: tl.constexpr):  # fmt: skip
    """K and V ``[N, hd]`` of cache positions ``pos [N]`` of one request (its block table row
    at ``table_row_ptr``) in FlashAttention's logical layout (K then V in the last dim)."""
    block = tl.load(table_row_ptr + pos // cache_block, mask=valid, other=0)
    base = block.to(tl.int64) * s_cb + kv_head * s_ch + (pos % cache_block) * s_ct
    k = tl.load(cache_ptr + base[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(cache_ptr + base[:, None] + HEAD_DIM + dims[None, :], mask=valid[:, None],
                other=0.0)  # fmt: skip
    return k, v


@triton.jit
def _tree_attention_kernel(
    query_ptr, key_ptr, value_ptr, cache_ptr, out_ptr,
    rows_ptr, counts_ptr, mask_ptr, context_ptr, table_ptr,
    scale, num_slots, group, cache_block,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
    s_cb, s_ch, s_ct, s_mr, s_mq, s_tr,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group
    count = tl.load(counts_ptr + r)
    if q_block * BLOCK_Q >= count:  # a clipped tree: no slot here, skip the context walk
        return
    context = tl.load(context_ptr + r)
    dims = tl.arange(0, HEAD_DIM)
    q_slot = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_valid = q_slot < count
    q_row = tl.load(rows_ptr + r * num_slots + q_slot, mask=q_valid, other=0)
    q = tl.load(query_ptr + q_row[:, None] * s_qt + head * s_qh + dims[None, :],
                mask=q_valid[:, None], other=0.0)  # fmt: skip
    top = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)

    # The cached context: every slot sees all of it.
    for start in range(0, context, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < context
        k, v = _paged_kv(cache_ptr, table_ptr + r * s_tr, pos, valid, cache_block, kv_head,
                         s_cb, s_ch, s_ct, dims, HEAD_DIM)  # fmt: skip
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        top, total, acc = _online_softmax_step(scores, v, top, total, acc)

    # The tree's own slots: slot i sees slot j iff mask[r, i, j] (its ancestors and itself).
    for start in range(0, count, BLOCK_N):
        slot = start + tl.arange(0, BLOCK_N)
        valid = slot < count
        k_row = tl.load(rows_ptr + r * num_slots + slot, mask=valid, other=0)
        k = tl.load(key_ptr + k_row[:, None] * s_kt + kv_head * s_kh + dims[None, :],
                    mask=valid[:, None], other=0.0)  # fmt: skip
        v = tl.load(value_ptr + k_row[:, None] * s_vt + kv_head * s_vh + dims[None, :],
                    mask=valid[:, None], other=0.0)  # fmt: skip
        seen = tl.load(mask_ptr + r * s_mr + q_slot[:, None] * s_mq + slot[None, :],
                       mask=q_valid[:, None] & valid[None, :], other=0)  # fmt: skip
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(seen != 0, scores, float("-inf"))
        top, total, acc = _online_softmax_step(scores, v, top, total, acc)

    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + q_row[:, None] * s_ot + head * s_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])  # fmt: skip


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    mask: torch.Tensor,
    context: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    block_q: int = 16,
    block_n: int = 32,
) -> None:
    """Write the tree rows of ``output [T, H, hd]`` in one launch.

    ``query [T, H, hd]``, ``key/value [T, kvh, hd]``: the step's rows (last dim contiguous);
    ``kv_cache [num_blocks, kvh, block, 2 * hd]`` (FlashAttention's logical view); ``rows``
    long ``[R, Q]`` (token row per slot), ``counts`` int32 ``[R]`` (scheduled slots),
    ``mask`` bool ``[R, Q, Q]``, ``context`` int32 ``[R]``, ``block_tables`` int32 ``[R, M]``.
    """
    num_reqs, num_slots = rows.shape
    num_heads, head_size = query.shape[1:]
    group = num_heads // key.shape[1]
    for name, t in (("query", query), ("key", key), ("value", value), ("output", output),
                    ("kv_cache", kv_cache)):  # fmt: skip
        if t.stride(-1) != 1:
            raise ValueError(f"tree_attention: {name} must have a contiguous last dimension")
    mask_u8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    if mask_u8.stride(2) != 1:
        raise ValueError("tree_attention: mask must have a contiguous last dimension")
    grid = (num_reqs, triton.cdiv(num_slots, block_q), num_heads)
    _tree_attention_kernel[grid](
        query, key, value, kv_cache, output,
        rows, counts, mask_u8, context, block_tables,
        scale, num_slots, group, kv_cache.shape[2],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), output.stride(0), output.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        mask_u8.stride(0), mask_u8.stride(1), block_tables.stride(0),
        HEAD_DIM=head_size, BLOCK_Q=block_q, BLOCK_N=block_n,
    )  # fmt: skip
