"""`ddtree bench`'s pure parts: prompt set, request schedule, ratios, tables, profile logs.

No vLLM engine starts here: the worker path runs against a fake ``vllm.LLM``."""

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddtree.bench import report
from ddtree.bench import vllm as bench
from ddtree.cli import main

MODELS = Path(__file__).resolve().parent.parent / "models"


# ---- prompts -------------------------------------------------------------------------------


def _prompt_args(**kw) -> argparse.Namespace:
    base = {"dummy": False, "target": MODELS / "target", "prompts": 16, "input_len": 64}
    return argparse.Namespace(**{**base, **kw})


def test_held_out_prompt_set_is_16_distinct_def_lines_and_deterministic():
    from transformers import AutoTokenizer

    prompts, source = bench.bench_prompts(_prompt_args())
    again, _ = bench.bench_prompts(_prompt_args())
    assert "held-out" in source
    assert len(prompts) == 16 and len({tuple(p) for p in prompts}) == 16
    assert all(len(p) == 64 for p in prompts)
    assert prompts == again and bench.prompt_set_digest(prompts) == bench.prompt_set_digest(again)
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "target")
    assert all(tokenizer.decode(p).lstrip().startswith("def ") for p in prompts)


def test_dummy_prompts_are_distinct_seeded_and_sized():
    prompts, source = bench.bench_prompts(_prompt_args(dummy=True, prompts=20, input_len=32))
    assert "random" in source
    assert len(prompts) == 20 and len({tuple(p) for p in prompts}) == 20
    assert all(len(p) == 32 for p in prompts)
    assert prompts == bench.dummy_prompts(20, 32)
    assert prompts != bench.dummy_prompts(20, 32, seed=1)


# ---- request schedule ----------------------------------------------------------------------


def test_request_schedule_examples():
    assert bench.request_schedule(16, 1) == list(range(16))  # c=1: every prompt once, in order
    assert bench.request_schedule(16, 16) == list(range(16)) * 4  # the 16 slots refill 3 times
    assert bench.request_schedule(16, 32) == list(range(16)) * 8
    assert bench.request_schedule(3, 2) == [0, 1, 2] * 3
    with pytest.raises(ValueError):
        bench.request_schedule(0, 1)


@given(st.integers(1, 40), st.integers(1, 64))
def test_request_schedule_whole_passes_and_enough_requests(num_prompts, concurrency):
    schedule = bench.request_schedule(num_prompts, concurrency)
    wanted = max(num_prompts, 4 * concurrency)
    assert wanted <= len(schedule) < wanted + num_prompts  # the fewest whole passes
    assert len(schedule) % num_prompts == 0
    assert schedule == [i % num_prompts for i in range(len(schedule))]


class FakeEngine:
    """Requests that finish after a fixed number of steps; records what ran with what."""

    def __init__(self, steps_per_request=lambda prompt: 3):
        self.steps_per_request = steps_per_request
        self.running: dict[str, list] = {}  # request id -> [prompt, steps left]
        self.added: list[tuple[int, ...]] = []
        self.batches: list[set[str]] = []  # the requests of every step

    def add(self, prompt):
        request_id = str(len(self.added))
        self.added.append(tuple(prompt))
        self.running[request_id] = [prompt, self.steps_per_request(prompt)]

    def step(self):
        self.batches.append(set(self.running))
        outputs = []
        for request_id, state in list(self.running.items()):
            state[1] -= 1
            done = state[1] == 0
            if done:
                del self.running[request_id]
            outputs.append(SimpleNamespace(request_id=request_id, finished=done))
        return outputs


def test_run_requests_at_c1_runs_each_request_alone_in_order():
    engine = FakeEngine(steps_per_request=lambda p: 1 + p[0] % 3)
    prompts = [[i] for i in range(7)]
    done = []
    finished = bench.run_requests(engine.add, engine.step, prompts, 1, done.append)
    assert engine.added == [tuple(p) for p in prompts]
    assert all(len(batch) == 1 for batch in engine.batches)  # never batched
    assert [o.request_id for o in finished] == [str(i) for i in range(7)]
    assert done == list(range(1, 8))
    assert len(engine.batches) == sum(1 + i % 3 for i in range(7))  # no idle step


def test_run_requests_keeps_c_in_flight_until_the_queue_runs_dry():
    engine = FakeEngine(steps_per_request=lambda p: 2 + p[0] % 5)
    prompts = [[i] for i in range(40)]
    finished = bench.run_requests(engine.add, engine.step, prompts, 6)
    assert engine.added == [tuple(p) for p in prompts] and len(finished) == 40
    sizes = [len(batch) for batch in engine.batches]
    assert max(sizes) == 6
    for i, size in enumerate(sizes):
        started = len(set().union(*engine.batches[: i + 1]))
        # Full while requests are queued: fewer only once every request has started.
        assert size == 6 or started == 40, (i, size, started)


# ---- ratios and tables ---------------------------------------------------------------------


def _row(engine, c, t, tps, tau=1.0, **kw):
    return {
        "engine": engine,
        "concurrency": c,
        "temperature": t,
        "tokens_per_s": tps,
        "tau": tau,
        **kw,
    }


def _grid():
    return [
        _row("ar", 1, 0.0, 500.0, ms_per_engine_step=2.0),
        _row("dflash", 1, 0.0, 1000.0, 2.5, ms_per_engine_step=4.0),
        _row("ddtree-64", 1, 0.0, 1500.0, 3.25, ms_per_engine_step=5.123),
        _row("ar", 16, 0.0, 4000.0),
        _row("ddtree-64", 16, 0.0, 2000.0, 3.0),  # no chain row at this point
    ]


