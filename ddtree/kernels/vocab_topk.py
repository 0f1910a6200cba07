"""The vocabulary stage in Triton; torch reference: :func:`ddtree.tree.draft_topk`.

Per row (request, depth) of the draft logits ``[b, D, V]`` (bf16, fp16 or fp32): the top-``k``
tokens ranked by (logit descending, token id ascending), their float32 log-probs ``logit - lse``
(clamped at ``LOGPROB_FLOOR``) and the row's logsumexp ``lse``. Log-softmax is monotone within a
row, so the top-``k`` by logit are the top-``k`` by log-prob. Four launches, no host sync:

1. ``_segment_kernel`` (rows x P programs, ``P = ceil(V / segment)``): per segment of a row, its
   max and sum of exp (for lse), and the ``L`` largest maxima of its chunks of ``chunk`` tokens.
2. ``_threshold_kernel`` (rows): lse, and ``T`` = the k-th largest of those chunk maxima: ``k``
   chunks hold a token >= T, so every top-k token is >= T (for random logits ~1.1 k tokens are).
3. ``_compact_kernel`` (rows x P): the tokens >= T ("survivors") are appended to a per-row buffer
   as int64 sort keys (float order bits << 32 | 2**31 - 1 - id) through an atomic counter.
4. ``_select_kernel`` (rows): the survivors sorted (key descending = logit descending, id
   ascending), top ``k`` written out. If more than ``cap`` survived (heavy ties), an exact but slow
   fallback in the same program: bisect the k-th key over the whole row, then keep the tokens
   above it and the smallest-id ties, in id order.

Ids and order are exact. Log-probs are ``logit - lse`` exactly in float32 for this kernel's lse,
which differs from ``torch.logsumexp`` only by float rounding of the sum (|delta| <= 1e-5 *
max(1, |lse|) is what the tests allow; it is ~1e-6 in practice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ddtree.kernels._common import (
    key_value,
    next_pow2,
    order_key,
    pack_key,
    packed_index,
    sort_size,
)
from ddtree.tree import LOGPROB_FLOOR

SEGMENT = 8192  # tokens of a row per program in the streaming kernels (32 per thread at 8 warps)
MAX_CHUNK = 16  # tokens per chunk maximum; smaller only when the row has too few chunks
MIN_CAP = 256  # survivors a row's buffer holds at least (2 x k rounded up otherwise)


@triton.jit
def _row_base(logits_ptr, row, depth, s_b, s_d):
    return logits_ptr + (row // depth).to(tl.int64) * s_b + (row % depth).to(tl.int64) * s_d


@triton.jit
def _segment_kernel(
    logits_ptr, s_b, s_d, depth, vocab, stats_ptr, lists_ptr,
    SEGMENT: tl.constexpr, CHUNK: tl.constexpr, L: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    seg = tl.program_id(1)
    num_seg = tl.num_programs(1)
    NCH: tl.constexpr = SEGMENT // CHUNK
    ids = seg * SEGMENT + tl.arange(0, NCH)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    base = _row_base(logits_ptr, row, depth, s_b, s_d)
    x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)  # [NCH, CHUNK]
    chunk_max = tl.max(x, 1)  # [NCH]
    top = tl.max(chunk_max, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)  # an all -inf segment sums to 0
    total = tl.sum(tl.sum(tl.exp(x - shift), 1), 0)
    cell = row * num_seg + seg
    tl.store(stats_ptr + 2 * cell, top)
    tl.store(stats_ptr + 2 * cell + 1, total)
    keys = order_key(chunk_max)  # chunks past the vocabulary hold -inf: below every token
    if L < NCH:
        best = tl.topk(keys, L)
    else:
        best = tl.sort(keys, descending=True)
    tl.store(lists_ptr + cell * L + tl.arange(0, L), best)


@triton.jit
def _threshold_kernel(
    stats_ptr, lists_ptr, lse_ptr, thresh_ptr, count_ptr, num_seg, k,
    L: tl.constexpr, SEG_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    seg = tl.arange(0, SEG_P)
    real = seg < num_seg
    cell = row * num_seg + seg
    seg_max = tl.load(stats_ptr + 2 * cell, mask=real, other=float("-inf"))
    seg_sum = tl.load(stats_ptr + 2 * cell + 1, mask=real, other=0.0)
    top = tl.max(seg_max, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    tl.store(lse_ptr + row, shift + tl.log(tl.sum(seg_sum * tl.exp(seg_max - shift), 0)))

    # T = the k-th largest chunk maximum (the host makes num_seg * L >= k): the largest t with
    # #{keys >= t} >= k, by bisection over the int32 key range.
    keys = tl.load(
        lists_ptr + cell[:, None] * L + tl.arange(0, L)[None, :], mask=real[:, None], other=0
    )  # [SEG_P, L]
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.max(tl.max(tl.where(real[:, None], keys, -2147483648), 1), 0).to(tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        above = tl.sum(tl.sum(((keys >= mid) & real[:, None]).to(tl.int32), 1), 0)
        lo = tl.where(above >= k, mid, lo)
        hi = tl.where(above >= k, hi, mid - 1)
    tl.store(thresh_ptr + 2 * row, lo.to(tl.int32))
    tl.store(thresh_ptr + 2 * row + 1, order_key(top))  # the row's largest key
    tl.store(count_ptr + row, 0)


@triton.jit
def _compact_kernel(
    logits_ptr, s_b, s_d, depth, vocab, thresh_ptr, count_ptr, buf_ptr,
    CAP: tl.constexpr, SEGMENT: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    seg = tl.program_id(1)
    base = _row_base(logits_ptr, row, depth, s_b, s_d)
    threshold = tl.load(thresh_ptr + 2 * row)
    for first in tl.static_range(0, SEGMENT, TILE):  # tiles keep the registers low
        ids = seg * SEGMENT + first + tl.arange(0, TILE)
        real = ids < vocab
        key = order_key(tl.load(base + ids, mask=real, other=0.0).to(tl.float32))
        keep = real & (key >= threshold)
        num = tl.sum(keep.to(tl.int32), 0)
        if num > 0:
            start = tl.atomic_add(count_ptr + row, num)
            slot = start + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(buf_ptr + row * CAP + slot, pack_key(key, ids), mask=keep & (slot < CAP))


@triton.jit
def _exact_into_buffer(base, vocab, buf, lo, hi, k, TILE: tl.constexpr):
    """Write exactly the top-``k`` packed keys of a row into ``buf`` (in id order), given
    ``lo <= k-th largest key <= hi``: bisection over full-row counts, then one pass."""
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        above = 0
        for start in range(0, vocab, TILE):
            ids = start + tl.arange(0, TILE)
            x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
            above += tl.sum(((order_key(x) >= mid) & (ids < vocab)).to(tl.int32), 0)
        if above >= k:
            lo = mid
        else:
            hi = mid - 1
    above = 0  # tokens strictly above the k-th key: all kept
    for start in range(0, vocab, TILE):
        ids = start + tl.arange(0, TILE)
        x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
        above += tl.sum(((order_key(x) > lo) & (ids < vocab)).to(tl.int32), 0)
    taken = 0
    ties = 0
    for start in range(0, vocab, TILE):
        ids = start + tl.arange(0, TILE)
        real = ids < vocab
        key = order_key(tl.load(base + ids, mask=real, other=0.0).to(tl.float32))
        tie = real & (key == lo)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        keep = real & ((key > lo) | (tie & (tie_rank < k - above)))
        slot = taken + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(buf + slot, pack_key(key, ids), mask=keep)
        taken += tl.sum(keep.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)


@triton.jit
def _select_kernel(
    logits_ptr, s_b, s_d, depth, vocab, thresh_ptr, count_ptr, lse_ptr, buf_ptr,
    logprobs_ptr, ids_ptr, k, floor,
    CAP: tl.constexpr, KP: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    buf = buf_ptr + row * CAP
    num = tl.load(count_ptr + row)
    if num > CAP:  # too many survivors (ties): exact and slow
        lo = tl.load(thresh_ptr + 2 * row).to(tl.int64)
        hi = tl.load(thresh_ptr + 2 * row + 1).to(tl.int64)
        base = _row_base(logits_ptr, row, depth, s_b, s_d)
        _exact_into_buffer(base, vocab, buf, lo, hi, k, TILE)
        tl.debug_barrier()  # the buffer was written by other threads of this program
        num = k
    slot = tl.arange(0, CAP)
    keys = tl.load(buf + slot, mask=slot < num, other=-(2**63))
    if KP < CAP:
        best = tl.topk(keys, KP)  # [KP], descending
    else:
        best = tl.sort(keys, descending=True)
    rank = tl.arange(0, KP)
    value = key_value((best >> 32).to(tl.int32))
    logprob = tl.maximum(value - tl.load(lse_ptr + row), floor)
    out = row * k + rank
    tl.store(logprobs_ptr + out, logprob, mask=rank < k)
    tl.store(ids_ptr + out, packed_index(best).to(tl.int64), mask=rank < k)


@dataclass
class VocabWorkspace:
    """Preallocated scratch and the lse output of :func:`draft_topk_fused` for one shape."""

    stats: torch.Tensor  # float32 [rows, P, 2]: per segment max and sum of exp
    lists: torch.Tensor  # int32 [rows, P, L]: per segment best chunk maxima (order keys)
    thresh: torch.Tensor  # int32 [rows, 2]: survivor threshold key, largest key
    count: torch.Tensor  # int32 [rows]: survivors
    buf: torch.Tensor  # int64 [rows, CAP]: survivors' packed keys
    lse: torch.Tensor  # float32 [b, D]: logsumexp of each row (an output)


def _plan(vocab: int, k: int) -> tuple[int, int, int, int, int]:
    """(segment, P, chunk, L, cap) for one row of ``vocab`` tokens and top-``k``."""
    segment = min(SEGMENT, next_pow2(vocab))
    num_seg = -(-vocab // segment)
    # At least 2k chunks per row, so that the k-th largest chunk maximum is a tight bound.
    chunk = MAX_CHUNK
    while chunk > 1 and num_seg * (segment // chunk) < 2 * k:
        chunk //= 2
    per_seg = min(segment // chunk, next_pow2(max(16, -(-2 * k // num_seg))))
    cap = max(MIN_CAP, 2 * sort_size(k))
    return segment, num_seg, chunk, per_seg, cap


def vocab_workspace(
    batch: int, depth: int, vocab: int, k: int, device: torch.device | str
) -> VocabWorkspace:
    segment, num_seg, _, per_seg, cap = _plan(vocab, k)
    rows = batch * depth
    return VocabWorkspace(
        stats=torch.empty(rows, num_seg, 2, dtype=torch.float32, device=device),
        lists=torch.empty(rows, num_seg, per_seg, dtype=torch.int32, device=device),
        thresh=torch.empty(rows, 2, dtype=torch.int32, device=device),
        count=torch.empty(rows, dtype=torch.int32, device=device),
        buf=torch.empty(rows, cap, dtype=torch.int64, device=device),
        lse=torch.empty(batch, depth, dtype=torch.float32, device=device),
    )


def draft_topk_fused(
    draft_logits: torch.Tensor,
    k: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    workspace: VocabWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ddtree.tree.draft_topk` in four Triton launches: ``(logprobs [b, D, k] float32,
    token_ids [b, D, k] long)``; the row lse is left in ``workspace.lse``."""
    batch, depth, vocab = draft_logits.shape
    if not 1 <= k <= min(vocab, 1024):
        raise ValueError(f"draft_topk_fused: k must be in [1, min(V, 1024)], got {k}")
    if draft_logits.stride(2) != 1:
        raise ValueError("draft_topk_fused: draft_logits must have a contiguous last dimension")
    device = draft_logits.device
    segment, num_seg, chunk, per_seg, cap = _plan(vocab, k)
    ws = workspace or vocab_workspace(batch, depth, vocab, k, device)
    if ws.buf.shape != (batch * depth, cap) or ws.lists.shape[1:] != (num_seg, per_seg):
        raise ValueError("draft_topk_fused: workspace was made for another shape")
    if out is None:
        out = (
            torch.empty(batch, depth, k, dtype=torch.float32, device=device),
            torch.empty(batch, depth, k, dtype=torch.long, device=device),
        )
    logprobs, token_ids = out
    rows = batch * depth
    s_b, s_d = draft_logits.stride(0), draft_logits.stride(1)
    _segment_kernel[(rows, num_seg)](
        draft_logits, s_b, s_d, depth, vocab, ws.stats, ws.lists,
        SEGMENT=segment, CHUNK=chunk, L=per_seg, num_warps=8,
    )  # fmt: skip
    _threshold_kernel[(rows,)](
        ws.stats, ws.lists, ws.lse, ws.thresh, ws.count, num_seg, k,
        L=per_seg, SEG_P=next_pow2(num_seg), num_warps=4,
    )  # fmt: skip
    _compact_kernel[(rows, num_seg)](
        draft_logits, s_b, s_d, depth, vocab, ws.thresh, ws.count, ws.buf,
        CAP=cap, SEGMENT=segment, TILE=min(segment, 2048), num_warps=8,
    )  # fmt: skip
    _select_kernel[(rows,)](
        draft_logits, s_b, s_d, depth, vocab, ws.thresh, ws.count, ws.lse, ws.buf,
        logprobs, token_ids, k, LOGPROB_FLOOR,
        CAP=cap, KP=sort_size(k), TILE=min(segment, 4096), num_warps=8 if cap > 512 else 4,
    )  # fmt: skip
    return logprobs, token_ids
