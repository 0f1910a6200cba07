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
   (score desc, enumeration index) in a bitonic network of 64, 256 or the beam width (a runtime
   branch on the count); beyond the beam width, beam-sized chunks sorted and bitonic-merged.
3. merged (bitonic merge) into ``top``, the best ``budget`` prefixes so far in the global order
   (score desc, depth asc, position asc), which gives the new ``bound``.

When more candidates than the beam width reach the bound, the bound is first raised with the
depth's rank-0 column (frontier prefix + best token, valid prefixes in sorted order), which cuts
the chunked sorting by ~20-30% on peaked drafts.

Once no candidate reaches ``bound``, no deeper one can (scores only fall): the remaining depths
hold only the argmax chain (for ``chain_seed``). ``top`` ends as the torch global top-``budget``;
with ``chain_seed`` the chain (position 0 of the first min(D, budget) depths) plus the best
``budget - min(D, budget)`` other prefixes of ``top``. Nodes are laid out in that order (the
chain first), so every prefix of the slots is the tree of a smaller budget.
Typical cost: a few full-size depths (B=1024: a few sorts of 1024) and cheap ones after.
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
    pdl_enter,
)

EMPTY = tl.constexpr(-(2**63))  # an empty key slot: below every packed key


@triton.jit
def _compare_exchange_desc(h, AXIS: tl.constexpr, DIMS: tl.constexpr):
    """One half-cleaner step on the hypercube ``h [2] * DIMS`` along ``AXIS``: the 0 side keeps
    the max of each pair, the 1 side the min. The partner comes from an xor-sum over the pair
    (a ^ (a ^ b) = b), which stays in registers or shuffles, unlike a reshape/permute."""
    partner = h ^ tl.xor_sum(h, AXIS, keep_dims=True)
    side = tl.reshape(tl.arange(0, 2), [1] * AXIS + [2] + [1] * (DIMS - 1 - AXIS))
    return tl.where(side == 1, tl.minimum(h, partner), tl.maximum(h, partner))


@triton.jit
def _merge_top(top, new, BP: tl.constexpr, LOG2_BP: tl.constexpr):
    """The best ``BP`` of two descending int64 key lists ``[BP]``: a bitonic merge of ``top``
    followed by ``new`` reversed, on the hypercube [i bits..., list bit]."""
    rising = tl.gather(new, BP - 1 - tl.arange(0, BP), 0)
    DIMS: tl.constexpr = LOG2_BP + 1
    h = tl.reshape(tl.join(top, rising), [2] * DIMS)  # merged index = list * BP + i
    h = _compare_exchange_desc(h, DIMS - 1, DIMS)  # stride BP: the list bit
    for axis in tl.static_range(LOG2_BP):  # then the bits of i, most significant first
        h = _compare_exchange_desc(h, axis, DIMS)
    best, _ = tl.split(tl.reshape(h, [BP, 2]))
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
def _sorted_candidates(score, lp, start, num, first,
                       BP: tl.constexpr, KP: tl.constexpr, SIZE: tl.constexpr,
                       LOG2_BP: tl.constexpr):  # fmt: skip
    """Keys of candidates ``first .. first+SIZE-1`` (of ``num``, enumerated in (parent, rank)
    order; ``start [BP]`` = each frontier prefix's first index), sorted descending ``[SIZE]``."""
    cand = first + tl.arange(0, SIZE)
    row = tl.maximum(count_le(start, cand, BP, LOG2_BP + 1) - 1, 0)  # frontier prefix
    rank = cand - tl.gather(start, row, 0)
    value = tl.gather(score, row, 0) + tl.gather(lp, tl.minimum(rank, KP - 1), 0)
    keys = tl.where(cand < num, pack_key(order_key(value), cand), EMPTY)
    return tl.sort(keys, descending=True)


@triton.jit
def _padded(keys, SIZE: tl.constexpr, BP: tl.constexpr):
    """``keys [SIZE <= BP]`` widened to ``[BP]`` (the tail repeats the last key; masked later)."""
    if SIZE < BP:
        keys = tl.gather(keys, tl.minimum(tl.arange(0, BP), SIZE - 1), 0)
    return keys


@triton.jit
def _empty_tail(keys, SIZE: tl.constexpr, BP: tl.constexpr):
    """``keys [SIZE <= BP]`` widened to ``[BP]`` with empty slots after them (for a merge)."""
    if SIZE < BP:
        i = tl.arange(0, BP)
        keys = tl.where(i < SIZE, tl.gather(keys, tl.minimum(i, SIZE - 1), 0), EMPTY)
    return keys


