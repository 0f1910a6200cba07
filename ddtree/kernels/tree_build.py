"""The tree stage in one Triton program per request; torch reference:
:func:`ddtree.tree.tree_from_ranked` (same nodes, slots, tie-breaks, scores, bit for bit).

The torch code keeps a beam of ``budget`` prefixes per depth and sorts it every depth. Only the
prefixes that can still enter the tree matter, so this kernel keeps, per depth, the beam's
prefixes scoring >= ``bound``, where ``bound`` is the ``budget``-th best score among all prefixes
found so far (a lower bound on the tree's last score, rising as depths are added). Those form a
prefix of the torch beam (same positions), and every tree node is among them. Per depth:

1. frontier = the previous depth's kept prefixes (sorted). For each frontier prefix i, the number
   of token ranks r with ``(i+1)(r+1) <= budget`` (the torch pruning) and ``score_i + lp[r] >=
   bound``: a binary search, since the log-probs are sorted.
2. those candidates, enumerated in (parent, rank) order (the torch tie-break order), sorted by
   (score desc, enumeration index) in a bitonic network sized to the candidate count (a runtime
   branch over a few power-of-two sizes), the best ``budget`` kept.
3. merged (bitonic merge) into ``top``, the best ``budget`` prefixes so far in the global order
   (score desc, depth asc, position asc), which gives the new ``bound``.

Once no candidate reaches ``bound``, no deeper one can (scores only fall): the remaining depths
hold only the argmax chain (for ``chain_seed``). ``top`` ends as the torch global top-``budget``;
with ``chain_seed`` the chain (position 0 of the first min(D, budget) depths) plus the best
``budget - min(D, budget)`` other prefixes of ``top``. Nodes are laid out by (depth, position).
Typical cost: a few full-size depths (B=1024: sorts of <= 4096) and cheap ones after.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ddtree.kernels._common import (
    count_le,
    order_key,
    pack_key,
    packed_index,
    packed_value,
)

EMPTY = -(2**63)


@triton.jit
def _bitonic_merge_desc(x, LOG2N: tl.constexpr):
    """Sort a bitonic sequence ``x [2**LOG2N]`` descending (half-cleaners, stride halving)."""
    N: tl.constexpr = 1 << LOG2N
    for s in tl.static_range(LOG2N):
        STRIDE: tl.constexpr = 1 << (LOG2N - 1 - s)
        pairs = tl.reshape(x, [N // (2 * STRIDE), 2, STRIDE])
        hi = tl.max(pairs, 1)
        lo = tl.min(pairs, 1)
        x = tl.reshape(tl.permute(tl.join(hi, lo), (0, 2, 1)), [N])
    return x


@triton.jit
def _merge_top(top, new, BP: tl.constexpr, LOG2_BP: tl.constexpr):
    """The best ``BP`` of two descending key lists ``[BP]``."""
    pos = tl.arange(0, BP)
    rising = tl.gather(new, BP - 1 - pos, 0)
    both = tl.reshape(tl.permute(tl.join(top, rising), (1, 0)), [2 * BP])  # top ++ rising
    both = _bitonic_merge_desc(both, LOG2_BP + 1)
    best, _ = tl.split(tl.permute(tl.reshape(both, [2, BP]), (1, 0)))
    return best


@triton.jit
def _bound(top, budget, BP: tl.constexpr):
    """The ``budget``-th best score in ``top`` (-inf while fewer were found)."""
    last = tl.sum(tl.where(tl.arange(0, BP) == budget - 1, top, 0), 0)
    return tl.where(last == EMPTY, float("-inf"), packed_value(last))


@triton.jit
def _count_children(score, lp, cap, bound, KP: tl.constexpr, STEPS: tl.constexpr):
    """Per frontier prefix: #{r < cap : score + lp[r] >= bound} (``lp [KP]`` descending)."""
    lo = tl.zeros(cap.shape, tl.int32)
    hi = cap
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = lo < hi
        ok = score + tl.gather(lp, tl.minimum(mid, KP - 1), 0) >= bound
        lo = tl.where(go & ok, mid + 1, lo)
        hi = tl.where(go & ~ok, mid, hi)
    return lo


