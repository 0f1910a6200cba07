"""Tree attention over the paged KV cache in one Triton kernel, for full CUDA graphs.

Every input is a persistent buffer of the runner or of DDTree (the step's query rows, the
cache, ``query_start_loc``, ``seq_lens``, the batch's block table, DDTree's ``tree_rows`` and
per-request tree tables), and every per-step quantity is read on the device, so a launch
recorded in a CUDA graph stays right when the graph is replayed for another step.

The step's own K/V are already in the cache (vLLM writes them before attention, at sequential
slots ``context + j``), so a tree slot ``i`` attends to the cached positions ``< context`` and to
``context + j`` for each tree slot ``j`` that is ``i`` or one of its ancestors:
``depth[j] <= depth[i]`` and ``ancestors[i, depth[i] - depth[j]] == j``. Query heads that share
a KV head are computed together (each K/V tile is loaded once for the group); softmax and the
output accumulate in float32. Optionally (``context_splits``) the keys are cut into shares
attended by programs of their own, then merged by log-sum-exp: a long context's key blocks
are otherwise one program's serial loop (timed: ``benchmarks/paged_tree_time.py``).

Reference: ``merge.attend_with_lse`` per slot over the context and the slot's ancestors
(tests/test_paged_tree_kernel.py, Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.vllm_plugin.attention.triton_kernel import _online_softmax_step, _paged_kv


@triton.jit
def _tree_slot_rows(qsl_ptr, r, q_block, kv_head, group, first_slot,
                    BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr):  # fmt: skip
    """The rows one program serves: request ``r``'s slots ``first_slot + q_block * BLOCK_Q``
    on, each with the query heads of KV head ``kv_head`` (padded to GROUP_PAD). Returns the
    request's slot count, and per row its slot, head, validity and token row."""
    q_start = tl.load(qsl_ptr + r)
    count = tl.load(qsl_ptr + r + 1) - q_start
    m = tl.arange(0, BLOCK_Q * GROUP_PAD)  # row = (slot, head of the group)
    slot = first_slot + q_block * BLOCK_Q + m // GROUP_PAD
    head_in_group = m % GROUP_PAD
    head = kv_head * group + head_in_group
    q_valid = (slot < count) & (head_in_group < group)
    return count, slot, head, q_valid, (q_start + slot).to(tl.int64)