def test_ratios_against_the_chain_and_no_spec_at_the_same_point():
    rows = _grid()
    ratios = {(r["engine"], r["concurrency"]): r for r in report.add_ratios(rows)}
    assert ratios[("ddtree-64", 1)]["tokens_per_s_vs_dflash"] == 1.5
    assert ratios[("ddtree-64", 1)]["tokens_per_s_vs_ar"] == 3.0
    assert ratios[("dflash", 1)]["tokens_per_s_vs_dflash"] == 1.0
    assert ratios[("dflash", 1)]["tokens_per_s_vs_ar"] == 2.0
    assert ratios[("ar", 1)]["tokens_per_s_vs_dflash"] == 0.5
    assert "tokens_per_s_vs_ar" not in ratios[("ar", 1)]
    assert "tokens_per_s_vs_dflash" not in ratios[("ddtree-64", 16)]  # no chain at c=16
    assert ratios[("ddtree-64", 16)]["tokens_per_s_vs_ar"] == 0.5
    assert all("tokens_per_s_vs_ar" not in r for r in rows)  # the input rows are untouched


def test_repeats_aggregate_to_medians_pooled_tau_and_paired_ratios():
    runs = [
        _row("dflash", 1, 0.0, tps, 2.0, repeat=i, draft_steps=100, ms_per_engine_step=ms)
        for i, (tps, ms) in enumerate([(1000.0, 4.0), (800.0, 5.0), (1200.0, 3.0)])
    ] + [
        _row("ddtree-64", 1, 0.0, tps, tau, repeat=i, draft_steps=drafts)
        for i, (tps, tau, drafts) in enumerate(
            [(1100.0, 3.0, 50), (1000.0, 4.0, 150), (1300.0, 3.0, 100)]
        )
    ]  # fmt: skip
    rows = {r["engine"]: r for r in report.add_ratios(report.aggregate(runs))}
    chain, tree = rows["dflash"], rows["ddtree-64"]
    assert chain["tokens_per_s"] == 1000.0 and chain["tokens_per_s_runs"] == [1000.0, 800.0, 1200.0]
    assert chain["ms_per_engine_step"] == 4.0 and chain["repeats"] == 3 and "repeat" not in chain
    assert tree["tau"] == 1 + (2 * 50 + 3 * 150 + 2 * 100) / 300  # pooled over the drafts
    assert tree["draft_steps"] == 300
    assert tree["tokens_per_s_vs_dflash"] == 1.1  # median over median
    assert tree["tokens_per_s_vs_dflash_runs"] == [1.1, 1.25, 1.083]  # repeat by repeat
    cell = report.speed_cell(tree, "tokens_per_s_vs_dflash")
    assert cell == "1100 (3.50) x1.10 [1.08-1.25]"
    assert report.speed_cell(chain, "tokens_per_s_vs_dflash") == "1000 (2.00) x1.00"
    summary = report.summary_markdown(list(rows.values()), ["dflash", "ddtree-64"])
    assert "Each point measured 3 times" in summary


def test_speed_table_rows_are_engines_columns_are_points():
    rows = report.add_ratios(_grid())
    key = report.reference_key(rows)
    assert key == "tokens_per_s_vs_dflash"
    table = report.markdown_table(
        rows, lambda r: report.speed_cell(r, key), ["ar", "dflash", "dflash-v1", "ddtree-64"]
    )
    assert table.splitlines() == [
        "| engine | c=1 T=0 | c=16 T=0 |",
        "|---|---:|---:|",
        "| ar | 500 (1.00) x0.50 | 4000 (1.00) |",
        "| dflash | 1000 (2.50) x1.00 | - |",
        "| ddtree-64 | 1500 (3.25) x1.50 | 2000 (3.00) |",
    ]
    steps = report.markdown_table(rows, report.step_cell, ["ddtree-64"])
    assert steps.splitlines()[-1] == "| ddtree-64 | 5.12 | - |"


def test_without_the_chain_the_table_shows_the_no_spec_ratio():
    rows = report.add_ratios([r for r in _grid() if r["engine"] != "dflash"])
    key = report.reference_key(rows)
    assert key == "tokens_per_s_vs_ar"
    summary = report.summary_markdown(rows, ["ar", "ddtree-64"])
    assert "over ar (no-spec)" in summary
    assert "| ddtree-64 | 1500 (3.25) x3.00 | 2000 (3.00) x0.50 |" in summary


# ---- DDTREE_PROFILE logs -------------------------------------------------------------------

LOG = """\
(EngineCore pid=5475) INFO 12-03 15:22:24 [core.py:116] Initializing a V1 LLM engine
(EngineCore pid=5475) WARNING:ddtree:ddtree-profile {"steps": 20, "ms_per_step": {"prepare": 1.0, "forward": 10.0, "attention": 4.0}}
{"engine": "ddtree-64", "concurrency": 1}
(EngineCore pid=5475) WARNING:ddtree:ddtree-ops by self_cpu_time_total
-----  ddtree-profile is not at the start of this table line  ---
(EngineCore pid=5475) WARNING:ddtree:ddtree-profile {"steps": 10, "ms_per_step": {"prepare": 4.0, "forward": 16.0}}
"""  # noqa: E501


def test_profile_lines_parse_and_average_by_steps():
    readable = [line for line in LOG.splitlines() if "table line" not in line]
    reports = report.parse_profile_log("\n".join(readable))
    assert [r["steps"] for r in reports] == [20, 10]
    mean = report.mean_profile(reports)
    assert mean == {
        "reports": 2,
        "steps": 30,
        "ms_per_step": {"prepare": 2.0, "forward": 12.0, "attention": 4.0},
    }
    assert report.mean_profile([]) is None
    assert report.parse_profile_log("no reports here\n") == []


