"""The GPU equality driver's host logic (benchmarks/vllm_gpu_equality.py): the order engines
start in while the hybrid pair trains, and the summary of a run cut off part-way."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location(
        "vllm_gpu_equality", ROOT / "benchmarks" / "vllm_gpu_equality.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(outputs: list[list[int]]) -> dict:
    return {
        "outputs": [[o] for o in outputs], "top2_margins": None, "logprobs": [None] * len(outputs),
        "cudagraph_mode": "FULL", "v2_model_runner": True, "generate_s": 1.0,
        "spec_metrics": {
            "vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_accepted_tokens": 8,
        },
    }  # fmt: skip


def test_summarize_compares_the_cases_that_finished(driver, tmp_path):
    """A run cut off by its timeout: the cases with a json are compared (one equal, one parting
    at token 2), a case whose no-spec run never finished reads ``equal: None``."""
    (tmp_path / "pair_nospec.json").write_text(json.dumps(_result([[1, 2, 3], [4, 5, 6]])))
    (tmp_path / "pair_dflash.json").write_text(json.dumps(_result([[1, 2, 3], [4, 5, 6]])))
    (tmp_path / "pair_ddtree_64.json").write_text(json.dumps(_result([[1, 2, 3], [4, 5, 7]])))
    (tmp_path / "hybrid_dflash.json").write_text(json.dumps(_result([[1, 2]])))
    cases = ["pair_nospec", "pair_dflash", "pair_ddtree_64", "hybrid_nospec", "hybrid_dflash"]
    summary = driver.summarize(tmp_path, cases, {})
    rows = {r["case"]: r for r in summary["rows"]}
    assert rows["pair_dflash"]["equal"] is True and rows["pair_dflash"]["tau"] == 3.0
    assert rows["pair_ddtree_64"]["equal"] is False
    assert rows["pair_ddtree_64"]["first_divergence"] == [None, 2]
    assert rows["hybrid_dflash"]["equal"] is None and rows["hybrid_dflash"]["exit_code"] is None
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == summary["rows"]


def test_hybrid_cases_start_after_their_pair_while_others_go_first(driver, tmp_path, monkeypatch):
    """The hybrid pair trains in a thread: the other cases' engines start meanwhile, the hybrid
    cases only once it is saved; an error in training reaches the driver."""
    trained = threading.Event()
    release = threading.Event()
    launched: list[tuple[str, bool]] = []

    def train(out):
        release.wait(5)
        trained.set()

    class Proc:
        returncode = 0

        def __init__(self, cmd, **kwargs):
            name = cmd[cmd.index("--case") + 1]
            launched.append((name, trained.is_set()))
            if len(launched) == 2:
                release.set()  # training ends only after two other engines started

        def poll(self):
            return 0

        def wait(self):
            return 0

    monkeypatch.setattr(driver, "make_random_pair", lambda out: None)
    monkeypatch.setattr(driver, "make_hybrid_pair", train)
    monkeypatch.setattr(driver.subprocess, "Popen", Proc)
    monkeypatch.setattr(driver.time, "sleep", lambda s: None)
    cases = ["hybrid_nospec", "pair_nospec", "hybrid_dflash", "pair_dflash", "pair_ddtree_64"]
    driver.drive(tmp_path, None, "bfloat16", cases, jobs=4)
    assert [n for n, _ in launched] == [
        "pair_nospec", "pair_dflash", "pair_ddtree_64", "hybrid_nospec", "hybrid_dflash"
    ]  # fmt: skip
    assert [ok for n, ok in launched if n.startswith("hybrid_")] == [True, True]
    assert not launched[0][1]  # the first engine did not wait for the training

    def broken(out):
        raise RuntimeError("no disk")

    monkeypatch.setattr(driver, "make_hybrid_pair", broken)
    with pytest.raises(RuntimeError, match="no disk"):
        driver.drive(tmp_path, None, "bfloat16", ["pair_nospec", "hybrid_nospec"], jobs=4)