@triton.jit
def _paged_tree_attention_kernel(
    query_ptr, cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, table_ptr, tree_rows_ptr, depths_ptr, ancestors_ptr,
    ctx_out_ptr, ctx_lse_ptr, part_out_ptr, part_lse_ptr,
    scale, group, cache_block, max_depth, first_slot,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_ch, s_ct, s_tr, s_dr, s_ar, s_aq,
    s_xt, s_xh, s_lt, s_lh, s_pt, s_ph, s_ps, s_mt, s_mh,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, CONTEXT_GIVEN: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS  # which share of the keys (SPLITS > 1)
    state = tl.load(tree_rows_ptr + r)
    if state < 0:  # not a tree request (prefill, padding): the backend's output stands
        return
    count, slot, head, q_valid, q_row = _tree_slot_rows(
        qsl_ptr, r, q_block, kv_head, group, first_slot, BLOCK_Q, GROUP_PAD
    )
    if first_slot + q_block * BLOCK_Q >= count:
        # no slot of this request here: the grid covers the step's longest query (a prefill's,
        # in a mixed step), and a program without rows would still walk the whole context
        return
    context = tl.load(seq_lens_ptr + r) - count
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query_ptr + q_row[:, None] * s_qt + head[:, None] * s_qh + dims[None, :],
                mask=q_valid[:, None], other=0.0)  # fmt: skip
    q_depth = tl.load(depths_ptr + state * s_dr + slot, mask=q_valid, other=0)
    if CONTEXT_GIVEN:
        # The context part computed elsewhere (FlashAttention): its normalised output and
        # log-sum-exp are the online softmax's state after the context (max = lse, sum = 1).
        top = tl.load(ctx_lse_ptr + q_row * s_lt + head * s_lh, mask=q_valid,
                      other=float("-inf")).to(tl.float32)  # fmt: skip
        seen_any = top != float("-inf")
        total = tl.where(seen_any, 1.0, 0.0)
        ctx_rows = ctx_out_ptr + q_row[:, None] * s_xt + head[:, None] * s_xh
        acc = tl.load(ctx_rows + dims[None, :], mask=q_valid[:, None] & seen_any[:, None],
                      other=0.0).to(tl.float32)  # fmt: skip
        context_end = context * 0  # no context keys here (a tensor, as in the other branch)
    else:
        top = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        context_end = context

    # Keys: the cached context (every slot sees all of it), then the tree's slots (ancestors
    # and itself only). With SPLITS > 1 each program takes its share of that key sequence.
    lo, hi = 0, context_end + count
    if SPLITS > 1:
        share = tl.cdiv(tl.cdiv(hi, SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * share, hi)
        hi = tl.minimum(lo + share, hi)
    ctx_hi = tl.minimum(hi, context_end)
    for start in range(tl.minimum(lo, context_end), ctx_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < ctx_hi
        k, v = _paged_kv(cache_ptr, table_ptr + r * s_tr, pos, valid, cache_block, kv_head,
                         s_cb, s_ch, s_ct, dims, HEAD_DIM)  # fmt: skip
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        top, total, acc = _online_softmax_step(scores, v, top, total, acc)

    # The tree's slots, in the cache right after the context.
    tree_hi = tl.maximum(hi - context_end, 0)
    for start in range(tl.maximum(lo - context_end, 0), tree_hi, BLOCK_N):
        k_slot = start + tl.arange(0, BLOCK_N)
        valid = k_slot < tree_hi
        pos = context + k_slot
        k, v = _paged_kv(cache_ptr, table_ptr + r * s_tr, pos, valid, cache_block, kv_head,
                         s_cb, s_ch, s_ct, dims, HEAD_DIM)  # fmt: skip
        k_depth = tl.load(depths_ptr + state * s_dr + k_slot, mask=valid, other=0)
        up = q_depth[:, None] - k_depth[None, :]  # [M, N]: levels from the query up to the key
        pair = q_valid[:, None] & valid[None, :] & (up >= 0) & (up <= max_depth)
        ancestor = tl.load(ancestors_ptr + state * s_ar + slot[:, None] * s_aq + up,
                           mask=pair, other=-1)  # fmt: skip
        seen = ancestor == k_slot[None, :]
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(seen, scores, float("-inf"))
        top, total, acc = _online_softmax_step(scores, v, top, total, acc)

    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + q_row[:, None] * s_ot + head[:, None] * s_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])  # fmt: skip
    else:  # this share's normalised output and log-sum-exp (-inf: it saw no key)
        lse = tl.where(total == 0.0, float("-inf"), top + tl.log(tl.maximum(total, 1e-30)))
        part = part_out_ptr + q_row[:, None] * s_pt + head[:, None] * s_ph + split * s_ps
        tl.store(part + dims[None, :], out, mask=q_valid[:, None])
        tl.store(part_lse_ptr + q_row * s_mt + head * s_mh + split, lse, mask=q_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, qsl_ptr, tree_rows_ptr, group, first_slot,
    s_ot, s_oh, s_pt, s_ph, s_ps, s_mt, s_mh,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    """The SPLITS shares of each tree row into its output (rows as the main kernel lays them
    out, BLOCK_Q slots a program)."""
    r = tl.program_id(0)
    if tl.load(tree_rows_ptr + r) < 0:
        return
    count, _, head, q_valid, q_row = _tree_slot_rows(
        qsl_ptr, r, tl.program_id(1), tl.program_id(2), group, first_slot, BLOCK_Q, GROUP_PAD
    )
    if first_slot + tl.program_id(1) * BLOCK_Q >= count:
        return
    dims = tl.arange(0, HEAD_DIM)
    lse_rows = part_lse_ptr + q_row * s_mt + head * s_mh
    top = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(lse_rows + s, mask=q_valid, other=float("-inf")))
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
    part_rows = part_out_ptr + q_row[:, None] * s_pt + head[:, None] * s_ph + dims[None, :]
    for s in tl.static_range(SPLITS):
        weight = tl.exp(tl.load(lse_rows + s, mask=q_valid, other=float("-inf")) - safe)
        share = tl.load(part_rows + s * s_ps, mask=q_valid[:, None] & (weight > 0)[:, None],
                        other=0.0)  # fmt: skip
        total += weight
        acc += weight[:, None] * share
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + q_row[:, None] * s_ot + head[:, None] * s_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])  # fmt: skip


