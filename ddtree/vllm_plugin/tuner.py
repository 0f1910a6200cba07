"""``ddtree_budget_per_batch_size: "auto"``: the step budget per batch size chosen by
throughput while serving.

Per batch size the budget K with the most expected tokens per second of a request,
``(1 + accepted(K)) / step_ms(bucket, K)`` (:func:`ddtree.budget.tokens_per_ms`):

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
import time
from collections.abc import Callable

import torch

from ddtree.budget import (
    AcceptanceCurve,
    CurveReader,
    bucket_schedule,
    expected_accepted,
    fastest,
    schedule_label,
    tokens_per_ms,
)
from ddtree.vllm_plugin import cost_model, graphs
from ddtree.vllm_plugin.config import DDTreeOptions

logger = logging.getLogger("vllm.ddtree")

UPDATE_EVERY = 64  # steps between schedule updates (DDTREE_TUNE_EVERY)
DECAY = 0.5  # weight of the older totals at each update: traffic changes, the choice follows
MIN_ROWS = 16  # request steps (decayed totals) that verified K before its mean is trusted
HYSTERESIS = 0.03  # a bucket changes budget only for >= 3% more expected tokens per second
TIMING_ROUNDS = 3  # start-up timing: rounds over every (bucket, budget), the fastest kept
INITIAL_COST_RATIO = 1.25  # before any traffic: the largest K whose forward costs <= this x chain
MIN_LIVE_STEPS = 8  # served steps of a (bucket, K) before their mean is its cost
STALL_RATIO = 4.0  # a served step this many times its expected cost is a stall: not counted
MIXED_STALL_RATIO = 16.0  # the same for a step with a prefill among its drafts (logged only)
EXPLORE_MARGIN = 0.15  # an unserved neighbour of the chosen K is tried once if its estimated
# speed is within this fraction of the chosen one's (estimates only scale start-up's table)


class BudgetTuner:
    """One engine's auto budget schedule. Made with the engine (its device sums must exist
    before any graph that feeds them is captured); :func:`measure` gives it the step times
    and the first schedule at the end of start-up."""

    def __init__(self, options: DDTreeOptions, device: torch.device, every: int = UPDATE_EVERY):
        self.options, self.every = options, every
        self.sizes: list[int] = []  # request buckets, increasing
        self.candidates: list[int] = []  # budgets a schedule may pick, increasing
        self.step_ms: list[list[float]] = []  # [sizes][candidates]
        self.max_batch = 0
        self.curve = AcceptanceCurve(options.budget, device)
        self.reader = CurveReader(self.curve)
        self.totals = torch.zeros(4 * options.budget, dtype=torch.float64)
        self.steps = 0
        self.updates = 0
        # Served step periods per (bucket, K) cell, host clock: this window's sums, and the
        # running mean (each window's mean weighted 1 - DECAY) with the steps it covers.
        self.window: list[list[list[float]]] = []  # [sizes][candidates] -> [ms, steps]
        self.live: list[list[list[float]]] = []  # [sizes][candidates] -> [mean ms, steps]
        # The same for mixed steps (drafts of K with a prefill among them): logged, not used
        # to choose (their prefill work is not K's), so that a run shows what K adds there.
        self.mixed_window: list[list[list[float]]] = []
        self.mixed_live: list[list[list[float]]] = []
        self.explored: set[tuple[int, int]] = set()  # cells tried by exploration
        self.cost_ms: list[list[float]] = []  # costs(), refreshed at every fold
        self._last: tuple[float, tuple[int, int] | None, bool] | None = None

    def set_costs(
        self, sizes: list[int], candidates: list[int], step_ms: list[list[float]], max_batch: int
    ) -> None:
        self.sizes, self.candidates, self.step_ms, self.max_batch = (
            sizes, candidates, step_ms, max_batch
        )  # fmt: skip
        self.window, self.live, self.mixed_window, self.mixed_live = (
            [[[0.0, 0.0] for _ in candidates] for _ in sizes] for _ in range(4)
        )
        self.cost_ms = self.costs()

    def observe(self, num_reqs: int, uniform: bool, longest: int, now: float | None = None) -> None:
        """At the start of every engine step (host, both runners), with the step's
        :func:`scheduled_drafts`: the period since the last start is what the last step cost,
        counted for its (bucket, K) cell if every request of it verified drafts (a prefill
        among them, or a step without drafts, says nothing about K). What start-up's dummy
        steps leave out (host work per draft, structured output, penalties, the sampler's
        options) is in these periods. Steps with drafts and a prefill are counted apart
        (``mixed_live``, for the log only)."""
        now = time.perf_counter() if now is None else now
        if self._last is not None and self._last[1] is not None:
            (i, j), mixed = self._last[1], self._last[2]
            period = 1e3 * (now - self._last[0])
            ratio = MIXED_STALL_RATIO if mixed else STALL_RATIO
            if period <= ratio * self.cost_ms[i][j]:
                cell = (self.mixed_window if mixed else self.window)[i][j]
                cell[0] += period
                cell[1] += 1
        cell = None
        if self.step_ms and num_reqs and longest in self.candidates:
            size = graphs.bucket(min(num_reqs, self.max_batch))
            i = min(self.sizes.index(size), len(self.sizes) - 1)
            cell = i, self.candidates.index(longest)
        self._last = (now, cell, not uniform)

    def costs(self) -> list[list[float]]:
        """Step ms per (bucket, K): the served mean where a cell has ``MIN_LIVE_STEPS``, else
        start-up's time scaled by what served steps cost over start-up's in that bucket (the
        mean ratio over its served cells; 1 before any)."""
        table = []
        for row, live in zip(self.step_ms, self.live, strict=True):
            served = [mean if n >= MIN_LIVE_STEPS else None for mean, n in live]
            ratios = [m / t for m, t in zip(served, row, strict=True) if m is not None and t > 0]
            scale = sum(ratios) / len(ratios) if ratios else 1.0
            table.append(
                [m if m is not None else t * scale for m, t in zip(served, row, strict=True)]
            )
        return table

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
        if self.reader.landed():
            self._fold()
        if self.steps >= self.every and not self.reader.pending:
            self.reader.start()
            self.steps = 0

    def _fold(self) -> None:
        self.totals.mul_(DECAY).add_(self.reader.host)
        for lives, windows in ((self.live, self.window), (self.mixed_live, self.mixed_window)):
            for live_row, window_row in zip(lives, windows, strict=True):
                for live, window in zip(live_row, window_row, strict=True):
                    if window[1] > 0:
                        mean = window[0] / window[1]
                        live[0] = mean if live[1] == 0 else DECAY * live[0] + (1 - DECAY) * mean
                        live[1] += window[1]
                    window[0] = window[1] = 0.0
        if self.step_ms:
            self.cost_ms = self.costs()
        rows, accepted, proposals, predicted = self.totals.view(4, -1).tolist()
        expected = expected_accepted(rows, accepted, proposals, predicted, MIN_ROWS)
        schedule = self.choose(expected) if self.step_ms else None
        if schedule is None:
            return
        self.updates += 1
        if apply(self.options, schedule):
            known = [(k, expected[k - 1]) for k in self.candidates if expected[k - 1] is not None]
            logger.info(
                "ddtree budgets by throughput (update %d): batch sizes %s; expected accepted "
                "by budget: %s; served step ms (requests x budget): %s; with a prefill among "
                "them (ms/steps): %s",
                self.updates,
                schedule_label(schedule),
                ", ".join(f"{k}: {a:.2f}" for k, a in known),
                self.served_label(self.live, MIN_LIVE_STEPS) or "none yet",
                self.served_label(self.mixed_live, 1, with_steps=True) or "none yet",
            )

    def served_label(
        self, live: list[list[list[float]]], least: int, with_steps: bool = False
    ) -> str:
        """``requests x budget = mean ms`` of every cell of ``live`` with ``least`` steps
        (``/steps`` after each with ``with_steps``: the mixed cells, whose count varies more)."""
        return ", ".join(
            f"{size}x{k}={mean:.2f}" + (f"/{n:.0f}" if with_steps else "")
            for size, row in zip(self.sizes, live, strict=True)
            for k, (mean, n) in zip(self.candidates, row, strict=True)
            if n >= least
        )

    def choose(self, expected: list[float | None]) -> list[list[int]] | None:
        """The schedule for ``expected`` accepted lengths (entry K-1; None: unknown): per
        bucket the budget with the most ``(1 + accepted) / step ms`` (:meth:`costs`) among the
        known ones,
        unless the bucket's budget now is within ``HYSTERESIS`` of it (noise must not flip
        the schedule every update) or above every known one (nothing measured says it is
        worse, and only its own steps can)."""
        known = [k for k in self.candidates if expected[k - 1] is not None]
        if not known:
            return None
        now = self.options.dense_schedule(self.max_batch)
        chosen = []
        for i, (size, row) in enumerate(zip(self.sizes, self.cost_ms, strict=True)):
            cost = dict(zip(self.candidates, row, strict=True))
            speed = tokens_per_ms([expected[k - 1] for k in known], [cost[k] for k in known])
            best = known[fastest(speed, known)]
            current = now[min(size, self.max_batch)]
            keep = current > known[-1] or (
                current in known
                and speed[known.index(current)] * (1 + HYSTERESIS) >= speed[known.index(best)]
            )
            choice = current if keep else best
            chosen.append(self._explore(i, choice, known, speed))
        return bucket_schedule(self.sizes, chosen, self.max_batch)

    def _explore(self, i: int, choice: int, known: list[int], speed: list[float]) -> int:
        """``choice`` for bucket ``i``, or once per cell an unserved neighbouring budget whose
        estimated speed is within ``EXPLORE_MARGIN`` of it: an estimate only scales start-up's
        table, which misses costs that grow with K (a wider tree once served 0.40 ms slower
        per step than its table said), so only served steps can say which is faster."""
        if choice not in known or self.live[i][self.candidates.index(choice)][1] < MIN_LIVE_STEPS:
            return choice
        at = known.index(choice)
        for neighbour in (at - 1, at + 1):
            if not 0 <= neighbour < len(known):
                continue
            j = self.candidates.index(known[neighbour])
            unserved = self.live[i][j][1] < MIN_LIVE_STEPS and (i, j) not in self.explored
            if unserved and speed[neighbour] >= (1 - EXPLORE_MARGIN) * speed[at]:
                self.explored.add((i, j))
                return known[neighbour]
        return choice


def scheduled_drafts(scheduler_output) -> tuple[int, bool, int]:
    """A ``SchedulerOutput``'s requests, whether every one of them verifies drafts, and the
    most drafts of one (the step's budget K)."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    requests = scheduler_output.num_scheduled_tokens
    uniform = all(drafts.get(r) for r in requests)
    return len(requests), uniform, max((len(d) for d in drafts.values()), default=0)


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
        lookup[:] = options.dense_schedule(len(lookup) - 1)
    return True


def start(engine, runner) -> None:
    """At the end of the worker's start-up, for an ``"auto"`` engine of either runner: its
    tuner (the V1 runner feeds it eagerly, so it is made here; the V2 speculator made its own
    before any capture), measured once."""
    if not engine.options.auto_budget:
        return
    if engine.tuner is None:
        engine.tuner = BudgetTuner(engine.options, runner.device, engine.settings.tune_every)
    if not engine.tuner.step_ms:
        v2 = getattr(runner, "speculator", None) is not None
        timer = v2_step_seconds(runner) if v2 else v1_step_seconds(runner)
        measure(engine.tuner, runner, engine.depth, timer)


def measure(
    tuner: BudgetTuner, runner, depth: int, step_seconds: Callable[[int, int], float]
) -> None:
    """At the end of start-up, before the scheduler exists: time a step at every (request
    bucket, candidate budget) with ``step_seconds(requests, budget)``, set the first schedule
    (per bucket the largest budget whose step costs at most ``INITIAL_COST_RATIO`` x the
    chain's) and hand both to ``tuner``."""
    options = tuner.options
    scheduler = runner.scheduler_config
    max_tokens = scheduler.max_num_scheduled_tokens or scheduler.max_num_batched_tokens
    max_batch = scheduler.max_num_seqs
    sizes = graphs.buckets(max_batch)
    candidates = sorted(cost_model.candidate_budgets(options.budget, depth))
    graph_tokens = full_graph_tokens(runner.vllm_config)
    cells = [  # (bucket index, candidate index, requests) of every step that may be scheduled
        (i, j, min(size, max_batch))  # the last bucket may pass max_num_seqs
        for i, size in enumerate(sizes)
        for j, k in enumerate(candidates)
        if min(size, max_batch) * (1 + k) <= max_tokens
        and k <= widest_budget(options.budget, depth, size, graph_tokens)
    ]
    raw = [[float("inf")] * len(candidates) for _ in sizes]
    start = time.perf_counter()
    # Rounds over all cells, the fastest per cell: a stall of the host (another engine's
    # start-up, seen in `ddtree bench`) hits one round of a cell, not all of them.
    for _ in range(TIMING_ROUNDS):
        for i, j, reqs in cells:
            raw[i][j] = min(raw[i][j], 1e3 * step_seconds(reqs, candidates[j]))
    # A larger tree never costs less: each budget costs the least measured at it or at a
    # larger one (noise only adds time; a running maximum would carry one stall upward).
    step_ms = [cost_model.suffix_min(row) for row in raw]
    first = [  # per bucket: candidates[0] is the chain
        max(k for k, ms in zip(candidates, row, strict=True) if ms <= INITIAL_COST_RATIO * row[0])
        for row in step_ms
    ]
    apply(options, bucket_schedule(sizes, first, max_batch))
    tuner.set_costs(sizes, candidates, step_ms, max_batch)
    tuner.curve.zero()  # graph captures and timed dummy batches proposed trees of no request
    logger.info(
        "ddtree budgets by throughput: candidates %s; step ms by (requests, budget), measured "
        "in %.1f s: %s; first schedule (no traffic yet), batch sizes %s",
        candidates,
        time.perf_counter() - start,
        "; ".join(
            f"{b}: " + " ".join(f"{k}={ms:.2f}" for k, ms in zip(candidates, row, strict=True))
            for b, row in zip(sizes, step_ms, strict=True)
        ),
        schedule_label(options.budget_schedule),
    )


def full_graph_tokens(vllm_config) -> int | None:
    """The most tokens a uniform decode batch replays a FULL CUDA graph at (vLLM's
    ``max_cudagraph_capture_size``); None when decode steps have no full graphs."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if not mode or mode.decode_mode() != CUDAGraphMode.FULL:
        return None
    return compilation.max_cudagraph_capture_size


def widest_budget(budget: int, depth: int, size: int, graph_tokens: int | None) -> int:
    """The widest tree an "auto" engine builds and schedules for a bucket of ``size``
    requests: the largest candidate budget K whose verify, ``size x (1 + K)`` tokens, still
    replays a full graph (past vLLM's capture limit a step runs eagerly: B=63 at 16 requests
    verified in 6.08 ms vs 3.00 at B=15 on an H100), never below the chain; ``budget``
    without full graphs."""
    if graph_tokens is None:
        return budget
    candidates = cost_model.candidate_budgets(budget, depth)
    return max([k for k in candidates if size * (1 + k) <= graph_tokens] + [min(budget, depth)])


DEFAULT_GRAPH_TOKENS = 512  # vLLM's max_cudagraph_capture_size unless configured


def default_schedule(budget: int, depth: int, graph_tokens: int | None) -> list[list[int]] | None:
    """The V2 runner's schedule when the config names none: per request bucket the widest
    tree whose verify fits a full CUDA graph of ``graph_tokens`` tokens (``widest_budget``;
    vLLM's limit, or ``DEFAULT_GRAPH_TOKENS``), as ``[[first, last, budget], ...]`` up to the
    chain; None when that is B at every size (nothing to schedule). A fixed B verified at
    every batch size runs wide trees eagerly once the batch grows (B=63 at 16 requests:
    x0.73 of the chain, H100, 2026-12-06)."""
    limit = graph_tokens or DEFAULT_GRAPH_TOKENS
    chain = min(budget, depth)
    sizes, chosen = [], []
    size = 1
    while not chosen or chosen[-1] > chain:
        sizes.append(size)
        chosen.append(widest_budget(budget, depth, size, limit))
        size *= 2
    schedule = bucket_schedule(sizes, chosen, sizes[-1])
    if len(schedule) == 1:
        return None
    schedule[-1][1] = 1 << 20  # the chain from there on (vLLM clips to max_num_seqs)
    return schedule


def v1_step_seconds(runner) -> Callable[[int, int], float]:
    """The V1 runner's step cost: the target's forward over ``requests * (1 + budget)``
    tokens (``cost_model.forward_seconds``: vLLM's dummy batch, the drafter's left out; the
    drafter's step does not depend on the budget)."""
    return lambda reqs, budget: cost_model.forward_seconds(runner, reqs * (1 + budget))


def v2_step_seconds(runner, repeats: int = 5) -> Callable[[int, int], float]:
    """The V2 runner's step cost at ``requests`` x ``1 + budget`` tokens: its own dummy batch
    of uniform decodes (``_dummy_run(uniform_decode=True)``, which splits the tokens by
    ``decode_query_len``, set to ``1 + budget`` for the call), so the verify graph captured for
    that query length replays, and the drafter's proposal after it; then the logits of every
    row and a sampling pass over them (:func:`verify_logits_and_sampling`). The fastest of
    ``repeats``."""

    def seconds(reqs: int, budget: int) -> float:
        query = 1 + budget
        saved = runner.decode_query_len
        runner.decode_query_len = query
        rows = reqs * query
        positions = torch.zeros(rows, dtype=torch.long, device=runner.device)

        def step() -> None:
            hidden, _ = runner._dummy_run(rows, uniform_decode=True, skip_eplb=True)
            verify_logits_and_sampling(runner, hidden[:rows], positions)

        try:
            return cost_model.fastest_seconds(step, torch.cuda.synchronize, repeats)
        finally:
            runner.decode_query_len = saved

    return seconds


def verify_logits_and_sampling(runner, hidden: torch.Tensor, positions: torch.Tensor) -> None:
    """The work of a verify step that grows with its rows and that vLLM's dummy run leaves
    out: the logits of every row (``hidden [rows, H]``) and vLLM's Gumbel-max pass over them,
    as the tree sampler draws each node's target token. Left out, a wider tree looked free at
    start-up (16 requests: B=31 timed as B=15, 1.45 ms) while serving it cost 0.40 ms more
    per step (3.40 vs 3.00 ms, H100, 2026-12-06)."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    logits = runner.model.compute_logits(hidden)  # [rows, V]
    states = runner.sampler.sampling_states
    request = torch.zeros_like(positions, dtype=torch.int32)  # every row: request-state row 0
    gumbel_sample(
        logits, request, states.temperature.gpu, states.seeds.gpu, positions, apply_temperature=True
    )


def provisional_schedule(budget: int, depth: int) -> list[list[int]]:
    """Before start-up's timing: every candidate budget in the schedule once (batch size i
    gets the i-th largest), so that the V2 runner captures a verify graph for each."""
    candidates = sorted(cost_model.candidate_budgets(budget, depth), reverse=True)
    return [[i, i, k] for i, k in enumerate(candidates, start=1)]