@triton.jit
def _decode(best, row, rank, num_new, O: tl.constexpr, BP: tl.constexpr):
    """Sorted candidate keys ``best [O]`` -> (score, parent position, rank) ``[BP]`` each."""
    if O < BP:  # pad to the beam width
        q = tl.arange(0, BP)
        best = tl.gather(best, tl.minimum(q, O - 1), 0)
    q = tl.arange(0, BP)
    ok = q < num_new
    cand = tl.where(ok, packed_index(best), 0)
    score = tl.where(ok, packed_value(best), float("-inf"))
    parent = tl.where(ok, tl.gather(row, cand, 0), 0)
    rank = tl.where(ok, tl.gather(rank, cand, 0), 0)
    return score, parent, rank


@triton.jit
def _next_list(score, lp, cnt, num, budget,
               BP: tl.constexpr, KP: tl.constexpr, S: tl.constexpr, LOG2_BP: tl.constexpr):  # fmt: skip
    """The best min(num, budget) of the ``num <= S`` candidates counted in ``cnt [BP]``."""
    start = tl.cumsum(cnt, 0) - cnt  # [BP]: first enumeration index of each frontier prefix
    cand = tl.arange(0, S)
    row = tl.maximum(count_le(start, cand, BP, LOG2_BP + 1) - 1, 0)  # [S]: its frontier prefix
    rank = cand - tl.gather(start, row, 0)
    value = tl.gather(score, row, 0) + tl.gather(lp, tl.minimum(rank, KP - 1), 0)
    keys = tl.where(cand < num, pack_key(order_key(value), cand), EMPTY)
    num_new = tl.minimum(num, budget)
    if S > BP:
        return _decode(tl.topk(keys, BP), row, rank, num_new, BP, BP)
    else:
        return _decode(tl.sort(keys, descending=True), row, rank, num_new, S, BP)


@triton.jit
def _next_list_bucketed(score, lp, cnt, num, budget,
                        BP: tl.constexpr, KP: tl.constexpr, LOG2_BP: tl.constexpr,
                        S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
                        S4: tl.constexpr, S5: tl.constexpr):  # fmt: skip
    """:func:`_next_list` at the smallest of the sizes S1 < ... <= S5 that holds ``num``."""
    if num <= S1:
        a, b, c = _next_list(score, lp, cnt, num, budget, BP, KP, S1, LOG2_BP)
    elif num <= S2:
        a, b, c = _next_list(score, lp, cnt, num, budget, BP, KP, S2, LOG2_BP)
    elif num <= S3:
        a, b, c = _next_list(score, lp, cnt, num, budget, BP, KP, S3, LOG2_BP)
    elif num <= S4:
        a, b, c = _next_list(score, lp, cnt, num, budget, BP, KP, S4, LOG2_BP)
    else:
        a, b, c = _next_list(score, lp, cnt, num, budget, BP, KP, S5, LOG2_BP)
    return a, b, c