ROWS_PER_PROGRAM = 64  # the default launch: query rows (slots x heads of a group) a program


def _slot_blocks(rows_per_program: int, group: int) -> tuple[int, int]:
    """(GROUP_PAD, BLOCK_Q) of a launch: a program serves BLOCK_Q slots x GROUP_PAD heads (the
    group's query heads, padded to a power of two)."""
    group_pad = triton.next_power_of_2(group)
    return group_pad, max(1, rows_per_program // group_pad)


def shares_for_grid(
    num_reqs: int,
    max_query_len: int,
    first_slot: int,
    num_kv_heads: int,
    group: int,
    num_sms: int,
    max_shares: int,
    rows_per_program: int = ROWS_PER_PROGRAM,
) -> int:
    """How many context shares a launch of ``paged_tree_attention`` should use: the most (a
    power of two, at most ``max_shares``) that keep the split grid within one wave of the
    GPU's ``num_sms`` multiprocessors. A small grid (a request or two at B=63: 24 programs a
    layer on 132 SMs) leaves most of the GPU idle while each program walks its request's whole
    context; a full grid (many requests or a wide tree) gains nothing and pays the merge.
    Timed on an H100 at Qwen3-8B shapes (``benchmarks/results/h100_2026-12-08/``): one request
    at B=63 runs 4 shares in 15 / 22 / 53 us at contexts 128 / 1024 / 4096 against 17 / 55 /
    185 unsplit; 8 requests at B=255 run 4 shares 1.5x slower. The launch shape is fixed per
    (request bucket, budget), so a CUDA graph captures its choice."""
    _, block_q = _slot_blocks(rows_per_program, group)
    programs = num_reqs * triton.cdiv(max(max_query_len - first_slot, 0), block_q) * num_kv_heads
    shares = 1
    if programs == 0:  # nothing to launch
        return shares
    while shares * 2 <= max_shares and programs * shares * 2 <= num_sms:
        shares *= 2
    return shares


def split_scratch(
    rows: int, heads: int, splits: int, head_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``context_splits``' float32 scratch for ``rows`` query rows: each share's output
    ``[rows, heads, splits, head_size]`` and log-sum-exp ``[rows, heads, splits]``."""
    return (
        torch.empty(rows, heads, splits, head_size, dtype=torch.float32, device=device),
        torch.empty(rows, heads, splits, dtype=torch.float32, device=device),
    )


def paged_tree_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    tree_rows: torch.Tensor,
    depths: torch.Tensor,
    ancestors: torch.Tensor,
    scale: float,
    max_query_len: int,
    rows_per_program: int = ROWS_PER_PROGRAM,
    block_n: int = 32,
    first_slot: int = 0,
    context_out: torch.Tensor | None = None,
    context_lse: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    context_splits: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write the tree requests' rows of ``output [T, H, hd]`` from slot ``first_slot`` on (other
    rows are left alone: e.g. a forced chain's, which the backend's causal pass computes).

    ``query [T, H, hd]`` (last dim contiguous); ``kv_cache [num_blocks, kvh, block, 2 * hd]``
    (FlashAttention's / Triton attention's logical view, K then V in the last dim);
    ``query_start_loc`` int32 ``[R + 1]``, ``seq_lens`` int32 ``[R]``, ``block_table`` int32
    ``[R, max_blocks]`` (the batch's, as the backend's metadata holds them); ``tree_rows``
    int32 ``[R]``: each request's row in the tree tables, -1 for a request without a tree;
    ``depths`` int32 ``[S, Q]`` and ``ancestors`` int32 ``[S, Q, D + 1]`` (k-th ancestor,
    saturating at the root). ``max_query_len`` bounds every request's slots (<= Q).

    ``context_out [T, H, hd]`` and ``context_lse`` (``[T, H]``-indexed, any strides; natural
    log, ``-inf`` where the context is empty), both given or neither: every row's attention
    over its request's cached context, computed elsewhere (FlashAttention); the kernel then
    reads only the tree's own slots and folds them in.

    ``rows_per_program``, ``block_n``, ``num_warps``, ``num_stages``: the launch shape (Triton's
    defaults for the last two when None); ``benchmarks/paged_tree_time.py`` times the choices.
    ``context_splits`` > 1: the keys (cached context, then the tree's slots) are cut into that
    many shares, each attended by its own programs (more of them in flight for long contexts
    and wide trees, as split-KV decode kernels do), and a second launch merges the shares by
    their log-sum-exp. Their float32 scratch,
    ``partials`` = (``[T, H, splits, hd]``, ``[T, H, splits]``), is made here when not given
    (a CUDA graph needs it given: made once, outside the capture). Not with a given context.
    """
    num_reqs = tree_rows.shape[0]
    num_heads, head_size = query.shape[1:]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    for name, t in (("query", query), ("output", output), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_tree_attention: {name} must have a contiguous last dim")
    if depths.stride(1) != 1 or ancestors.stride(2) != 1:
        raise ValueError("paged_tree_attention: tree tables must be contiguous per row")
    group_pad, block_q = _slot_blocks(rows_per_program, group)
    if max_query_len <= first_slot:
        return
    given = context_out is not None
    if given != (context_lse is not None):
        raise ValueError("paged_tree_attention: give context_out and context_lse together")
    if given and context_out.stride(-1) != 1:
        raise ValueError("paged_tree_attention: context_out must have a contiguous last dim")
    ctx_out = context_out if given else output  # not read without CONTEXT_GIVEN
    ctx_lse = context_lse if given else output[:, :, 0]
    splits = context_splits
    if splits < 1 or (splits > 1 and given):
        raise ValueError(
            f"paged_tree_attention: context_splits {splits} (>= 1, and 1 with a given context)"
        )
    if splits > 1 and partials is None:
        partials = split_scratch(query.shape[0], num_heads, splits, head_size, query.device)
    part_out, part_lse = partials if splits > 1 else (output, output[:, :, 0])  # unread if 1
    grid = (num_reqs, triton.cdiv(max_query_len - first_slot, block_q), num_kv_heads * splits)
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v}
    _paged_tree_attention_kernel[grid](
        query, kv_cache, output,
        query_start_loc, seq_lens, block_table, tree_rows, depths, ancestors,
        ctx_out, ctx_lse, part_out, part_lse,
        scale, group, kv_cache.shape[2], ancestors.shape[2] - 1, first_slot,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0),
        depths.stride(0), ancestors.stride(0), ancestors.stride(1),
        ctx_out.stride(0), ctx_out.stride(1), ctx_lse.stride(0), ctx_lse.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_size, BLOCK_Q=block_q, GROUP_PAD=group_pad, BLOCK_N=block_n,
        CONTEXT_GIVEN=given, SPLITS=splits, **launch,
    )  # fmt: skip
    if splits > 1:
        _, merge_q = _slot_blocks(16, group)  # 16 rows a program: larger tiles spill on sm_90
        merge_grid = (num_reqs, triton.cdiv(max_query_len - first_slot, merge_q), num_kv_heads)
        _merge_splits_kernel[merge_grid](
            output, part_out, part_lse, query_start_loc, tree_rows, group, first_slot,
            output.stride(0), output.stride(1), part_out.stride(0), part_out.stride(1),
            part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=head_size, BLOCK_Q=merge_q, GROUP_PAD=group_pad, SPLITS=splits,
        )  # fmt: skip
