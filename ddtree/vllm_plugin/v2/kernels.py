"""Small Triton kernels of the V2 glue: which batch rows verify a tree, and their positions.

Run eagerly between vLLM's graphs, on device values only (no host read), so async
scheduling keeps going.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_positions_kernel(
    tree_rows_ptr, positions_ptr, qsl_ptr, cu_logits_ptr, idx_mapping_ptr, depths_ptr,
    depths_stride, num_reqs,
    FIND_TREES: tl.constexpr, AT_DEPTH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    if FIND_TREES:
        # A request verifies a tree iff it has draft logits (more than its one bonus row).
        real = r < num_reqs
        num_logits = tl.load(cu_logits_ptr + r + 1, mask=real, other=0) - tl.load(
            cu_logits_ptr + r, mask=real, other=0
        )
        state = tl.load(idx_mapping_ptr + r, mask=real, other=-1)
        state = tl.where(num_logits > 1, state, -1)
        tl.store(tree_rows_ptr + r, state)
    else:
        state = tl.load(tree_rows_ptr + r)
    if state < 0:
        return
    q_start = tl.load(qsl_ptr + r)
    count = tl.load(qsl_ptr + r + 1) - q_start
    root = tl.load(positions_ptr + q_start)
    for first in range(0, count, BLOCK):
        slot = first + tl.arange(0, BLOCK)
        valid = slot < count
        if AT_DEPTH:
            offset = tl.load(depths_ptr + state * depths_stride + slot, mask=valid, other=0)
        else:
            offset = slot
        tl.store(positions_ptr + q_start + slot, root + offset, mask=valid)


def mark_trees_and_depth_positions(
    tree_rows: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    depths: torch.Tensor,
    num_reqs: int,
) -> None:
    """``tree_rows [R_pad]`` := each request's tree-table row (its request-state row) if it
    verifies a tree this step, else -1 (prefill, padding); then each tree request's positions
    ``root + depth[slot]`` in place (RoPE sees depths; KV slots stay sequential)."""
    _tree_positions_kernel[(tree_rows.shape[0],)](
        tree_rows, positions, query_start_loc, cu_num_logits, idx_mapping, depths,
        depths.stride(0), num_reqs, FIND_TREES=True, AT_DEPTH=True, BLOCK=128,
    )  # fmt: skip


def sequential_positions(
    tree_rows: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor
) -> None:
    """Each tree request's positions back to ``root + slot`` (the drafter's view)."""
    _tree_positions_kernel[(tree_rows.shape[0],)](
        tree_rows, positions, query_start_loc, query_start_loc, tree_rows, tree_rows, 0, 0,
        FIND_TREES=False, AT_DEPTH=False, BLOCK=128,
    )  # fmt: skip


def depth_positions(
    tree_rows: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    depths: torch.Tensor,
) -> None:
    """Each tree request's positions ``root + depth[slot]`` in place, in every section of a
    multi-dimensional RoPE's ``positions [sections, tokens]`` (M-RoPE: a decode row's sections
    share one offset from the root, so a node at depth d sits d past it in each)."""
    for section in positions:
        _tree_positions_kernel[(tree_rows.shape[0],)](
            tree_rows, section, query_start_loc, query_start_loc, tree_rows, depths,
            depths.stride(0), 0, FIND_TREES=False, AT_DEPTH=True, BLOCK=128,
        )  # fmt: skip


@triton.jit
def _tail_inputs_kernel(
    target_ptr, cu_logits_ptr, seq_lens_ptr, prefill_len_ptr, idx_mapping_ptr, qsl_ptr,
    tree_rows_ptr, node_target_ptr, num_logits_ptr, chunk_ptr, start_ptr, active_ptr,
    num_reqs, width, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    real = r < num_reqs  # rows past it pad the batch to its bucket: zeros, inactive
    first = tl.load(cu_logits_ptr + r, mask=real, other=0)
    count = tl.load(cu_logits_ptr + r + 1, mask=real, other=0) - first
    for start in range(0, width, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        row = first + tl.where(slot < count, slot, 0)  # a slot without a logit: the first's
        token = tl.load(target_ptr + row, mask=real & (slot < width), other=0)
        tl.store(node_target_ptr + r * width + slot, token.to(tl.int64), mask=slot < width)
    state = tl.load(idx_mapping_ptr + r, mask=real, other=0)
    prefill = tl.load(prefill_len_ptr + state, mask=real, other=0)
    seq_len = tl.load(seq_lens_ptr + r, mask=real, other=0)
    tl.store(num_logits_ptr + r, count.to(tl.int64))
    tl.store(chunk_ptr + r, (real & (seq_len < prefill)).to(tl.int64))
    tl.store(start_ptr + r, tl.load(qsl_ptr + r, mask=real, other=0).to(tl.int64))
    tl.store(active_ptr + r, tl.load(tree_rows_ptr + r) >= 0)


def tail_inputs(
    target: torch.Tensor,
    cu_num_logits: torch.Tensor,
    seq_lens: torch.Tensor,
    prefill_len: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_rows: torch.Tensor,
    num_reqs: int,
    out: tuple[torch.Tensor, ...],
) -> None:
    """The tree sampler's per-request inputs in one launch, into ``out`` = (node targets
    ``[R_pad, Q]`` long: the target's token at each tree slot, the first row's where a slot has
    no logit; num_logits ``[R_pad]``; chunk ``[R_pad]``: 1 for a prefill chunk that is not its
    last; start ``[R_pad]``: first token row; active ``[R_pad]`` bool: verifies a tree). Rows
    from ``num_reqs`` on pad the batch: zeros, inactive. ``target [num_logits]``: vLLM's
    sample per logits row; ``prefill_len`` by request-state row; the rest by batch row;
    ``tree_rows`` as ``prepare_step`` marked them."""
    node_target, num_logits, chunk, start, active = out
    rows, width = node_target.shape
    _tail_inputs_kernel[(rows,)](
        target, cu_num_logits, seq_lens, prefill_len, idx_mapping, query_start_loc, tree_rows,
        node_target, num_logits, chunk, start, active, num_reqs, width,
        BLOCK=min(1024, triton.next_power_of_2(width)),
    )  # fmt: skip


@triton.jit
def _chain_acceptance_kernel(
    num_sampled_ptr, cu_logits_ptr, rows_ptr, accepted_ptr, budget, BLOCK: tl.constexpr
):
    r = tl.program_id(0)
    verified = tl.load(cu_logits_ptr + r + 1) - tl.load(cu_logits_ptr + r) - 1
    num_accepted = tl.load(num_sampled_ptr + r).to(tl.int64) - 1
    for first in range(1, tl.minimum(verified, budget) + 1, BLOCK):
        k = first + tl.arange(0, BLOCK)  # budgets K
        within = k <= tl.minimum(verified, budget)
        tl.atomic_add(rows_ptr + k - 1, tl.full([BLOCK], 1, tl.int64), mask=within)
        tl.atomic_add(accepted_ptr + k - 1, tl.minimum(num_accepted, k.to(tl.int64)), mask=within)


def chain_acceptance(
    num_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    rows: torch.Tensor,
    accepted: torch.Tensor,
    interpret: bool = False,
) -> None:
    """A chain verify's :class:`ddtree.budget.AcceptanceCurve` update, one launch: for each
    request that verified ``v`` drafts (``cu_num_logits [R + 1]``) and accepted ``a``
    (``num_sampled [R]`` = a + 1), ``rows[K-1] += 1`` and ``accepted[K-1] += min(a, K)`` for
    K = 1..v (``rows``, ``accepted`` long ``[B]``). CPU tensors take the torch path (Triton's
    interpreter with ``interpret``)."""
    if not (num_sampled.is_cuda or interpret):
        num_accepted = num_sampled.long()[:, None] - 1  # [R, 1]
        verified = (cu_num_logits[1:] - cu_num_logits[:-1]).long()[:, None] - 1  # [R, 1]
        budgets = torch.arange(1, rows.shape[0] + 1, device=rows.device)  # [B]
        valid = budgets[None, :] <= verified  # [R, B]
        accepted.add_((torch.minimum(num_accepted, budgets) * valid).sum(0))
        rows.add_(valid.sum(0))
        return
    _chain_acceptance_kernel[(num_sampled.shape[0],)](
        num_sampled, cu_num_logits, rows, accepted, rows.shape[0], BLOCK=64
    )