@triton.jit
def _tree_kernel(
    lp_ptr, ids_ptr, k, budget, depth,
    list_score_ptr, list_parent_ptr, list_rank_ptr,
    tokens_ptr, parents_ptr, depths_ptr, scores_ptr, num_nodes_ptr,
    CHAIN: tl.constexpr, BP: tl.constexpr, LOG2_BP: tl.constexpr, KP: tl.constexpr,
    LOG2_KP: tl.constexpr, DP: tl.constexpr, NP: tl.constexpr,
    S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, S4: tl.constexpr, S5: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    pos = tl.arange(0, BP)
    kk = tl.arange(0, KP)
    lp_row = lp_ptr + req * depth * k  # lp [b, D, k]
    lists = req * depth * BP  # lists [b, D, BP]

    # Depth 1: the ranked tokens themselves.
    num = tl.minimum(k, budget)
    score = tl.load(lp_row + pos, mask=pos < num, other=float("-inf"))  # [BP] frontier scores
    tl.store(list_score_ptr + lists + pos, score, mask=pos < num)
    tl.store(list_parent_ptr + lists + pos, tl.zeros([BP], tl.int32), mask=pos < num)
    tl.store(list_rank_ptr + lists + pos, pos, mask=pos < num)
    top = tl.where(pos < num, pack_key(order_key(score), pos), EMPTY)  # [BP] global order
    bound = _bound(top, budget, BP)
    active = tl.full([], 1, tl.int1)

    for d in range(1, depth):
        lp = tl.load(lp_row + d * k + kk, mask=kk < k, other=float("-inf"))  # [KP] descending
        cnt = tl.zeros([BP], tl.int32)
        if active:
            cap = tl.where(pos < num, tl.minimum(k, budget // (pos + 1)), 0)
            cnt = _count_children(score, lp, cap, bound, KP, LOG2_KP + 1)
        total = tl.sum(cnt, 0)
        if total == 0:  # nothing reaches the bound here or deeper: only the argmax chain
            active = tl.full([], 0, tl.int1)
            chain = tl.max(tl.where(pos == 0, score, float("-inf")), 0) + tl.load(lp_row + d * k)
            new_score = tl.where(pos == 0, chain, float("-inf"))
            new_parent = tl.zeros([BP], tl.int32)
            new_rank = tl.zeros([BP], tl.int32)
            num = tl.full([], 1, tl.int32)
        else:
            new_score, new_parent, new_rank = _next_list_bucketed(
                score, lp, cnt, total, budget, BP, KP, LOG2_BP, S1, S2, S3, S4, S5
            )
            num = tl.minimum(total, budget)
        cell = lists + d * BP + pos
        tl.store(list_score_ptr + cell, new_score, mask=pos < num)
        tl.store(list_parent_ptr + cell, new_parent, mask=pos < num)
        tl.store(list_rank_ptr + cell, new_rank, mask=pos < num)
        if active:
            new_keys = tl.where(pos < num, pack_key(order_key(new_score), d * BP + pos), EMPTY)
            last = tl.sum(tl.where(pos == budget - 1, top, 0), 0)
            if tl.max(new_keys, 0) > last:  # else nothing of this depth enters the top
                top = _merge_top(top, new_keys, BP, LOG2_BP)
                bound = _bound(top, budget, BP)
        score = new_score

    # The chosen nodes: per depth a prefix of positions, c[d] of them.
    in_top = (top != EMPTY) & (pos < budget)
    flat = packed_index(top)
    node_depth = flat // BP
    dd = tl.arange(0, DP)
    if CHAIN:
        forced = tl.minimum(depth, budget)
        other = in_top & ~((flat % BP == 0) & (node_depth < forced))
        chosen = other & (tl.cumsum(other.to(tl.int32), 0) <= budget - forced)
        per_depth = (dd < forced).to(tl.int32)
    else:
        chosen = in_top
        per_depth = tl.zeros([DP], tl.int32)
    per_depth += tl.sum(((node_depth[:, None] == dd[None, :]) & chosen[:, None]).to(tl.int32), 0)
    first_slot = 1 + tl.cumsum(per_depth, 0) - per_depth  # [DP]
    num_nodes = tl.sum(per_depth, 0)

    # Slot s -> (depth, position): slots are laid out depth by depth.
    tl.debug_barrier()  # the lists were written by all threads of this program
    slot = tl.arange(0, NP)
    real = (slot >= 1) & (slot <= num_nodes)
    level = tl.sum(((first_slot[None, :] <= slot[:, None]) & (dd[None, :] < depth)).to(tl.int32), 1)
    level = tl.minimum(tl.maximum(level - 1, 0), depth - 1)  # [NP]: depth index 0..D-1
    cell = lists + level * BP + slot - tl.gather(first_slot, level, 0)
    rank = tl.load(list_rank_ptr + cell, mask=real, other=0)
    parent_pos = tl.load(list_parent_ptr + cell, mask=real, other=0)
    node_score = tl.load(list_score_ptr + cell, mask=real, other=0.0)
    token = tl.load(ids_ptr + (req * depth + level) * k + rank, mask=real, other=-1)
    parent = tl.gather(first_slot, tl.maximum(level - 1, 0), 0) + parent_pos
    parent = tl.where(level == 0, 0, parent)
    n_slots = budget + 1
    out = req * n_slots + slot
    in_tree = slot < n_slots
    tl.store(tokens_ptr + out, tl.where(real, token, -1), mask=in_tree)
    tl.store(parents_ptr + out, tl.where(real, parent, -1).to(tl.int64), mask=in_tree)
    tl.store(depths_ptr + out, tl.where(real, level + 1, 0).to(tl.int64), mask=in_tree)
    pad_score = tl.where(slot == 0, 0.0, float("-inf"))
    tl.store(scores_ptr + out, tl.where(real, node_score, pad_score), mask=in_tree)
    tl.store(num_nodes_ptr + req, num_nodes.to(tl.int64))