@triton.jit
def _next_list(score, lp, cnt, num, budget,
               BP: tl.constexpr, KP: tl.constexpr, LOG2_BP: tl.constexpr,
               S1: tl.constexpr, S2: tl.constexpr):  # fmt: skip
    """The best min(num, budget) of the ``num`` candidates counted in ``cnt [BP]``, as (score,
    parent position, rank) ``[BP]``: one sort of S1 or S2 <= BP keys when they hold ``num``,
    else chunks of BP keys, each sorted and merged into the best so far."""
    start = tl.cumsum(cnt, 0) - cnt  # [BP]: first enumeration index of each frontier prefix
    if num <= S1:
        best = _padded(_sorted_candidates(score, lp, start, num, 0, BP, KP, S1, LOG2_BP), S1, BP)
    elif num <= S2:
        best = _padded(_sorted_candidates(score, lp, start, num, 0, BP, KP, S2, LOG2_BP), S2, BP)
    else:
        best = _sorted_candidates(score, lp, start, num, 0, BP, KP, BP, LOG2_BP)
        for first in range(BP, num, BP):
            # The last chunk is often short (B=1024, flat drafts: 190 of 1,214 candidates at
            # depth 2): sorted at 64 or 256 keys then, the rest of its BP slots empty.
            if num - first <= S1:
                chunk = _empty_tail(
                    _sorted_candidates(score, lp, start, num, first, BP, KP, S1, LOG2_BP), S1, BP
                )
            elif num - first <= S2:
                chunk = _empty_tail(
                    _sorted_candidates(score, lp, start, num, first, BP, KP, S2, LOG2_BP), S2, BP
                )
            else:
                chunk = _sorted_candidates(score, lp, start, num, first, BP, KP, BP, LOG2_BP)
            best = _merge_top(best, chunk, BP, LOG2_BP)
    pos = tl.arange(0, BP)
    ok = pos < tl.minimum(num, budget)
    cand = tl.where(ok, packed_index(best), 0)
    row = tl.maximum(count_le(start, cand, BP, LOG2_BP + 1) - 1, 0)
    new_score = tl.where(ok, packed_value(best), float("-inf"))
    new_parent = tl.where(ok, row, 0)
    new_rank = tl.where(ok, cand - tl.gather(start, row, 0), 0)
    return new_score, new_parent, new_rank


