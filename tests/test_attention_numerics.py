"""benchmarks/attention_numerics.py (run by `h200.sh check`: a crash there costs GPU time) on
the CPU under Triton's interpreter: its tree rows in float32, one and four context shares."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def test_cpu_run_writes_every_tree_row(tmp_path):
    pytest.importorskip("triton")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "attention_numerics.py"
    out = tmp_path / "numerics.json"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--contexts", "40,100", "--budget",
         "20", "--seeds", "1", "--out", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    errors = json.loads(out.read_text())["errors"]
    assert set(errors) == {"tree_chain", "tree_20", "tree_20_4shares"}
    assert all(0 < mean < 1e-5 and peak < 1e-4 for mean, peak in errors.values()), errors
