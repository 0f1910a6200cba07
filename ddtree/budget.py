"""Budgets by throughput, engine-free: what every smaller budget would have accepted, and the
best budget per batch size.

A budget-B tree's first ``1 + K`` slots are its budget-K tree (:class:`ddtree.tree.DraftTree`)
and along an accepted path the slots increase (a parent precedes its children). The target's
token at a node depends only on the node's root path (greedy, or sampled with a key of the
request and position), and the child carrying it is the same node in both trees. So the
budget-K tree would have accepted exactly the part of the path inside its first ``1 + K``
slots: one step verified at B measures the accepted length of every K <= B on live traffic,
without running the smaller trees.

Expected tokens per second of a request at budget K = (1 + accepted(K)) / step time(batch, K);
:func:`throughput_schedule` picks K per batch size from measured step times and turns the
choice into a ``ddtree_budget_per_batch_size`` schedule.
"""

from __future__ import annotations

import torch


def accepted_within(path: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Draft tokens the budget-K tree would have accepted, for each K of ``budgets``.

    ``path``: long ``[b, D + 1]``, the accepted slots from the root (0), -1 padded
    (:attr:`ddtree.verify.Acceptance.path`); ``budgets``: long ``[k]``. Returns long
    ``[b, k]``; no host sync, fixed shapes."""
    nodes = path[:, 1:, None]  # [b, D, 1]: accepted non-root slots, increasing, -1 padded
    inside = (nodes > 0) & (nodes <= budgets.to(path.device)[None, None, :])  # [b, D, k]
    return inside.sum(1)  # the inside slots are a prefix of the path: their count is its length


def tokens_per_ms(accepted: list[float], step_ms: list[float]) -> list[float]:
    """Expected tokens per ms of a request at each budget: (1 + accepted) / step time."""
    return [(1 + a) / ms for a, ms in zip(accepted, step_ms, strict=True)]


def fastest(speed: list[float], budgets: list[int]) -> int:
    """The index of the fastest budget; ties go to the smaller budget."""
    return max(range(len(budgets)), key=lambda j: (speed[j], -budgets[j]))


def throughput_schedule(
    accepted: list[float], step_ms: list[list[float]], sizes: list[int], budgets: list[int],
    max_batch: int,
) -> list[list[int]]:  # fmt: skip
    """A ``ddtree_budget_per_batch_size`` schedule: for each batch size the budget with the
    most expected tokens per second.

    ``accepted[j]``: mean accepted draft tokens per request step at ``budgets[j]`` (e.g. the
    mean of :func:`accepted_within` over steps verified at the largest budget);
    ``step_ms[i][j]``: the step time at ``sizes[i]`` requests (a graph bucket, increasing)
    and ``budgets[j]``. Sizes in ``(sizes[i-1], sizes[i]]`` run the ``sizes[i]`` graph, so
    they take its choice; sizes above the last bucket, up to ``max_batch``, take the last's.
    Equal neighbours are merged: ``[[first, last, budget], ...]`` from 1 to ``max_batch``."""
    if not (len(accepted) == len(budgets) and len(step_ms) == len(sizes) and sizes):
        raise ValueError("throughput_schedule: accepted / budgets and step_ms / sizes differ")
    if any(len(row) != len(budgets) for row in step_ms) or sorted(set(sizes)) != list(sizes):
        raise ValueError("throughput_schedule: step_ms must be [sizes][budgets], sizes increasing")
    if max_batch < sizes[0]:
        raise ValueError(f"throughput_schedule: max_batch {max_batch} < first size {sizes[0]}")
    schedule: list[list[int]] = []
    first = 1
    for i, size in enumerate(sizes):
        budget = budgets[fastest(tokens_per_ms(accepted, step_ms[i]), budgets)]
        last = max_batch if i == len(sizes) - 1 else min(size, max_batch)
        if schedule and schedule[-1][2] == budget:
            schedule[-1][1] = last
        else:
            schedule.append([first, last, budget])
        first = last + 1
        if first > max_batch:
            break
    return schedule


class AcceptanceCurve:
    """Running sums of :func:`accepted_within` for K = 1..B over verified tree requests, on the
    device, with no host sync until :meth:`take` (fixed shapes: CUDA graphs can record
    :meth:`update`). A request verified at K' < B (a scheduler clipped its tree) adds to
    K <= K' only."""

    def __init__(self, budget: int, device: torch.device | str):
        self.budgets = torch.arange(1, budget + 1, device=device)  # [B]
        self.accepted = torch.zeros(budget, dtype=torch.long, device=device)  # [B]
        self.rows = torch.zeros(budget, dtype=torch.long, device=device)  # [B]

    def update(self, path: torch.Tensor, verified: torch.Tensor) -> None:
        """``path`` long ``[R, D + 1]`` (walked), ``verified`` long ``[R]``: the tree nodes
        each request verified (0: none, e.g. padding or a prefill)."""
        valid = self.budgets[None, :] <= verified[:, None]  # [R, B]
        self.accepted.add_((accepted_within(path, self.budgets) * valid).sum(0))
        self.rows.add_(valid.sum(0))

    def take(self) -> dict:
        """The sums so far as plain lists (a host read), then zeroed:
        ``{"rows": [B], "accepted": [B]}``, entry K-1 for budget K."""
        out = {"rows": self.rows.tolist(), "accepted": self.accepted.tolist()}
        self.rows.zero_()
        self.accepted.zero_()
        return out


def mean_accepted(reports: list[dict]) -> list[float | None]:
    """Mean accepted draft tokens per request step at each budget K = 1..B over
    :meth:`AcceptanceCurve.take` reports (None where no request verified K)."""
    if not reports:
        return []
    rows = [sum(col) for col in zip(*(r["rows"] for r in reports), strict=True)]
    accepted = [sum(col) for col in zip(*(r["accepted"] for r in reports), strict=True)]
    return [a / n if n else None for a, n in zip(accepted, rows, strict=True)]
