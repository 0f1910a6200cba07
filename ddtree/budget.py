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


def predicted_within(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """What the drafter expects the budget-K tree to accept, for K = 1..``budget``.

    A node is accepted iff the target's tokens match its whole root path; were the target's
    distributions the drafter's marginals, that has probability ``exp(score)`` of the node, and
    the expected accepted length of a tree is the sum over its nodes. ``scores``: float
    ``[b, 1 + B']`` (:attr:`ddtree.tree.DraftTree.scores`, -inf padding). Returns float32
    ``[b, budget]``, zero where K > B' (a tree that small says nothing of K); no host sync,
    fixed shapes."""
    expected = scores[:, 1 : budget + 1].float().exp().cumsum(1)  # [b, min(B', budget)]
    return torch.nn.functional.pad(expected, (0, budget - expected.shape[1]))


def expected_accepted(
    rows: list[float], accepted: list[float], proposals: list[float], predicted: list[float],
    min_rows: float,
) -> list[float | None]:  # fmt: skip
    """Expected accepted draft tokens per request step at every budget K = 1..B (entry K-1),
    from the sums of :class:`AcceptanceCurve`; None where nothing is known of K.

    Where at least ``min_rows`` request steps verified K, the measured mean. Above the largest
    such K* (budgets no request verified lately) but where at least ``min_rows`` proposed
    trees reached K, the measured value at K* plus the drafter's predicted gain from K* to K,
    scaled by how well it predicted K* (measured / predicted, at most 1: drafters are
    overconfident more often than not); with nothing measured, the prediction itself. Made
    non-decreasing in K over the known entries (a tree contains every smaller budget's)."""
    budget = len(rows)
    measured = [a / n if n >= min_rows else None for a, n in zip(accepted, rows, strict=True)]
    guess = [p / n if n >= min_rows else None for p, n in zip(predicted, proposals, strict=True)]
    known = [k for k in range(budget) if measured[k] is not None]
    top = known[-1] if known else None
    scale = 1.0
    if top is not None:
        scale = min(1.0, measured[top] / guess[top]) if guess[top] else 0.0
    out: list[float | None] = []
    for k in range(budget):
        if measured[k] is not None:
            value = measured[k]
        elif guess[k] is None:
            value = None
        elif top is None:
            value = guess[k]
        elif k < top:  # a gap below K*: the measured neighbours bound it
            value = None
        else:
            value = measured[top] + scale * (guess[k] - (guess[top] or 0.0))
        out.append(value)
    best = None
    for k, value in enumerate(out):
        if value is not None:
            best = value if best is None else max(best, value)
            out[k] = best
    return out


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
    they take its choice (:func:`bucket_schedule`)."""
    if not (len(accepted) == len(budgets) and len(step_ms) == len(sizes) and sizes):
        raise ValueError("throughput_schedule: accepted / budgets and step_ms / sizes differ")
    if any(len(row) != len(budgets) for row in step_ms) or sorted(set(sizes)) != list(sizes):
        raise ValueError("throughput_schedule: step_ms must be [sizes][budgets], sizes increasing")
    if max_batch < sizes[0]:
        raise ValueError(f"throughput_schedule: max_batch {max_batch} < first size {sizes[0]}")
    chosen = [budgets[fastest(tokens_per_ms(accepted, row), budgets)] for row in step_ms]
    return bucket_schedule(sizes, chosen, max_batch)


def bucket_schedule(sizes: list[int], chosen: list[int], max_batch: int) -> list[list[int]]:
    """A ``ddtree_budget_per_batch_size`` schedule from one budget per graph bucket: sizes in
    ``(sizes[i-1], sizes[i]]`` run the ``sizes[i]`` graph, so they take ``chosen[i]``; sizes
    above the last bucket, up to ``max_batch``, take the last's. Equal neighbours are merged:
    ``[[first, last, budget], ...]`` from 1 to ``max_batch``."""
    schedule: list[list[int]] = []
    first = 1
    for i, (size, budget) in enumerate(zip(sizes, chosen, strict=True)):
        last = max_batch if i == len(sizes) - 1 else min(size, max_batch)
        if schedule and schedule[-1][2] == budget:
            schedule[-1][1] = last
        else:
            schedule.append([first, last, budget])
        first = last + 1
        if first > max_batch:
            break
    return schedule


def schedule_label(schedule) -> str:
    """``[[1, 4, 255], [5, 512, 15]]`` -> ``"1-4: 255, 5-512: 15"``."""
    return ", ".join(f"{first}-{last}: {budget}" for first, last, budget in schedule)


class AcceptanceCurve:
    """Running sums of :func:`accepted_within` for K = 1..B over verified tree requests, on the
    device, with no host sync until :meth:`take` (fixed shapes: CUDA graphs can record
    :meth:`update`). A request verified at K' < B (a scheduler clipped its tree) adds to
    K <= K' only."""

    def __init__(self, budget: int, device: torch.device | str):
        self.budgets = torch.arange(1, budget + 1, device=device)  # [B]
        self.accepted = torch.zeros(budget, dtype=torch.long, device=device)  # [B]
        self.rows = torch.zeros(budget, dtype=torch.long, device=device)  # [B]
        # the drafter's own expectation (predicted_within) over the proposed trees
        self.predicted = torch.zeros(budget, dtype=torch.float32, device=device)  # [B]
        self.proposals = torch.zeros(budget, dtype=torch.long, device=device)  # [B]
        self._sums: torch.Tensor | None = None  # float64 [4, B], made at the first sums()

    def update(self, path: torch.Tensor, verified: torch.Tensor) -> None:
        """``path`` long ``[R, D + 1]`` (walked), ``verified`` long ``[R]``: the tree nodes
        each request verified (0: none, e.g. padding or a prefill)."""
        valid = self.budgets[None, :] <= verified[:, None]  # [R, B]
        self.accepted.add_((accepted_within(path, self.budgets) * valid).sum(0))
        self.rows.add_(valid.sum(0))

    def propose(self, scores: torch.Tensor, real: torch.Tensor) -> None:
        """``scores`` float ``[R, 1 + B']`` of proposed trees, ``real`` bool ``[R]``: rows
        that are requests (not a graph's padding). Counts at K <= B' only."""
        budget = self.budgets.shape[0]
        self.predicted.add_((predicted_within(scores, budget) * real[:, None]).sum(0))
        reached = (self.budgets <= scores.shape[1] - 1).long()  # [B]: fixed by the shape
        self.proposals.add_(reached * real.sum())

    def sums(self) -> torch.Tensor:
        """All sums in one float64 device tensor ``[4 B]`` (rows, accepted, proposals,
        predicted; a persistent buffer, rewritten by the next call): one copy to the host
        reads them."""
        if self._sums is None:
            self._sums = torch.zeros(
                4, len(self.rows), dtype=torch.float64, device=self.rows.device
            )
        parts = (self.rows, self.accepted, self.proposals, self.predicted)
        for out, part in zip(self._sums, parts, strict=True):
            out.copy_(part)
        return self._sums.view(-1)

    def zero(self) -> None:
        for tensor in (self.rows, self.accepted, self.predicted, self.proposals):
            tensor.zero_()


class CurveReader:
    """An :class:`AcceptanceCurve`'s sums on the host without a sync: :meth:`start` copies
    them (non-blocking, into pinned memory, marked by an event on CUDA) and zeroes the curve;
    :meth:`landed` says, once per copy, that ``host`` (float64 ``[4 B]``: rows, accepted,
    proposals, predicted) holds it: at once on the CPU, later on CUDA. The step never waits."""

    def __init__(self, curve: AcceptanceCurve):
        cuda = curve.rows.device.type == "cuda"
        self.curve = curve
        self.host = torch.zeros(4 * len(curve.rows), dtype=torch.float64, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False  # a copy is in flight

    def start(self) -> None:
        self.host.copy_(self.curve.sums(), non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()
        self.curve.zero()  # after the copy, on the same stream
        self.pending = True

    def landed(self) -> bool:
        if self.pending and (self.event is None or self.event.query()):
            self.pending = False
            return True
        return False

    def take(self) -> dict:
        """The landed copy's ``{"rows": [B], "accepted": [B]}``, entry K-1 for budget K."""
        rows, accepted = self.host.view(4, -1)[:2].long().tolist()
        return {"rows": rows, "accepted": accepted}


def mean_accepted(reports: list[dict]) -> list[float | None]:
    """Mean accepted draft tokens per request step at each budget K = 1..B over
    :meth:`AcceptanceCurve.take` reports (None where no request verified K)."""
    if not reports:
        return []
    rows = [sum(col) for col in zip(*(r["rows"] for r in reports), strict=True)]
    accepted = [sum(col) for col in zip(*(r["accepted"] for r in reports), strict=True)]
    return [a / n if n else None for a, n in zip(accepted, rows, strict=True)]