def test_a_garbled_profile_line_is_an_error():
    with pytest.raises(ValueError, match="unreadable ddtree-profile"):
        report.parse_profile_log(LOG)  # the op table's line that names the marker


def test_profile_table_in_the_summary():
    rows = _grid()
    rows[2]["profile"] = {"reports": 1, "steps": 20, "ms_per_step": {"forward": 10.0, "build": 2.5}}
    summary = report.summary_markdown(report.add_ratios(rows), ["ar", "dflash", "ddtree-64"])
    assert "| engine | c | T | steps | forward | build |" in summary
    assert "| ddtree-64 | 1 | 0 | 20 | 10.00 | 2.50 |" in summary
    assert report.profile_table(_grid()) is None
    rows[2]["profile_error"] = "unreadable ddtree-profile line: 'x'"
    summary = report.summary_markdown(report.add_ratios(rows), ["ddtree-64"])
    assert "profile log of ddtree-64 c=1 T=0 not read: unreadable" in summary


def test_ddtree_profile_env_only_for_ddtree_engines():
    base = {"PATH": "/bin", "DDTREE_PROFILE": "7", "DDTREE_ACCEPTANCE": "3"}
    assert bench.engine_env("ddtree-64", base, 20)["DDTREE_PROFILE"] == "20"
    assert "DDTREE_PROFILE" not in bench.engine_env("dflash", base, 20)
    assert bench.engine_env("dflash", base, None) == base  # no flag: the environment as it is
    assert base["DDTREE_PROFILE"] == "7"
    assert bench.engine_env("ddtree-s1", base, None, 50)["DDTREE_ACCEPTANCE"] == "50"
    assert "DDTREE_ACCEPTANCE" not in bench.engine_env("ar", base, None, 50)


def test_budget_plan_picks_the_fastest_budget_per_concurrency():
    curve = [0.5] * 15 + [1.5] * 48 + [2.0] * 192  # accepted at K = 1..255 (B=255's walks)
    rows = [
        _row("ddtree-15", 1, 0.0, 1, ms_per_engine_step=4.0),
        _row("ddtree-63", 1, 0.0, 1, ms_per_engine_step=4.2),
        _row("ddtree-255", 1, 0.0, 1, ms_per_engine_step=4.6, accepted_by_budget=curve),
        _row("ddtree-15", 16, 0.0, 1, ms_per_engine_step=5.0),
        _row("ddtree-63", 16, 0.0, 1, ms_per_engine_step=9.0),
        _row("ddtree-255", 16, 0.0, 1, ms_per_engine_step=20.0, accepted_by_budget=curve),
        _row("dflash", 1, 0.0, 1, ms_per_engine_step=3.0),
    ]
    plan = report.budget_plan(rows)
    # c=1: 1.5/4.0, 2.5/4.2, 3.0/4.6 tokens per ms -> 255; c=16: 0.30, 0.28, 0.15 -> 15
    assert "B=15: 0.50, B=63: 1.50, B=255: 2.00" in plan
    assert "| 1 | 375 | 595 | **652** |" in plan
    assert "| 16 | **300** | 278 | 150 |" in plan
    assert '"ddtree_budget_per_batch_size": [[1, 1, 255], [2, 16, 15]]' in plan
    assert report.budget_plan([r for r in rows if r["engine"] != "ddtree-255"]) is None
    assert "Budget plan, T=0" in report.summary_markdown(rows, ["dflash", "ddtree-15"])


# ---- the worker against a fake vllm.LLM ----------------------------------------------------


class FakeLLM:
    """What ``run_engine`` / ``measure`` use of ``vllm.LLM``: requests of ``max_tokens``
    tokens, 2 accepted per draft; every 4th step logs a ddtree-profile report."""

    instances: list["FakeLLM"] = []
    log: Path | None = None

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.requests: list[tuple[tuple[int, ...], int, float]] = []
        self.params: list = []  # every request's SamplingParams
        self.running: dict[int, int] = {}
        self.batch_sizes: list[int] = []
        self.drafts = self.accepted = self.steps = 0
        self.llm_engine = SimpleNamespace(
            step=self._step,
            has_unfinished_requests=lambda: bool(self.running),
            engine_core=SimpleNamespace(shutdown=lambda: None),
            vllm_config=SimpleNamespace(
                use_v2_model_runner=False,
                compilation_config=SimpleNamespace(
                    cudagraph_mode="NONE", max_cudagraph_capture_size=0
                ),
            ),
        )
        FakeLLM.instances.append(self)
        if self.log is not None:  # vLLM's start-up report of the KV cache
            with self.log.open("a") as log:
                log.write(MEMORY_LOG)

    def enqueue(self, prompt, params, use_tqdm=True):
        ids = tuple(prompt["prompt_token_ids"])
        self.requests.append((ids, params.max_tokens, params.temperature))
        self.params.append(params)
        self.running[len(self.requests)] = params.max_tokens
        return [str(len(self.requests))]

    def _step(self):
        self.steps += 1
        self.batch_sizes.append(len(self.running))
        if self.log is not None:  # DDTREE_STEP_LOG's line of this step, as the engine writes it
            now = time.time()  # a step that starts and ends inside its measurement's window
            while (end := time.time()) <= now:
                pass
            with self.log.open("a") as log:
                log.write(f'WARNING ddtree-steps {{"t":[{now},{end}],"k":"v"}}\n')
        if self.log is not None and self.steps % 4 == 0:
            with self.log.open("a") as log:
                report = {"steps": 4, "ms_per_step": {"forward": float(self.steps)}}
                log.write(
                    f"(EngineCore pid=1) WARNING:ddtree:ddtree-profile {json.dumps(report)}\n"
                )
                curve = {"steps": 4, "budget": 2, "rows": [4, 2], "accepted": [3, 4]}
                log.write(f"(EngineCore pid=1) WARNING ddtree-acceptance {json.dumps(curve)}\n")
        outputs = []
        for request, left in list(self.running.items()):
            self.drafts += 1
            self.accepted += 2
            self.running[request] = left = max(left - 3, 0)
            if left == 0:
                del self.running[request]
                sample = SimpleNamespace(token_ids=[7] * self.requests[request - 1][1])
                outputs.append(
                    SimpleNamespace(request_id=str(request), finished=True, outputs=[sample])
                )
        return outputs

    def get_metrics(self):
        return [
            SimpleNamespace(name="vllm:spec_decode_num_drafts", value=self.drafts),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=self.accepted),
            SimpleNamespace(name="vllm:iteration_tokens_total", count=self.steps),
        ]


