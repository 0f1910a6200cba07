"""Debugging and profiling of DDTree's step: the sync checker and the step-time split."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time

import torch

from ddtree.bench.report import ACCEPTANCE_MARKER, PROFILE_MARKER, STEPS_MARKER
from ddtree.vllm_plugin import config

log = logging.getLogger("vllm.ddtree")


def sync_checked(fn):
    """With ``DDTREE_SYNC_DEBUG=warn|error`` torch's CUDA sync debug mode is on while ``fn``
    runs: any host-device sync in DDTree's per-step code warns or raises."""

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        mode = config.SETTINGS.sync_debug
        if mode is None or not torch.cuda.is_available():
            return fn(*args, **kwargs)
        torch.cuda.set_sync_debug_mode(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    return checked


class StepProfile:
    """``DDTREE_PROFILE=N``: the step's time split, logged every N steps (mean ms per step).

    Profiling only: at every stage boundary the device is synchronized and the host clock
    read, so each stage's time is its full cost (host + device) on the critical path. Stages:
    prepare (positions, tree batch), forward (the target's verify forward; ``attention`` is its
    tree-attention share), sample (target tokens + walk), commit (KV moves), vllm (vLLM's
    bookkeeping before the drafter), draft (context reorder + DFlash forward), build
    (``build_tree``), rest (until the next step: vLLM's scheduling and outputs).
    """

    ORDER = ("prepare", "forward", "sample", "commit", "vllm", "draft", "build", "rest")

    def __init__(self, every: int, ops: bool = False):
        self.every = every
        self.with_ops = ops  # a torch.profiler op table over steps 2N..3N
        self.marks: list[tuple[str, float]] = []
        self.sums: dict[str, float] = {}
        self.steps = 0
        self.total_steps = 0
        self.ops = None

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self, name: str) -> None:
        now = self._now()
        if name == "prepare" and self.marks:
            self._close_step(now)
            self._op_profile()
        self.marks.append((name, now))

    def _op_profile(self) -> None:
        if not self.with_ops:
            return
        self.total_steps += 1
        if self.total_steps == 2 * self.every:
            self.ops = torch.profiler.profile(record_shapes=False)
            self.ops.__enter__()
        elif self.total_steps == 3 * self.every and self.ops is not None:
            self.ops.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            for key in (sort, "self_cpu_time_total"):
                table = self.ops.key_averages().table(sort_by=key, row_limit=25)
                log.warning("ddtree-ops by %s\n%s", key, table)
            self.ops = None

    @contextlib.contextmanager
    def attention_span(self):
        start = self._now()
        yield
        self.sums["attention"] = self.sums.get("attention", 0.0) + self._now() - start

    def _close_step(self, now: float) -> None:
        ends = [t for _, t in self.marks[1:]] + [now]
        for (name, start), end in zip(self.marks, ends, strict=True):
            self.sums[name] = self.sums.get(name, 0.0) + end - start
        first = self.marks[0][0]
        self.marks = []
        self.steps += first == "prepare"
        if self.steps == self.every:
            stages = [k for k in (*self.ORDER, "attention") if k in self.sums]
            report = {k: round(1000 * self.sums[k] / self.steps, 3) for k in stages}
            log.warning(
                "%s%s", PROFILE_MARKER, json.dumps({"steps": self.steps, "ms_per_step": report})
            )
            self.sums, self.steps = {}, 0


