"""``ddtree_budget_per_batch_size: "auto"``: the step budget per batch size chosen by
throughput while serving.

Per batch size the budget K with the most expected tokens per second of a request,
``(1 + accepted(K)) / step_ms(bucket, K)`` (:func:`ddtree.budget.throughput_schedule`):

- ``step_ms``: the target's forward over ``bucket * (1 + K)`` tokens, timed once at start-up
  for every request bucket and candidate budget (``cost_model.forward_seconds``; more tokens
  never cost less, so the table is made non-decreasing in the tokens);
- ``accepted(K)``: measured on live traffic. Every walk adds what each K <= the verified
  budget would have accepted (:func:`ddtree.budget.accepted_within`) and every proposal what
  the drafter itself expects each K to accept (:func:`ddtree.budget.predicted_within`) to
  device sums (:class:`ddtree.budget.AcceptanceCurve`); budgets no bucket verified lately are
  extrapolated from the drafter's expectation (:func:`ddtree.budget.expected_accepted`).

Every ``every`` steps the sums are copied to the host without a sync (a non-blocking copy
and an event, read at a later step once the event has completed) and folded into decayed
totals; the new schedule goes where vLLM and DDTree read it each step: the scheduler's dense
``dynamic_sd_lookup`` (K per batch size, the drafts it schedules) and the options'
``budget_schedule`` (the trees the proposer builds). The scheduler and the worker must share
the options object: one engine-core process (vLLM's ``uni`` executor), checked at start-up.
"""

from __future__ import annotations

import logging

import torch

from ddtree.budget import AcceptanceCurve, expected_accepted, throughput_schedule
from ddtree.vllm_plugin import cost_model, graphs
from ddtree.vllm_plugin.config import DDTreeOptions

logger = logging.getLogger("vllm.ddtree")

UPDATE_EVERY = 64  # steps between schedule updates (DDTREE_TUNE_EVERY)
DECAY = 0.5  # weight of the older totals at each update: traffic changes, the choice follows
MIN_ROWS = 16  # request steps (decayed totals) that verified K before its mean is trusted
INITIAL_COST_RATIO = 1.25  # before any traffic: the largest K whose forward costs <= this x chain