@pytest.mark.parametrize("structured_output", ["none", "json"])
def test_engine_workers_run_identical_requests_and_collect_the_profile(
    tmp_path, monkeypatch, structured_output
):
    import vllm

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    FakeLLM.instances = []
    prompts = bench.dummy_prompts(5, 8)
    prompt_set = {"sha256": bench.prompt_set_digest(prompts), "prompts": prompts}
    (tmp_path / "prompts.json").write_text(json.dumps(prompt_set))
    argv = [
        "bench",
        "--methods",
        "ar,ddtree",
        "--budgets",
        "16",
        "--concurrency",
        "1,4",
        "--temperatures",
        "0,1",
        "--max-tokens",
        "9",
        "--out",
        str(tmp_path),
    ]
    for name in ("ar", "ddtree-16"):
        log = tmp_path / f"{name}.log"
        log.write_text("")
        FakeLLM.log = log if name.startswith("ddtree") else None
        args = argparse.Namespace(
            dummy=True,
            target=tmp_path,
            draft=tmp_path,
            dtype="float32",
            max_model_len=64,
            kv_cache_gib=1.0,
            ddtree_options={},
            concurrency=[1, 4],
            budgets=[16],
            temperatures=[0.0, 1.0],
            max_tokens=9,
            repeats=2,
            ddtree_schedules=[],
            ddtree_auto=None,
            structured_output=structured_output,
            step_log=4,
            engines=[name],
            argv=argv,
            out=tmp_path,
        )
        (tmp_path / "turn").unlink(missing_ok=True)  # each engine alone here: its own turns
        bench.run_engine(name, args, log)
    ar, tree = FakeLLM.instances
    assert ar.requests == tree.requests  # same prompts, lengths, temperatures, same order
    measured = [r for r in ar.requests if r[1] == 9]  # warm-up requests have 8 tokens
    want = [
        (tuple(prompts[i]), 9, t)
        for _ in range(2)  # repeats
        for t in (0.0, 1.0)
        for c in (1, 4)
        for i in bench.request_schedule(5, c)
    ]
    assert measured == want
    for params in ar.params + tree.params:  # a JSON request ends at its EOS, others run on
        grammar = params.structured_outputs
        if structured_output == "json":
            assert grammar.json == bench.JSON_SCHEMA and not params.ignore_eos
        else:
            assert grammar is None and params.ignore_eos
    result = json.loads((tmp_path / "ddtree-16.json").read_text())
    assert result["prompts_sha256"] == prompt_set["sha256"]
    assert [r["repeat"] for r in result["rows"]] == [0] * 4 + [1] * 4
    by_point = {(r["concurrency"], r["temperature"]): r for r in result["rows"]}
    assert by_point[(1, 0.0)]["requests"] == 5 and by_point[(4, 0.0)]["requests"] == 20
    assert by_point[(4, 1.0)]["prompts"] == 5 and by_point[(4, 1.0)]["tokens"] == 180
    assert by_point[(1, 0.0)]["tau"] == 3.0
    assert all(r["profile"]["reports"] >= 1 for r in result["rows"])
    for row in result["rows"]:  # every 4th step logged [4, 2] rows, [3, 4] accepted
        reports = row["acceptance"]["rows"][0] // 4
        assert row["acceptance"] == {
            "rows": [4 * reports, 2 * reports],
            "accepted": [3 * reports, 4 * reports],
        }
        assert row["accepted_by_budget"] == [0.75, 2.0]
    assert result["profile"]["steps"] == 4 * result["profile"]["reports"]
    assert result["memory"]["stash_mib"] == 980.0 and result["kv_cache_gib"] is None  # no CUDA
    for row in result["rows"]:  # the steps of its own window, none of the others'
        assert row["step_periods"]["verify"]["steps"] == row["engine_steps"]
        assert "window" not in row
    assert "profile" not in json.loads((tmp_path / "ar.json").read_text())["rows"][0]
    progress = json.loads((tmp_path / "ddtree-16.progress").read_text())
    assert progress == {"label": "c=4 T=1 #2/2", "done": 20, "total": 20}


