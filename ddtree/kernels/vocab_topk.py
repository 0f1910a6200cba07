"""The vocabulary stage in Triton; torch reference: :func:`ddtree.tree.draft_topk`.

Per row (request, depth) of the draft logits ``[b, D, V]`` (bf16, fp16 or fp32): the top-``k``
tokens ranked by (logit descending, token id ascending), their float32 log-probs ``logit - lse``
(clamped at ``LOGPROB_FLOOR``) and the row's logsumexp ``lse``. Log-softmax is monotone within a
row, so the top-``k`` by logit are the top-``k`` by log-prob. Four launches, no host sync:

1. ``_segment_kernel`` (rows x P programs, ``P = ceil(V / segment)``): per segment of a row, its
   max and sum of exp (for lse), and the maximum of each chunk of ``chunk`` (16) tokens.
2. ``_threshold_kernel`` (rows): lse, and a key ``T`` with between ``k`` and ``k + slack`` chunk
   maxima >= T (bisection over the row's ~V/16 of them, stopped as soon as the count is in
   range; the exact k-th largest maximum on heavy ties): >= ``k`` chunks hold a token >= T, so
   every top-k token is >= T; the tokens >= T ("survivors") lie in those chunks, ~1.07 per
   chunk for random logits, so slack is chosen to keep them within the bitonic path's size.
3. ``_compact_kernel`` (rows x P): the survivors appended to a per-row buffer as int64 sort keys
   (float order bits << 32 | 2**31 - 1 - id, all distinct), one atomic per segment; only the
   chunks whose maximum reaches T are read.
4. ``_select_kernel`` (rows): up to ``2 k`` survivors: a bitonic top-k of the buffer (the usual
   case). Up to the buffer's ``16 k``: the k-th key and then the k-th id among its ties found by
   bisection over the buffered survivors, the k winners compacted and sorted. More (heavy ties):
   the same bisection over the whole row, then the winners in id order (exact, slower).

Ids and order are exact. Log-probs are ``logit - lse`` exactly in float32 for this kernel's lse,
which differs from ``torch.logsumexp`` only by float rounding of the sum (the tests allow 1e-5 *
max(1, |lse|)).
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
    pdl_args,
    pdl_enter,
    sort_size,
)
from ddtree.tree import LOGPROB_FLOOR

SEGMENT = 8192  # tokens of a row per program in the streaming kernels (32 per thread at 8 warps)
MAX_CHUNK = 16  # tokens per chunk maximum; smaller only when the row has too few chunks
MIN_CAP = 256  # survivors the select kernel's top-k network takes at least (else 2 k)
MAX_CAP = 16384  # survivors a row's buffer holds at most (16 k at most without ties)


@triton.jit
def _row_base(logits_ptr, row, depth, s_b, s_d):
    return logits_ptr + (row // depth).to(tl.int64) * s_b + (row % depth).to(tl.int64) * s_d


@triton.jit
def _segment_kernel(
    logits_ptr, s_b, s_d, depth, vocab, stats_ptr, chunks_ptr,
    SEGMENT: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    seg = tl.program_id(1)
    num_seg = tl.num_programs(1)
    NCH: tl.constexpr = SEGMENT // CHUNK
    chunk = tl.arange(0, NCH)
    ids = seg * SEGMENT + chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    base = _row_base(logits_ptr, row, depth, s_b, s_d)
    x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)  # [NCH, CHUNK]
    chunk_max = tl.max(x, 1)  # [NCH]
    top = tl.max(chunk_max, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)  # an all -inf segment sums to 0
    total = tl.sum(tl.sum(tl.exp(x - shift), 1), 0)
    cell = row * num_seg + seg
    tl.store(stats_ptr + 2 * cell, top)
    tl.store(stats_ptr + 2 * cell + 1, total)
    # Chunks past the vocabulary hold -inf, below every token: they never raise T.
    tl.store(chunks_ptr + cell * NCH + chunk, order_key(chunk_max))


@triton.jit
def _threshold_kernel(
    stats_ptr, chunks_ptr, lse_ptr, thresh_ptr, count_ptr, num_seg, n_chunks, k, slack,
    NK: tl.constexpr, SEG_P: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    seg = tl.arange(0, SEG_P)
    real = seg < num_seg
    cell = row * num_seg + seg
    seg_max = tl.load(stats_ptr + 2 * cell, mask=real, other=float("-inf"))
    seg_sum = tl.load(stats_ptr + 2 * cell + 1, mask=real, other=0.0)
    top = tl.max(seg_max, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    tl.store(lse_ptr + row, shift + tl.log(tl.sum(seg_sum * tl.exp(seg_max - shift), 0)))

    # T: a key with k <= #{chunk keys >= T} <= k + slack (n_chunks >= k). Bisection keeps
    # #{keys >= lo} >= k and stops at the first such mid: ~8-12 dependent reductions on real
    # rows instead of the ~32 that the exact k-th largest key (reached on heavy ties) takes.
    i = tl.arange(0, NK)
    real_chunk = i < n_chunks
    keys = tl.load(chunks_ptr + row * n_chunks + i, mask=real_chunk, other=2147483647)
    lo = tl.min(keys, 0).to(tl.int64)  # every chunk is above it
    keys = tl.where(real_chunk, keys, -2147483648)
    hi = tl.max(keys, 0).to(tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        above = tl.sum((keys >= mid).to(tl.int32), 0)
        lo = tl.where(above >= k, mid, lo)
        hi = tl.where(above >= k, tl.where(above <= k + slack, mid, hi), mid - 1)
    tl.store(thresh_ptr + 2 * row, lo.to(tl.int32))
    tl.store(thresh_ptr + 2 * row + 1, order_key(top))  # the row's largest key
    tl.store(count_ptr + row, 0)


@triton.jit
def _compact_kernel(
    logits_ptr, s_b, s_d, depth, vocab, thresh_ptr, count_ptr, buf_ptr, chunks_ptr,
    CAP: tl.constexpr, SEGMENT: tl.constexpr, CHUNK: tl.constexpr, TILE_CH: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    seg = tl.program_id(1)
    NCH: tl.constexpr = SEGMENT // CHUNK
    base = _row_base(logits_ptr, row, depth, s_b, s_d)
    threshold = tl.load(thresh_ptr + 2 * row)
    chunk_keys = chunks_ptr + (row * tl.num_programs(1) + seg) * NCH
    # Only chunks whose maximum reaches T hold survivors (~k + slack of a row's ~V/16): the
    # others' tokens are never read. Pass 1 counts, one atomic reserves the segment's slots,
    # pass 2 writes them (the live chunks' tokens again, now from cache).
    num = 0
    for first in tl.static_range(0, NCH, TILE_CH):
        chunk = first + tl.arange(0, TILE_CH)
        live = tl.load(chunk_keys + chunk) >= threshold  # [TILE_CH]
        ids = seg * SEGMENT + chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        real = live[:, None] & (ids < vocab)
        key = order_key(tl.load(base + ids, mask=real, other=0.0).to(tl.float32))
        num += tl.sum(tl.sum((real & (key >= threshold)).to(tl.int32), 1), 0)
    if num > 0:
        slot = tl.atomic_add(count_ptr + row, num, sem="relaxed")
        for first in tl.static_range(0, NCH, TILE_CH):
            chunk = first + tl.arange(0, TILE_CH)
            live = tl.load(chunk_keys + chunk) >= threshold
            ids = seg * SEGMENT + chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
            real = live[:, None] & (ids < vocab)
            key = order_key(tl.load(base + ids, mask=real, other=0.0).to(tl.float32))
            keep = (real & (key >= threshold)).to(tl.int32)  # [TILE_CH, CHUNK]
            per_chunk = tl.sum(keep, 1)
            at = slot + (tl.cumsum(per_chunk, 0) - per_chunk)[:, None] + tl.cumsum(keep, 1) - 1
            tl.store(buf_ptr + row * CAP + at, pack_key(key, ids), mask=(keep > 0) & (at < CAP))
            slot += tl.sum(per_chunk, 0)


@triton.jit
def _kth_of_buffer(packed, real, lo, hi, k, vocab):
    """The k-th largest key of the survivors ``packed [CAP]`` (given lo <= it <= hi), then the
    largest id taken among its ties: the keep rule is (key > kth) | (key == kth & id <= id_max)."""
    key = (packed >> 32).to(tl.int32)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        above = tl.sum(((key >= mid) & real).to(tl.int32), 0)
        lo = tl.where(above >= k, mid, lo)
        hi = tl.where(above >= k, hi, mid - 1)
    need = k - tl.sum(((key > lo) & real).to(tl.int32), 0)  # ties to take, smallest ids first
    tie_id = tl.where(real & (key == lo), packed_index(packed), vocab)
    id_lo = tl.zeros([], tl.int32)
    id_hi = vocab - 1
    while id_lo < id_hi:  # the smallest id_max with #{tie ids <= id_max} >= need
        mid = (id_lo + id_hi) // 2
        below = tl.sum((tie_id <= mid).to(tl.int32), 0)
        id_lo = tl.where(below >= need, id_lo, mid + 1)
        id_hi = tl.where(below >= need, mid, id_hi)
    return lo, id_lo


@triton.jit
def _kth_of_row(base, vocab, lo, hi, k, TILE: tl.constexpr):
    """:func:`_kth_of_buffer` over the whole row (too many survivors were tied to buffer)."""
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        above = 0
        for start in range(0, vocab, TILE):
            ids = start + tl.arange(0, TILE)
            x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
            above += tl.sum(((order_key(x) >= mid) & (ids < vocab)).to(tl.int32), 0)
        lo = tl.where(above >= k, mid, lo)
        hi = tl.where(above >= k, hi, mid - 1)
    need = k
    for start in range(0, vocab, TILE):
        ids = start + tl.arange(0, TILE)
        x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
        need -= tl.sum(((order_key(x) > lo) & (ids < vocab)).to(tl.int32), 0)
    # Ties are taken in id order here, so the largest id taken is found in the final pass.
    return lo, need


@triton.jit
def _select_kernel(
    logits_ptr, s_b, s_d, depth, vocab, thresh_ptr, count_ptr, lse_ptr, buf_ptr, picked_ptr,
    logprobs_ptr, ids_ptr, k, floor,
    CAP_SMALL: tl.constexpr, CAP: tl.constexpr, KP: tl.constexpr, TILE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    buf = buf_ptr + row * CAP
    picked = picked_ptr + row * KP
    num = tl.load(count_ptr + row)
    if num <= CAP_SMALL:  # the usual case: a bitonic top-k of the survivors
        slot = tl.arange(0, CAP_SMALL)
        best = tl.topk(tl.load(buf + slot, mask=slot < num, other=-(2**63)), KP)
    else:  # exactly k winners into `picked`, then sorted
        lo = tl.load(thresh_ptr + 2 * row).to(tl.int64)
        hi = tl.load(thresh_ptr + 2 * row + 1).to(tl.int64)
        if num <= CAP:
            slot = tl.arange(0, CAP)
            real = slot < num
            packed = tl.load(buf + slot, mask=real, other=0)
            kth, id_max = _kth_of_buffer(packed, real, lo, hi, k, vocab)
            key = (packed >> 32).to(tl.int32)
            keep = real & ((key > kth) | ((key == kth) & (packed_index(packed) <= id_max)))
            at = tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(picked + at, packed, mask=keep)
        else:
            base = _row_base(logits_ptr, row, depth, s_b, s_d)
            kth, need = _kth_of_row(base, vocab, lo, hi, k, TILE)
            taken = 0
            ties = 0
            for start in range(0, vocab, TILE):  # in id order: the first `need` ties
                ids = start + tl.arange(0, TILE)
                real = ids < vocab
                key = order_key(tl.load(base + ids, mask=real, other=0.0).to(tl.float32))
                tie = real & (key == kth)
                tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
                keep = real & ((key > kth) | (tie & (tie_rank < need)))
                at = taken + tl.cumsum(keep.to(tl.int32), 0) - 1
                tl.store(picked + at, pack_key(key, ids), mask=keep)
                taken += tl.sum(keep.to(tl.int32), 0)
                ties += tl.sum(tie.to(tl.int32), 0)
        tl.debug_barrier()  # `picked` was written by other threads of this program
        rank = tl.arange(0, KP)
        best = tl.sort(tl.load(picked + rank, mask=rank < k, other=-(2**63)), descending=True)
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
    chunks: torch.Tensor  # int32 [rows, n_chunks]: order key of each chunk's maximum
    thresh: torch.Tensor  # int32 [rows, 2]: survivor threshold key, largest key
    count: torch.Tensor  # int32 [rows]: survivors
    buf: torch.Tensor  # int64 [rows, CAP]: survivors' packed keys
    picked: torch.Tensor  # int64 [rows, KP]: the k winners when they were selected exactly
    lse: torch.Tensor  # float32 [b, D]: logsumexp of each row (an output)


def _plan(vocab: int, k: int) -> tuple[int, int, int, int, int]:
    """(segment, P, chunk, cap_small, cap) for one row of ``vocab`` tokens and top-``k``."""
    segment = min(SEGMENT, max(16, next_pow2(vocab)))
    num_seg = -(-vocab // segment)
    # >= 2k chunks per row (so that T is a tight bound) and >= 16 per segment.
    chunk = min(MAX_CHUNK, max(1, segment // 16))
    while chunk > 1 and num_seg * (segment // chunk) < 2 * k:
        chunk //= 2
    cap_small = max(MIN_CAP, 2 * sort_size(k))
    cap = max(cap_small, min(chunk * sort_size(k), MAX_CAP))  # all survivors but ties fit
    return segment, num_seg, chunk, cap_small, cap


def threshold_slack(k: int, cap_small: int) -> int:
    """Chunks past ``k`` the threshold may keep: their survivors (~1.07 per chunk on random
    rows) still fit the select kernel's bitonic path of ``cap_small`` keys."""
    return max(0, (cap_small - k) // 2)


def threshold_num_warps(n_chunks: int) -> int:
    return 16 if n_chunks > 4096 else 8  # ~32 chunk keys per thread


def select_num_warps(cap: int) -> int:
    return 16 if cap > 4096 else (8 if cap > 512 else 4)


def vocab_workspace(
    batch: int, depth: int, vocab: int, k: int, device: torch.device | str
) -> VocabWorkspace:
    segment, num_seg, chunk, _, cap = _plan(vocab, k)
    rows = batch * depth
    return VocabWorkspace(
        stats=torch.empty(rows, num_seg, 2, dtype=torch.float32, device=device),
        chunks=torch.empty(rows, num_seg * (segment // chunk), dtype=torch.int32, device=device),
        thresh=torch.empty(rows, 2, dtype=torch.int32, device=device),
        count=torch.empty(rows, dtype=torch.int32, device=device),
        buf=torch.empty(rows, cap, dtype=torch.int64, device=device),
        picked=torch.empty(rows, sort_size(k), dtype=torch.int64, device=device),
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
    segment, num_seg, chunk, cap_small, cap = _plan(vocab, k)
    n_chunks = num_seg * (segment // chunk)
    ws = workspace or vocab_workspace(batch, depth, vocab, k, device)
    if ws.buf.shape != (batch * depth, cap) or ws.chunks.shape[1] != n_chunks:
        raise ValueError("draft_topk_fused: workspace was made for another shape")
    if out is None:
        out = (
            torch.empty(batch, depth, k, dtype=torch.float32, device=device),
            torch.empty(batch, depth, k, dtype=torch.long, device=device),
        )
    logprobs, token_ids = out
    rows = batch * depth
    s_b, s_d = draft_logits.stride(0), draft_logits.stride(1)
    launch = pdl_args(device)
    _segment_kernel[(rows, num_seg)](
        draft_logits, s_b, s_d, depth, vocab, ws.stats, ws.chunks,
        SEGMENT=segment, CHUNK=chunk, **launch, num_warps=8,
    )  # fmt: skip
    _threshold_kernel[(rows,)](
        ws.stats, ws.chunks, ws.lse, ws.thresh, ws.count, num_seg, n_chunks, k,
        threshold_slack(k, cap_small), NK=next_pow2(n_chunks), SEG_P=next_pow2(num_seg),
        **launch, num_warps=threshold_num_warps(n_chunks),
    )  # fmt: skip
    _compact_kernel[(rows, num_seg)](
        draft_logits, s_b, s_d, depth, vocab, ws.thresh, ws.count, ws.buf, ws.chunks,
        CAP=cap, SEGMENT=segment, CHUNK=chunk, TILE_CH=min(segment // chunk, 2048 // chunk),
        **launch, num_warps=8,
    )  # fmt: skip
    _select_kernel[(rows,)](
        draft_logits, s_b, s_d, depth, vocab, ws.thresh, ws.count, ws.lse, ws.buf, ws.picked,
        logprobs, token_ids, k, LOGPROB_FLOOR,
        CAP_SMALL=cap_small, CAP=cap, KP=sort_size(k), TILE=min(segment, 4096),
        **launch, num_warps=select_num_warps(cap),
    )  # fmt: skip
    return logprobs, token_ids
