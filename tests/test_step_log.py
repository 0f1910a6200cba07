"""DDTREE_STEP_LOG: the step periods by kind that `ddtree bench --step-log` reads back."""

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from ddtree.bench.report import parse_steps_log, sum_step_periods  # noqa: E402
from ddtree.vllm_plugin import config, debug  # noqa: E402


def _step(drafts: dict[str, list[int]], scheduled: dict[str, int]):
    return SimpleNamespace(
        scheduled_spec_decode_tokens=drafts,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
    )


def test_step_periods_by_kind_are_logged_every_n_steps(monkeypatch, caplog):
    verify = _step({"a": [1, 2], "b": [3]}, {"a": 3, "b": 2})
    mixed = _step({"a": [1, 2]}, {"a": 3, "c": 40})
    plain = _step({}, {"c": 1, "d": 9})
    assert [debug.StepPeriods.kind(s) for s in (verify, mixed, plain)] == [
        "verify",
        "mixed",
        "plain",
    ]
    clock = iter([0.0, 0.004, 0.010, 0.011, 0.015])  # periods: 4, 6, 1, 4 ms
    monkeypatch.setattr(debug.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(config, "SETTINGS", config.Settings(step_log_every=4))
    runner = SimpleNamespace()
    with caplog.at_level(logging.WARNING, logger="vllm.ddtree"):
        debug.record_step(runner, verify, dummy_run=True)  # warm-up runs are not steps
        debug.record_step(runner, _step({}, {}))  # nor are empty ones
        for step in (verify, mixed, verify, plain, verify):
            debug.record_step(runner, step)
    periods = sum_step_periods(parse_steps_log(caplog.text))
    assert periods == {
        "verify": {"steps": 2, "ms": 2.5},  # 4 and 1 ms: a period is its own step's kind
        "mixed": {"steps": 1, "ms": 6.0},
        "plain": {"steps": 1, "ms": 4.0},
    }
    monkeypatch.setattr(config, "SETTINGS", config.Settings())
    other = SimpleNamespace()
    debug.record_step(other, verify)
    assert not hasattr(other, "ddtree_step_periods")  # off: nothing is kept
