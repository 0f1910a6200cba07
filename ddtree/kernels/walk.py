"""Walk a batch of draft trees in one Triton launch; torch reference: :func:`ddtree.verify.walk`.

One program per request: a slot is accepted iff the target's token at its parent equals its
token, for itself and all its ancestors (propagated down the parent links); the deepest
accepted slot (the first of a depth on ties) gives the path, the bonus token and the emitted
tokens.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _walk_kernel(
    tokens_ptr, parents_ptr, depths_ptr, ancestors_ptr, target_ptr,
    path_ptr, num_accepted_ptr, bonus_ptr, emitted_ptr, accepted_ptr,
    n_slots, depth, NP: tl.constexpr, D1P: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, NP)
    ok = slot < n_slots
    row = req * n_slots
    token = tl.load(tokens_ptr + row + slot, mask=ok, other=-1)
    parent = tl.load(parents_ptr + row + slot, mask=ok, other=-1)
    step = tl.where(parent >= 0, parent, slot)
    target_at_parent = tl.load(target_ptr + row + step, mask=ok, other=-1)
    match = (((token == target_at_parent) & (token >= 0)) | (slot == 0)) & ok
    # Round r: accepted[s] = match over s and its r nearest ancestors; depth rounds cover every
    # root path. In registers: no per-round load of the [n_slots, depth + 1] ancestor table.
    accepted = match.to(tl.int32)
    up_slot = step.to(tl.int32)
    for _ in range(0, depth):
        accepted = accepted & tl.gather(accepted, up_slot, 0)
    accepted = accepted != 0
    tl.store(accepted_ptr + row + slot, accepted.to(tl.uint8), mask=ok)

    # Deepest accepted slot, the first one on ties: the max of depth * N + (N - 1 - slot).
    node_depth = tl.load(depths_ptr + row + slot, mask=ok, other=0)
    key = tl.where(accepted, node_depth * n_slots + (n_slots - 1 - slot), n_slots - 1)
    best = tl.max(key, 0)
    deepest = (n_slots - 1) - best % n_slots
    num_accepted = best // n_slots
    bonus = tl.load(target_ptr + row + deepest)
    tl.store(num_accepted_ptr + req, num_accepted)
    tl.store(bonus_ptr + req, bonus)

    step_j = tl.arange(0, D1P)  # path step j holds ancestor (num_accepted - j) of the deepest
    in_row = step_j < depth + 1
    up = tl.maximum(num_accepted - step_j, 0)
    path = tl.load(ancestors_ptr + (row + deepest) * (depth + 1) + up, mask=in_row, other=0)
    path = tl.where(step_j <= num_accepted, path, -1)
    tl.store(path_ptr + req * (depth + 1) + step_j, path, mask=in_row)
    nxt = tl.load(
        ancestors_ptr + (row + deepest) * (depth + 1) + tl.maximum(up - 1, 0), mask=in_row, other=0
    )
    drafted = tl.load(tokens_ptr + row + nxt, mask=in_row, other=-1)
    emitted = tl.where(step_j < num_accepted, drafted, -1)
    emitted = tl.where(step_j == num_accepted, bonus, emitted)
    tl.store(emitted_ptr + req * (depth + 1) + step_j, emitted, mask=in_row)
