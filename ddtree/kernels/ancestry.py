"""Ancestors, packed ancestor bits and (optionally) the bool mask of a tree in one Triton launch;
torch reference: :func:`ddtree.tree._ancestry` (plus :func:`pack_ancestor_bits` for the bits).

One program per (request, block of ``ROWS`` slots): ``D`` rounds of pointer jumping through
``parents`` give each slot's k-th ancestors (saturating at the root; the root and padding point at
themselves), OR-ed into 32-bit words; the bool mask rows are expanded from the words. The mask is
``(1 + B)^2`` bytes per request (1 MiB at B=1024, ~80% of what the launch writes): readers of
the ancestors or the bits (the V2 engine) leave it out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels._common import next_pow2, pdl_args, pdl_enter


def pack_ancestor_bits(mask: torch.Tensor) -> torch.Tensor:
    """int32 ``[b, N, ceil(N/32)]`` from the bool ``mask [b, N, N]``: bit j of word w in row i is
    ``mask[i, 32 w + j]`` (the torch reference of the kernel's packed bits)."""
    batch, n_slots, _ = mask.shape
    words = -(-n_slots // 32)
    padded = torch.nn.functional.pad(mask, (0, 32 * words - n_slots))
    padded = padded.view(batch, n_slots, words, 32)
    weights = torch.ones(32, dtype=torch.long, device=mask.device) << torch.arange(
        32, device=mask.device
    )
    packed = (padded.long() * weights).sum(-1)  # [b, N, W] in [0, 2**32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@triton.jit
def _ancestry_kernel(
    parents_ptr, ancestors_ptr, bits_ptr, mask_ptr, n_slots, depth, n_words,
    ROWS: tl.constexpr, WP: tl.constexpr, GROUP: tl.constexpr, MASK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    req = tl.program_id(0)
    slot = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    ok = slot < n_slots
    rows = req.to(tl.int64) * n_slots + slot  # [ROWS]: flat (request, slot)
    word = tl.arange(0, WP)
    node = slot  # the current ancestor of each slot
    bits = tl.where(word[None, :] == (node // 32)[:, None], 1 << (node % 32)[:, None], 0)
    tl.store(ancestors_ptr + rows * (depth + 1), node.to(tl.int64), mask=ok)
    for up in range(1, depth + 1):
        parent = tl.load(parents_ptr + req.to(tl.int64) * n_slots + node, mask=ok, other=-1)
        node = tl.where(parent >= 0, parent.to(tl.int32), node)
        tl.store(ancestors_ptr + rows * (depth + 1) + up, node.to(tl.int64), mask=ok)
        bits |= tl.where(word[None, :] == (node // 32)[:, None], 1 << (node % 32)[:, None], 0)
    tl.store(
        bits_ptr + rows[:, None] * n_words + word[None, :],
        bits,
        mask=ok[:, None] & (word[None, :] < n_words),
    )
    if not MASK:
        return
    # Mask rows, GROUP words (32 * GROUP columns) at a time; the words are picked by a masked
    # sum rather than a gather along dim 1 (which Triton 3.6 fails to compile for sm_90).
    group = tl.arange(0, GROUP)
    lane = tl.arange(0, 32)
    for first in range(0, n_words, GROUP):
        pick = word[None, None, :] == (first + group)[None, :, None]  # [1, GROUP, WP]
        words = tl.sum(tl.where(pick, bits[:, None, :], 0), 2)  # [ROWS, GROUP]
        seen = (words[:, :, None] >> lane[None, None, :]) & 1  # [ROWS, GROUP, 32]
        col = 32 * (first + group)[:, None] + lane[None, :]  # [GROUP, 32]
        tl.store(
            mask_ptr + rows[:, None, None] * n_slots + col[None, :, :],
            seen.to(tl.uint8),
            mask=ok[:, None, None] & (col < n_slots)[None, :, :],
        )


def rows_per_program(n_slots: int) -> int:
    return 16 if n_slots > 256 else 8


def ancestry(
    parents: torch.Tensor,
    depth: int,
    ancestors: torch.Tensor,
    bits: torch.Tensor,
    mask: torch.Tensor | None,
) -> None:
    """Fill ``ancestors`` long ``[b, N, D+1]``, ``bits`` int32 ``[b, N, ceil(N/32)]`` and, unless
    None, ``mask`` bool ``[b, N, N]`` (all contiguous) from ``parents`` long ``[b, N]``."""
    batch, n_slots = parents.shape
    n_words = -(-n_slots // 32)
    rows = rows_per_program(n_slots)
    mask_out = bits if mask is None else mask.view(torch.uint8)  # not written without MASK
    _ancestry_kernel[(batch, triton.cdiv(n_slots, rows))](
        parents, ancestors, bits, mask_out, n_slots, depth, n_words,
        ROWS=rows, WP=next_pow2(n_words), GROUP=min(4, next_pow2(n_words)),
        MASK=mask is not None, **pdl_args(parents.device), num_warps=4,
    )  # fmt: skip