def test_engines_take_turns_per_point_and_skip_a_failed_one(tmp_path):
    """Three engine threads, 3 points: each point's engines measure one at a time, in the
    engine order rotated by the point; an engine that fails gives its later turns away."""
    import threading

    engines = ["ar", "dflash", "ddtree-64"]
    order, lock = [], threading.Lock()

    def worker(name: str) -> None:
        turns = bench.Turns(tmp_path, engines)
        for point in range(3):
            turns.wait(point, name)
            if name == "dflash" and point == 1:  # fails while it holds the turn
                (tmp_path / "dflash.failed").touch()
                return
            with lock:
                order.append((point, name))
            turns.done()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in reversed(engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert order == [
        (0, "ar"), (0, "dflash"), (0, "ddtree-64"),
        (1, "ddtree-64"), (1, "ar"),  # rotated by 1: dflash first, failed in its turn
        (2, "ddtree-64"), (2, "ar"),  # rotated by 2: dflash's (last) slot never wanted
    ]  # fmt: skip


class FakeBar:
    """Records when ``MeasurementBars`` opens and closes its tqdm lines."""

    events: list[tuple[str, str]] = []

    def __init__(self, total, desc, unit):
        self.total, self.desc, self.n = total, desc, 0
        self.events.append(("open", desc))

    def refresh(self):
        pass

    def close(self):
        self.events.append(("close", f"{self.desc} {self.n}/{self.total}"))


def test_progress_files_give_one_bar_per_measurement(tmp_path, monkeypatch):
    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", FakeBar)
    FakeBar.events = []
    bars = bench.MeasurementBars(tmp_path, ["ddtree-16", "ar"])
    bars.poll()
    assert not bars.open  # nothing measured yet
    first = bench.ProgressFile(tmp_path / "ar.progress", "c=1 T=0", 16)
    bars.poll()
    first.update(5)  # within 0.5 s of the last write: not written (it is in the timed loop)
    assert json.loads((tmp_path / "ar.progress").read_text())["done"] == 0
    second = bench.ProgressFile(tmp_path / "ar.progress", "c=4 T=0", 32)
    bars.poll()  # c=1's end was never seen: the next label closes it, as complete
    second.update(32)  # the last request is always written
    # One poll sees ar's last request and ddtree's first: ar's line closes before the next opens.
    bench.ProgressFile(tmp_path / "ddtree-16.progress", "c=1 T=0", 8).write(2)
    bars.poll()
    bars.close()
    assert FakeBar.events == [
        ("open", "ar c=1 T=0"),
        ("close", "ar c=1 T=0 16/16"),
        ("open", "ar c=4 T=0"),
        ("close", "ar c=4 T=0 32/32"),
        ("open", "ddtree-16 c=1 T=0"),
        ("close", "ddtree-16 c=1 T=0 2/8"),  # an engine that failed mid-way: its count stays
    ]


# ---- flags and plot ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompts", "0"], "--prompts must be >= 1"),
        (["--concurrency", "1,x"], "--concurrency '1,x'"),
        (["--concurrency", "0,4"], "--concurrency '0,4': each must be >= 1"),
        (["--temperatures", "-1"], "--temperatures"),
        (["--budgets", ""], "--budgets is empty"),
        (["--ddtree-profile", "0"], "--ddtree-profile must be >= 1"),
        (["--ddtree-profile", "5", "--methods", "ar,dflash"], "--ddtree-profile needs ddtree"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--ddtree-acceptance", "0"], "--ddtree-acceptance must be >= 1"),
        (["--ddtree-schedules", "[[[1, 4, 0]]]"], "--ddtree-schedules .*must be in"),
        (["--ddtree-schedules", '[[[1, "x", 3]]]'], "--ddtree-schedules .*ints"),
        (["--ddtree-schedules", "[[1, 4, 255]]"], "--ddtree-schedules"),
        (["--ddtree-schedules", "{}"], "must be a JSON list"),
        (["--ddtree-auto", "0"], "--ddtree-auto must be a budget"),
        (["--max-cudagraph-capture-size", "0"], "--max-cudagraph-capture-size must be >= 1"),
        (["--max-cudagraph-capture-size", "2048"], "--max-cudagraph-capture-size needs a CUDA"),
        (
            ["--ddtree-auto", "63", "--ddtree-options", '{"ddtree_budget_per_batch_size": "auto"}'],
            "use one",
        ),
        (
            [
                "--ddtree-schedules",
                "[[[1, 512, 15]]]",
                "--ddtree-options",
                '{"ddtree_budget_per_batch_size": [[1, 512, 15]]}',
            ],
            "use one",
        ),
    ],
)
def test_bad_flag_values_name_the_flag(tmp_path, monkeypatch, flags, message):
    monkeypatch.setattr(bench, "drive", lambda args: pytest.fail("a bad flag started engines"))
    with pytest.raises(SystemExit, match=message):
        main(["bench", *flags, "--out", str(tmp_path)])