class BudgetTuner:
    """One engine's auto budget schedule (made by :func:`start`)."""

    def __init__(
        self,
        options: DDTreeOptions,
        sizes: list[int],
        candidates: list[int],
        step_ms: list[list[float]],
        max_batch: int,
        device: torch.device,
        every: int = UPDATE_EVERY,
    ):
        self.options, self.sizes, self.candidates = options, sizes, candidates
        self.step_ms, self.max_batch, self.every = step_ms, max_batch, every
        self.curve = AcceptanceCurve(options.budget, device)
        cuda = device.type == "cuda"
        self.host = torch.zeros(4 * options.budget, dtype=torch.float64, pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        self.totals = torch.zeros_like(self.host, device="cpu")
        self.pending = False
        self.steps = 0
        self.updates = 0

    def walked(self, path: torch.Tensor, verified: torch.Tensor) -> None:
        """After a walk (graph-recordable): ``path`` long ``[R, D + 1]``, ``verified`` long
        ``[R]`` (tree nodes each request verified; 0 for padding or prefill rows)."""
        self.curve.update(path, verified)

    def proposed(self, scores: torch.Tensor, real: torch.Tensor) -> None:
        """After a proposal (graph-recordable): tree ``scores`` float ``[R, 1 + B']``,
        ``real`` bool ``[R]`` (rows that are requests)."""
        self.curve.propose(scores, real)

    def step(self) -> None:
        """Once per engine step, on the host: start a copy of the sums every ``every`` steps
        and fold one in once it has landed. Never waits for the device."""
        self.steps += 1
        if self.pending and (self.copied is None or self.copied.query()):
            self.pending = False
            self._fold()
        if self.steps >= self.every and not self.pending:
            self.host.copy_(self.curve.sums(), non_blocking=True)
            if self.copied is not None:
                self.copied.record()
            self.curve.zero()  # after the copy, on the same stream
            self.pending, self.steps = True, 0

    def _fold(self) -> None:
        self.totals.mul_(DECAY).add_(self.host)
        rows, accepted, proposals, predicted = self.totals.view(4, -1).tolist()
        expected = expected_accepted(rows, accepted, proposals, predicted, MIN_ROWS)
        schedule = self.choose(expected)
        if schedule is None:
            return
        self.updates += 1
        if apply(self.options, schedule):
            known = [(k, expected[k - 1]) for k in self.candidates if expected[k - 1] is not None]
            logger.info(
                "ddtree budgets by throughput (update %d): %s; expected accepted by budget: %s",
                self.updates,
                describe(schedule),
                ", ".join(f"{k}: {a:.2f}" for k, a in known),
            )

    def choose(self, expected: list[float | None]) -> list[list[int]] | None:
        """The schedule for ``expected`` accepted lengths (entry K-1; None: unknown): per
        bucket the fastest budget among those known. A bucket whose budget now is above every
        known one keeps it (nothing measured says it is worse, and only its own steps can)."""
        known = [k for k in self.candidates if expected[k - 1] is not None]
        if not known:
            return None
        columns = [self.candidates.index(k) for k in known]
        step_ms = [[row[j] for j in columns] for row in self.step_ms]
        accepted = [expected[k - 1] for k in known]
        best = throughput_schedule(accepted, step_ms, self.sizes, known, self.max_batch)
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        now = build_dynamic_sd_schedule_lookup(
            [list(r) for r in self.options.budget_schedule], self.max_batch, self.options.budget
        )
        ranges = [
            [size, size, now[size] if now[size] > known[-1] else budget]
            for first, last, budget in best
            for size in range(first, last + 1)
        ]
        return _merged(ranges, self.max_batch)


def apply(options: DDTreeOptions, schedule: list[list[int]]) -> bool:
    """Make ``schedule`` the engine's: the options' ``budget_schedule`` and, once the
    scheduler exists, its dense lookup (in place: the scheduler holds that list). Returns
    whether it changed."""
    new = tuple(tuple(r) for r in schedule)
    if new == options.budget_schedule:
        return False
    options.budget_schedule = new
    lookup = options.live_lookup
    if lookup is not None:
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        lookup[:] = build_dynamic_sd_schedule_lookup(
            [list(r) for r in new], len(lookup) - 1, options.budget
        )
    return True


def describe(schedule) -> str:
    return ", ".join(
        f"{first}-{last} req: B {budget}" if first != last else f"{first} req: B {budget}"
        for first, last, budget in schedule
    )


def start(options: DDTreeOptions, runner, depth: int, every: int = UPDATE_EVERY) -> BudgetTuner:
    """At start-up, before the scheduler exists: time the target's forward at every (request
    bucket, candidate budget), set the first schedule (the largest budget whose forward costs
    at most ``INITIAL_COST_RATIO`` x the chain's) and return the tuner that refines it."""
    scheduler = runner.scheduler_config
    max_tokens = scheduler.max_num_scheduled_tokens or scheduler.max_num_batched_tokens
    max_batch = scheduler.max_num_seqs
    sizes = graphs.buckets(max_batch)
    candidates = sorted(cost_model.candidate_budgets(options.budget, depth))
    counts = sorted({b * (1 + k) for b in sizes for k in candidates if b * (1 + k) <= max_tokens})
    seconds = cost_model.measured_costs(runner, counts)
    # A (bucket, K) past the step's token limit is never chosen (the chain always fits:
    # vLLM's own scheduler refuses a max_num_batched_tokens below max_num_seqs * (1 + D)).
    inf = float("inf")
    step_ms = [[1e3 * seconds.get(b * (1 + k), inf) for k in candidates] for b in sizes]
    table = cost_model.choose_step_budgets(
        lambda n: seconds.get(n, float("inf")), sizes, options.budget, depth,
        INITIAL_COST_RATIO, max_tokens,
    )  # fmt: skip
    first = [[1, 1, table[1]]]
    for lo, b in zip(sizes, sizes[1:], strict=False):
        first.append([lo + 1, b, table[b]])
    apply(options, _merged(first, max_batch))
    logger.info(
        "ddtree budgets by throughput: candidates %s; forward ms by (requests, budget): %s; "
        "first schedule (no traffic yet): %s",
        candidates,
        "; ".join(
            f"{b}: " + " ".join(f"{k}={ms:.2f}" for k, ms in zip(candidates, row, strict=True))
            for b, row in zip(sizes, step_ms, strict=True)
        ),
        describe(options.budget_schedule),
    )
    return BudgetTuner(options, sizes, candidates, step_ms, max_batch, runner.device, every)


def _merged(ranges: list[list[int]], max_batch: int) -> list[list[int]]:
    """Neighbouring ranges with one budget joined, the last one stretched to ``max_batch``."""
    out: list[list[int]] = []
    for first, last, budget in ranges:
        if first > max_batch:
            break
        if out and out[-1][2] == budget:
            out[-1][1] = last
        else:
            out.append([first, last, budget])
    out[-1][1] = max_batch
    return out