class AcceptanceLog:
    """``DDTREE_ACCEPTANCE=N``: an :class:`ddtree.budget.AcceptanceCurve` fed by every walk
    (:meth:`update`, no sync: recordable in a CUDA graph) and logged about every N steps as
    ``ddtree-acceptance {"steps", "budget", "rows", "accepted"}``, the sums since the last line.
    On CUDA the sums reach the host by a non-blocking copy, logged at the first step after it
    landed: the log never stalls the step (the tuner reads its sums the same way)."""

    def __init__(self, every: int, budget: int, device):
        from ddtree.budget import AcceptanceCurve, CurveReader

        self.every, self.budget = every, budget
        self.curve = AcceptanceCurve(budget, device)
        self.reader = CurveReader(self.curve)
        self.covered = 0  # steps the copy in flight covers
        self.steps = 0

    def update(self, path: torch.Tensor, verified: torch.Tensor) -> None:
        self.curve.update(path, verified)

    def step(self) -> None:
        self.steps += 1
        if self.reader.landed():
            self._log()
        if self.steps >= self.every and not self.reader.pending:
            self.reader.start()
            self.covered, self.steps = self.steps, 0
            if self.reader.landed():  # at once on the CPU
                self._log()

    def _log(self) -> None:
        report = {"steps": self.covered, "budget": self.budget, **self.reader.take()}
        log.warning("%s%s", ACCEPTANCE_MARKER, json.dumps(report, separators=(",", ":")))


class StepPeriods:
    """``DDTREE_STEP_LOG=N``: each step's start (wall clock, at the runner's
    ``execute_model``) and kind, logged N steps at a time as ``ddtree-steps {"t": [N + 1
    times], "k": "N kinds"}``: step i ran from ``t[i]`` to ``t[i + 1]``, so a reader can keep
    the steps inside a time window. Kinds: ``v`` (every request verifies drafts), ``m`` (some
    do: a prefill among decodes), ``p`` (none: prefills, or an engine without drafts). A gap
    of more than ``IDLE_S`` ends a run of steps: the step before it is dropped from the
    periods (the engine was idle, or that step stalled: the host cannot tell) and logged as
    ``"gap": [start, seconds, kind, drafts]`` on the run's last line (drafts: the most a
    request of that step verified), so that a reader who knows the
    engine was busy (a benchmark's window) can report it as a stall. Host clock only, no sync:
    under async scheduling the period is the step time the engine runs at. The last < N steps
    before the engine stops are not logged."""

    IDLE_S = 1.0
    clock = staticmethod(time.time)

    def __init__(self, every: int):
        self.every = every
        self.times: list[float] = []
        self.kinds: list[str] = []
        self.drafts = 0  # the last step's most drafts of one request

    @staticmethod
    def kind(scheduler_output) -> str:
        return StepPeriods._kind_and_drafts(scheduler_output)[0]

    @staticmethod
    def _kind_and_drafts(scheduler_output) -> tuple[str, int]:
        from ddtree.vllm_plugin.tuner import scheduled_drafts

        _, uniform, longest = scheduled_drafts(scheduler_output)
        return ("v" if uniform else ("m" if longest else "p")), longest

    def record(self, scheduler_output) -> None:
        if not scheduler_output.total_num_scheduled_tokens:
            return
        now = self.clock()
        if self.times and now - self.times[-1] > self.IDLE_S:
            gap = [
                round(self.times[-1], 6), round(now - self.times[-1], 3), self.kinds[-1],
                self.drafts,
            ]  # fmt: skip
            self._flush(self.times, self.kinds[:-1], gap)  # the last step's end is unknown
            self.times, self.kinds = [], []
        kind, self.drafts = self._kind_and_drafts(scheduler_output)
        self.times.append(now)
        self.kinds.append(kind)
        if len(self.kinds) > self.every:
            self._flush(self.times, self.kinds[:-1])
            self.times, self.kinds = self.times[-1:], self.kinds[-1:]

    @staticmethod
    def _flush(times: list[float], kinds: list[str], gap: list | None = None) -> None:
        report: dict = {"t": [round(t, 6) for t in times[: len(kinds) + 1]], "k": "".join(kinds)}
        if gap is not None:
            report["gap"] = gap
        elif not kinds:
            return
        log.warning("%s%s", STEPS_MARKER, json.dumps(report, separators=(",", ":")))


def record_step(runner, scheduler_output, dummy_run: bool = False) -> None:
    """``DDTREE_STEP_LOG``: note the step in ``runner``'s own :class:`StepPeriods`."""
    every = config.SETTINGS.step_log_every
    if not every or dummy_run:
        return
    periods = getattr(runner, "ddtree_step_periods", None)
    if periods is None:
        periods = runner.ddtree_step_periods = StepPeriods(every)
    periods.record(scheduler_output)