def test_schedule_engines_get_their_schedule_and_largest_budget(tmp_path, monkeypatch):
    # engine_kwargs sets an engine process's own variables: restored after this test
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    schedules = [[[1, 4, 255], [5, 512, 15]], [[1, 2, 63], [3, 512, 15]]]
    names = bench.engine_names(["dflash", "ddtree"], [15], schedules, auto=127)
    assert names == ["dflash", "ddtree-15", "ddtree-s1", "ddtree-s2", "ddtree-a127"]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    args = argparse.Namespace(
        target=tmp_path, draft=tmp_path, dtype="float32", max_model_len=64, dummy=False,
        concurrency=[1, 4], budgets=[15], ddtree_schedules=schedules, kv_cache_gib=1.0,
        ddtree_options={"ddtree_chain_seed": False}, ddtree_auto=127,
        max_cudagraph_capture_size=None,
    )  # fmt: skip
    auto = bench.engine_kwargs("ddtree-a127", args)
    assert auto["speculative_config"]["ddtree_budget"] == 127
    assert auto["speculative_config"]["ddtree_budget_per_batch_size"] == "auto"
    assert auto["max_num_batched_tokens"] >= 4 * 128
    # the tuner shares the scheduler's process; the CPU build keeps "uni" only in-process
    assert auto["distributed_executor_backend"] == "uni"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    spec = bench.engine_kwargs("ddtree-s2", args)["speculative_config"]
    assert spec["ddtree_budget"] == 63 and spec["ddtree_budget_per_batch_size"] == schedules[1]
    assert spec["ddtree_chain_seed"] is False
    fixed = bench.engine_kwargs("ddtree-15", args)["speculative_config"]
    assert fixed["ddtree_budget"] == 15 and fixed["ddtree_budget_per_batch_size"] == "fixed"
    assert bench.schedule_label(schedules[0]) == "1-4: 255, 5-512: 15"
    # --max-cudagraph-capture-size: every engine's graphs (GPU), the chain's own mode kept
    args.max_cudagraph_capture_size = 16384
    with mock.patch("torch.cuda.is_available", lambda: True):
        for name in ("dflash", "dflash-v1", "ddtree-15", "ddtree-a127"):
            kw = bench.engine_kwargs(name, args)
            assert kw["compilation_config"]["max_cudagraph_capture_size"] == 16384, name
            assert kw["max_num_batched_tokens"] >= 16384
        assert bench.engine_kwargs("dflash-v1", args)["compilation_config"]["cudagraph_mode"]

    assert "language_model_only" not in bench.engine_kwargs("ar", args)
    # A hybrid target (here the 27B shapes): text only; "mtp" is vLLM's MTP on its own layer.
    args.target, args.draft = bench.write_dummy_shapes(tmp_path / "models", "qwen3.6-27b")
    mtp = bench.engine_kwargs("mtp", args)
    assert mtp["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert mtp["language_model_only"] and bench.engine_kwargs("ar", args)["language_model_only"]
    assert bench.engine_kwargs("ddtree-15", args)["language_model_only"]


def test_random_prompts_stay_inside_the_targets_vocabulary(tmp_path):
    """``--random-prompts`` (word-level test pairs): seeded ids in [2, V - 1), past the unknown
    and EOS ids and short of the mask token; a multimodal config's text vocabulary is used."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 32}}))
    args = _prompt_args(target=tmp_path, random_prompts=True, prompts=20, input_len=40)
    prompts, source = bench.bench_prompts(args)
    assert "random" in source and "[2, 31)" in source
    assert len(prompts) == 20 and all(len(p) == 40 for p in prompts)
    ids = {t for p in prompts for t in p}
    assert min(ids) == 2 and max(ids) == 30
    assert prompts == bench.bench_prompts(args)[0]


def test_bench_plot_tokens_ratio_and_tau_panels(tmp_path):
    rows = report.add_ratios(
        _grid()
        + [_row("dflash", 16, 0.0, 3000.0, 2.0), _row("ar", 1, 1.0, 400.0)]
        + [_row("ddtree-s1", 1, 0.0, 1700.0, 3.5), _row("ddtree-s1", 16, 0.0, 3100.0, 2.4)]
    )
    report.plot(rows, tmp_path / "bench.png", "test")
    assert (tmp_path / "bench.png").stat().st_size > 0


@pytest.mark.parametrize("shapes", ["qwen3-8b", "qwen3.6-27b"])
def test_dummy_shape_checkpoints_load_and_pair(tmp_path, shapes):
    """``--dummy-shapes``: config-only checkpoints transformers reads, whose drafter fits the
    target (the start-up check); Qwen3.6-27B: 48 GDN + 16 attention layers, an MTP layer."""
    from transformers import AutoConfig

    from ddtree.bench.shapes import write_dummy_shapes
    from ddtree.dflash import check_pair, read_config

    target, drafter = write_dummy_shapes(tmp_path, shapes)
    config = AutoConfig.from_pretrained(target)
    check_pair(read_config(drafter / "config.json"), config)
    text = config.get_text_config()
    if shapes == "qwen3.6-27b":
        assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
        assert text.layer_types.count("linear_attention") == 48
        assert (text.linear_num_key_heads, text.linear_num_value_heads) == (16, 48)
        assert text.mtp_num_hidden_layers == 1
    # vLLM's DFlash layers resolve a window for every sliding layer (a window that
    # transformers dropped made the 27B drafter fail at start-up on the H100, 2026-12-06)
    from vllm.model_executor.models import qwen3_dflash

    draft = AutoConfig.from_pretrained(drafter)
    v2 = type("VllmConfig", (), {"use_v2_model_runner": True})()
    with mock.patch.object(qwen3_dflash, "get_current_vllm_config", lambda: v2):
        windows = [
            qwen3_dflash._resolve_layer_attention(draft, i)[0]
            for i in range(draft.num_hidden_layers)
        ]
    sliding = [t == "sliding_attention" for t in (draft.layer_types or [])]
    assert [w is not None for w in windows] == (sliding or [False] * len(windows))


def test_a_failed_engine_is_named_beside_the_table(tmp_path, monkeypatch):
    """An engine that exits non-zero (e.g. a refused option) has no row: bench.md says so
    instead of showing a table without it."""

    class Exited:  # every engine process exits at once; the chain's wrote its rows first
        def __init__(self, cmd, **kwargs):
            name = cmd[cmd.index("--engine") + 1]
            self.returncode = 0 if name == "dflash" else 1
            if name == "dflash":
                rows = [{**_row("dflash", 1, 0.0, 500.0, 2.0)}]
                (tmp_path / "dflash.json").write_text(json.dumps({"rows": rows}))

        def poll(self):
            return self.returncode

    monkeypatch.setattr(bench.subprocess, "Popen", Exited)
    monkeypatch.setattr(bench, "bench_prompts", lambda args: ([[1, 2, 3]], "test prompts"))
    monkeypatch.setattr(bench.time, "sleep", lambda seconds: None)
    args = argparse.Namespace(
        out=tmp_path, engines=["dflash", "ddtree-15"], argv=[], concurrency=[1], input_len=None,
        repeats=1, ddtree_schedules=[], ddtree_profile=None, ddtree_acceptance=None, step_log=None,
        title="t", target=tmp_path,
    )  # fmt: skip
    rows = bench.drive(args)
    table = (tmp_path / "bench.md").read_text()
    assert [r["engine"] for r in rows] == ["dflash"]
    assert "**ddtree-15: failed** (exit 1)" in table and "ddtree-15.log" in table
    assert "| dflash |" in table


MEMORY_LOG = """\
(EngineCore pid=1) INFO 12-05 [kv_cache_utils.py:2177] GPU KV cache size: 131,072 tokens
(EngineCore pid=1) INFO 12-05 [kv_cache_utils.py:2179] Maximum concurrency for 4,096 tokens \
per request: 32.50x
(EngineCore pid=1) INFO 12-05 [gdn.py:110] ddtree: 48 GDN layers, tree stashes of 980.0 MiB \
(16 requests x 64 slots)
"""


def test_memory_read_from_the_start_up_log():
    memory = report.parse_memory_log(MEMORY_LOG)
    assert memory == {
        "kv_cache_tokens": 131072,
        "max_model_len": 4096,
        "max_concurrency": 32.5,
        "stash_mib": 980.0,
        "stash_requests": 16,
    }
    plain = report.parse_memory_log(MEMORY_LOG.rsplit("(EngineCore", 1)[0])
    assert "stash_mib" not in plain and plain["max_concurrency"] == 32.5
    assert report.parse_memory_log("no kv cache line here") is None
    engines = {
        "dflash": {"memory": plain, "kv_cache_gib": 8.0},
        "ddtree-63": {"memory": memory, "kv_cache_gib": 8.0},
        "cpu": {"memory": plain, "kv_cache_gib": None},
        "failed": {"memory": None},
    }
    table = report.memory_table(engines)
    assert "requests of 4,096 tokens" in table
    assert "| dflash | 131,072 | 32.50 | 0.246 | - |" in table
    assert "| ddtree-63 | 131,072 | 32.50 | 0.246 | 61.2 |" in table  # 980 MiB / 16 rows
    assert "| cpu | 131,072 | 32.50 | - | - |" in table
    assert "failed" not in table
    assert report.memory_table({"failed": {"memory": None}}) is None


def test_step_periods_from_the_log_by_window_pooled_and_tabled():
    lines = [
        'WARNING ddtree-steps {"t":[10.0,10.004,10.01,10.011],"k":"vmv"}',
        'WARNING ddtree-steps {"t":[10.011,10.015],"k":"p"}',
        'WARNING ddtree-steps {"t":[20.0,20.008],"k":"v"}',  # another measurement's
    ]
    steps = report.parse_steps_log("\n".join(["noise", *lines]))
    assert len(steps) == 5 and steps[1] == (10.004, 10.01, "mixed")
    periods = report.step_periods(steps, 10.0, 10.02)
    assert periods == {
        "verify": {"steps": 2, "ms": 2.5},  # 4 and 1 ms
        "mixed": {"steps": 1, "ms": 6.0},
        "plain": {"steps": 1, "ms": 4.0},
    }
    assert report.step_periods(steps, 10.005, 30.0) == {  # only steps wholly inside
        "verify": {"steps": 2, "ms": 4.5},
        "plain": {"steps": 1, "ms": 4.0},
    }
    for bad in ('ddtree-steps {"t": [1.0], "k": "v"}', 'ddtree-steps {"t": [1, 2], "k": "x"}'):
        with pytest.raises(ValueError, match="one more time than kinds"):
            report.parse_steps_log(bad)
    base = {"engine": "dflash", "concurrency": 16, "temperature": 0.0, "tokens_per_s": 1.0}
    runs = [
        {**base, "repeat": 0, "step_periods": {"verify": {"steps": 2, "ms": 4.0}}},
        {**base, "repeat": 1, "step_periods": {"verify": {"steps": 6, "ms": 6.0}}},
    ]
    (row,) = report.aggregate(runs)
    assert row["step_periods"] == {"verify": {"steps": 8, "ms": 5.5}}  # (8 + 36) / 8
    table = report.step_period_table([row, {**base, "engine": "ar"}])
    assert "| dflash | 16 | 0 | 5.50 (8) | - | - |" in table
    assert "| ar |" not in table
    assert report.step_period_table([base]) is None


def test_steps_over_a_second_inside_a_window_are_stalls():
    text = "\n".join(
        [
            'W ddtree-steps {"t":[10.0,10.01,10.02],"k":"vv","gap":[10.02,3.06,"v",15]}',
            'W ddtree-steps {"t":[13.08,13.09],"k":"v"}',
            # the window's last step, then idle while other engines are measured: not a stall
            'W ddtree-steps {"t":[13.09],"k":"","gap":[13.09,10.12,"v",15]}',
            'W ddtree-steps {"t":[40.0],"k":"","gap":[40.0,9.5,"p",0]}',  # between windows: idle
        ]
    )
    assert report.parse_step_gaps(text) == [
        (10.02, 3.06, "verify", 15), (13.09, 10.12, "verify", 15), (40.0, 9.5, "plain", 0)
    ]  # fmt: skip
    base = {"engine": "ddtree-a255", "concurrency": 1, "temperature": 0.0, "tokens_per_s": 1.0}
    rows = [{**base, "window": [9.0, 14.0]}, {**base, "repeat": 1, "window": [50.0, 51.0]}]
    report.window_steps(text, rows)
    assert rows[0]["stalls"] == [[3.06, "verify", 15]] and "window" not in rows[0]
    assert rows[0]["step_periods"] == {"verify": {"steps": 3, "ms": 10.0}}
    assert "stalls" not in rows[1]
    (row,) = report.aggregate(rows)
    assert row["stalls"] == [[3.06, "verify", 15]]
    assert "ddtree-a255 c=1 T=0: 3.06 s (verify, 15 drafts)" in report.step_period_table([row])
    bad = [{**base, "window": [9.0, 14.0]}]
    report.window_steps('W ddtree-steps {"t":[1.0],"k":"","gap":[1.0,2.0,"x",0]}', bad)
    assert (
        "gap [start, seconds, kind, drafts]" in bad[0]["step_log_error"] and "window" not in bad[0]
    )


def test_step_log_env_reaches_every_engine():
    env = bench.engine_env("dflash", {"DDTREE_PROFILE": "9"}, 5, None, 7)
    assert env["DDTREE_STEP_LOG"] == "7" and "DDTREE_PROFILE" not in env
    assert bench.engine_env("ddtree-15", {}, None, None, 7)["DDTREE_STEP_LOG"] == "7"
    assert "DDTREE_STEP_LOG" not in bench.engine_env("ar", {}, None, None, None)


def test_auto_engines_start_once_the_others_are_warm(tmp_path, monkeypatch):
    """An "auto" engine times its steps at start-up, so it starts after the other engines
    wrote ``.ready`` (or failed), not while they capture their graphs."""
    launched, polls = [], []

    class Engine:
        def __init__(self, cmd, **kwargs):
            self.name = cmd[cmd.index("--engine") + 1]
            self.returncode = None
            launched.append((self.name, sorted(p.name for p in tmp_path.glob("*.ready"))))

        def poll(self):
            polls.append(self.name)
            if polls.count(self.name) == 2:  # warm at its second poll, done at its fourth
                (tmp_path / f"{self.name}.ready").touch()
            if polls.count(self.name) >= 4:
                self.returncode = 0
            return self.returncode

    monkeypatch.setattr(bench.subprocess, "Popen", Engine)
    monkeypatch.setattr(bench, "bench_prompts", lambda args: ([[1, 2, 3]], "test prompts"))
    monkeypatch.setattr(bench.time, "sleep", lambda seconds: None)
    args = argparse.Namespace(
        out=tmp_path, engines=["dflash", "ddtree-15", "ddtree-a63"], argv=[], concurrency=[1],
        input_len=None, repeats=1, ddtree_schedules=[], ddtree_profile=None,
        ddtree_acceptance=None, step_log=None, title="t", target=tmp_path,
    )  # fmt: skip
    bench.drive(args)
    assert [name for name, _ in launched] == ["dflash", "ddtree-15", "ddtree-a63"]
    assert launched[2][1] == ["ddtree-15.ready", "dflash.ready"]
    assert launched[0][1] == launched[1][1] == []


def test_a_cut_off_run_is_read_back_from_its_engine_logs(tmp_path):
    """`benchmarks/bench_partial.py`: the result lines of each engine log, the step periods
    of their windows, the chain's ratio; a log without result lines adds nothing."""
    import subprocess
    import sys

    def line(engine, tps, window):
        point = {"concurrency": 4, "temperature": 0.0, "requests": 16, "prompts": 16}
        row = {"engine": engine, **point, "tokens_per_s": tps, "tau": 2.0, "window": window}
        return json.dumps({**row, "max_tokens": 8})

    (tmp_path / "ddtree-15.log").write_text(
        "\n".join(
            [
                "INFO noise",
                'WARNING ddtree-steps {"t":[10.0,10.004,10.01],"k":"vm"}',
                line("ddtree-15", 150.0, [9.0, 11.0]),
            ]
        )
        + "\n"  # fmt: skip
    )
    (tmp_path / "dflash.log").write_text(line("dflash", 100.0, [20.0, 21.0]) + "\n")
    (tmp_path / "ddtree-a255.log").write_text("started, no measurement yet\n")
    runs, engines = report.rows_from_logs(tmp_path)
    assert engines == ["dflash", "ddtree-15"]
    assert [r["engine"] for r in runs] == ["ddtree-15", "dflash"]
    assert runs[0]["step_periods"] == {
        "verify": {"steps": 1, "ms": 4.0},
        "mixed": {"steps": 1, "ms": 6.0},
    }
    assert "window" not in runs[1] and "step_periods" not in runs[1]
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_partial.py"
    rows_file = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--rows", str(rows_file), "--plot",
         str(tmp_path / "bench.png")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| ddtree-15 | 150 (2.00) x1.50 |" in done.stdout
    assert len(rows_file.read_text().splitlines()) == 2
    assert (tmp_path / "bench.png").stat().st_size > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    failed = subprocess.run([sys.executable, str(script), str(empty)], capture_output=True)
    assert failed.returncode == 1


def test_every_gpu_script_mode_named_has_its_branch():
    """Each mode that `benchmarks/h200.sh` names (its header's examples, its usage line) and
    the README's GPU commands have a `mode)` branch: a lost branch only shows on a GPU."""
    import re

    root = Path(__file__).resolve().parents[1]
    script = (root / "benchmarks" / "h200.sh").read_text()
    branches = set(re.findall(r"^([a-z0-9]+)\)", script, re.M))
    named = set(re.findall(r"h200\.sh ([a-z0-9|]+)", script + (root / "README.md").read_text()))
    usage = re.search(r'usage: bash benchmarks/h200\.sh ([^"]+)"', script).group(1)
    modes = {m.split()[0] for part in [*named, usage] for m in part.split("|")}
    assert modes - branches == set()
    assert {"bench27b", "bench8b", "accuracy", "check", "treetime", "detach", "collect"} <= modes


def test_candidate_kernel_patches_apply_to_this_tree():
    """`h200.sh treetime` A/Bs `benchmarks/patches/*.patch` against HEAD: one that no longer
    applies would fail only on a GPU, after the kit's device time was spent."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    patches = sorted((root / "benchmarks" / "patches").glob("*.patch"))
    for patch in patches:
        done = subprocess.run(
            ["git", "-C", str(root), "apply", "--check", str(patch)], capture_output=True, text=True
        )
        assert done.returncode == 0, f"{patch.name}: {done.stderr}"
