"""DDTREE_STEP_LOG: the step periods by kind that `ddtree bench --step-log` reads back."""

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from ddtree.bench.report import parse_step_gaps, parse_steps_log  # noqa: E402
from ddtree.vllm_plugin import config, debug  # noqa: E402


def _step(drafts: dict[str, list[int]], scheduled: dict[str, int]):
    return SimpleNamespace(
        scheduled_spec_decode_tokens=drafts,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
    )


def test_steps_are_logged_with_their_times_and_kinds(monkeypatch, caplog):
    verify = _step({"a": [1, 2], "b": [3]}, {"a": 3, "b": 2})
    mixed = _step({"a": [1, 2]}, {"a": 3, "c": 40})
    plain = _step({}, {"c": 1, "d": 9})
    assert [debug.StepPeriods.kind(s) for s in (verify, mixed, plain)] == ["v", "m", "p"]
    # step starts: 4 steps, then 5 s idle (the engine had no requests), then 3 more
    clock = iter([0.0, 0.004, 0.010, 0.011, 5.011, 5.015, 5.020])
    monkeypatch.setattr(debug.StepPeriods, "clock", staticmethod(lambda: next(clock)))
    monkeypatch.setattr(config, "SETTINGS", config.Settings(step_log_every=2))
    runner = SimpleNamespace()
    with caplog.at_level(logging.WARNING, logger="vllm.ddtree"):
        debug.record_step(runner, verify, dummy_run=True)  # warm-up runs are not steps
        debug.record_step(runner, _step({}, {}))  # nor are empty ones
        for step in (verify, mixed, verify, plain, verify, verify, mixed):
            debug.record_step(runner, step)
    steps = parse_steps_log(caplog.text)
    assert [(round(1000 * (b - a)), k) for a, b, k in steps] == [
        (4, "verify"),  # a period is its own step's kind
        (6, "mixed"),
        (1, "verify"),  # then "plain" at 0.011: its end is unknown (idle after it): dropped
        (4, "verify"),
        (5, "verify"),
    ]  # and "mixed" at 5.020 waits for more steps
    # the dropped step is reported apart: idle or a stall, its reader decides
    assert parse_step_gaps(caplog.text) == [(0.011, 5.0, "plain", 0)]
    monkeypatch.setattr(config, "SETTINGS", config.Settings())
    other = SimpleNamespace()
    debug.record_step(other, verify)
    assert not hasattr(other, "ddtree_step_periods")  # off: nothing is kept


def test_a_gap_names_the_drafts_of_the_step_before_it(monkeypatch, caplog):
    clock = iter([0.0, 0.01, 3.5])
    monkeypatch.setattr(debug.StepPeriods, "clock", staticmethod(lambda: next(clock)))
    monkeypatch.setattr(config, "SETTINGS", config.Settings(step_log_every=8))
    runner = SimpleNamespace()
    with caplog.at_level(logging.WARNING, logger="vllm.ddtree"):
        for step in (
            _step({"a": [1]}, {"a": 2}),
            _step({"a": [1, 2, 3], "b": [4]}, {"a": 4, "b": 2}),
        ):
            debug.record_step(runner, step)
        debug.record_step(runner, _step({"a": [5]}, {"a": 2}))  # 3.49 s after the second
    assert parse_step_gaps(caplog.text) == [(0.01, 3.49, "verify", 3)]
    assert [k for _, _, k in parse_steps_log(caplog.text)] == ["verify"]
    monkeypatch.setattr(config, "SETTINGS", config.Settings())