@triton.jit
def _tree_kernel(
    lp_ptr, ids_ptr, k, budget, depth,
    list_score_ptr, list_parent_ptr, list_rank_ptr, list_slot_ptr,
    tokens_ptr, parents_ptr, depths_ptr, scores_ptr, num_nodes_ptr,
    CHAIN: tl.constexpr, BP: tl.constexpr, LOG2_BP: tl.constexpr, KP: tl.constexpr,
    LOG2_KP: tl.constexpr, DP: tl.constexpr, NP: tl.constexpr,
    S1: tl.constexpr, S2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
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
    chain = tl.load(lp_row)  # the argmax chain's score: position 0 of every depth
    active = tl.full([], 1, tl.int1)

    for d in range(1, depth):
        chain += tl.load(lp_row + d * k)  # = score[0] + lp[0], as the torch beam sums it
        cell = lists + d * BP + pos
        total = tl.zeros([], tl.int32)
        if active:
            lp = tl.load(lp_row + d * k + kk, mask=kk < k, other=float("-inf"))  # descending
            cap = tl.where(pos < num, tl.minimum(k, budget // (pos + 1)), 0)
            cnt = _count_children(score, lp, cap, bound, KP, LOG2_KP + 1)  # [BP]
            total = tl.sum(cnt, 0)
            if total > BP:
                # Chunks of sorts ahead: first raise the bound with this depth's rank-0 column
                # (each frontier prefix + the best token: valid prefixes, already sorted).
                column = tl.where(pos < num, score + tl.load(lp_row + d * k), float("-inf"))
                column = tl.where(pos < num, pack_key(order_key(column), d * BP + pos), EMPTY)
                bound = _bound(_merge_top(top, column, BP, LOG2_BP), budget, BP)
                cnt = _count_children(score, lp, cap, bound, KP, LOG2_KP + 1)
                total = tl.sum(cnt, 0)
            if total > 0:
                score, parent, rank = _next_list(
                    score, lp, cnt, total, budget, BP, KP, LOG2_BP, S1, S2
                )
                num = tl.minimum(total, budget)
                tl.store(list_score_ptr + cell, score, mask=pos < num)
                tl.store(list_parent_ptr + cell, parent, mask=pos < num)
                tl.store(list_rank_ptr + cell, rank, mask=pos < num)
                new_keys = tl.where(pos < num, pack_key(order_key(score), d * BP + pos), EMPTY)
                last = tl.sum(tl.where(pos == budget - 1, top, 0), 0)
                if tl.max(new_keys, 0) > last:  # else nothing of this depth enters the top
                    top = _merge_top(top, new_keys, BP, LOG2_BP)
                    bound = _bound(top, budget, BP)
        if total == 0:
            # Nothing reaches the bound here, so nothing deeper will (scores only fall): from
            # now on each depth keeps only the argmax chain's prefix (for chain_seed).
            active = tl.full([], 0, tl.int1)
            tl.store(list_score_ptr + lists + d * BP, chain)
            tl.store(list_parent_ptr + lists + d * BP, 0)
            tl.store(list_rank_ptr + lists + d * BP, 0)

    # The chosen nodes, in slot order: the forced chain (slots 1..F, by depth), then the other
    # prefixes of ``top`` in its order (score desc, depth, position), as tree_from_ranked.
    in_top = (top != EMPTY) & (pos < budget)
    flat = packed_index(top)
    level = flat // BP  # [BP]: depth index 0..D-1
    cell_pos = flat % BP
    dd = tl.arange(0, DP)
    if CHAIN:
        forced = tl.minimum(depth, budget)
        other = in_top & ~((cell_pos == 0) & (level < forced))
        chosen = other & (tl.cumsum(other.to(tl.int32), 0) <= budget - forced)
    else:
        forced = 0
        chosen = in_top
    slot = forced + tl.cumsum(chosen.to(tl.int32), 0)  # [BP]: 1-based slot of each chosen
    num_nodes = forced + tl.sum(chosen.to(tl.int32), 0)
    n_slots = budget + 1
    row = req * n_slots

    # Root and padding first (slots 0 and > num_nodes), disjoint from the node stores below.
    ss = tl.arange(0, NP)
    rest = (ss < n_slots) & ((ss == 0) | (ss > num_nodes))
    tl.store(tokens_ptr + row + ss, tl.full([NP], -1, tl.int64), mask=rest)
    tl.store(parents_ptr + row + ss, tl.full([NP], -1, tl.int64), mask=rest)
    tl.store(depths_ptr + row + ss, tl.zeros([NP], tl.int64), mask=rest)
    tl.store(scores_ptr + row + ss, tl.where(ss == 0, 0.0, float("-inf")), mask=rest)

    # Each kept prefix's slot, filed under its (depth, position) cell, so children find their
    # parent's slot.
    cell = lists + level * BP + cell_pos
    tl.store(list_slot_ptr + cell, slot, mask=chosen)
    is_chain = dd < forced
    tl.store(list_slot_ptr + lists + dd * BP, dd + 1, mask=is_chain)
    tl.debug_barrier()  # the lists and slots were written by all threads of this program

    parent_pos = tl.load(list_parent_ptr + cell, mask=chosen, other=0)
    parent_cell = lists + tl.maximum(level - 1, 0) * BP + parent_pos
    parent = tl.load(list_slot_ptr + parent_cell, mask=chosen & (level > 0), other=0)
    rank = tl.load(list_rank_ptr + cell, mask=chosen, other=0)
    token = tl.load(ids_ptr + (req * depth + level) * k + rank, mask=chosen, other=-1)
    node_score = tl.load(list_score_ptr + cell, mask=chosen, other=0.0)
    tl.store(tokens_ptr + row + slot, token, mask=chosen)
    tl.store(parents_ptr + row + slot, parent.to(tl.int64), mask=chosen)
    tl.store(depths_ptr + row + slot, (level + 1).to(tl.int64), mask=chosen)
    tl.store(scores_ptr + row + slot, node_score, mask=chosen)

    # The forced chain: position 0 of depths 0..F-1 in slots 1..F, each the child of the last.
    chain_rank = tl.load(list_rank_ptr + lists + dd * BP, mask=is_chain, other=0)
    chain_token = tl.load(ids_ptr + (req * depth + dd) * k + chain_rank, mask=is_chain, other=-1)
    chain_score = tl.load(list_score_ptr + lists + dd * BP, mask=is_chain, other=0.0)
    tl.store(tokens_ptr + row + dd + 1, chain_token, mask=is_chain)
    tl.store(parents_ptr + row + dd + 1, dd.to(tl.int64), mask=is_chain)
    tl.store(depths_ptr + row + dd + 1, (dd + 1).to(tl.int64), mask=is_chain)
    tl.store(scores_ptr + row + dd + 1, chain_score, mask=is_chain)
    tl.store(num_nodes_ptr + req, num_nodes.to(tl.int64))
