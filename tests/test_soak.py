"""`ddtree soak`, the CI version: 45 s of 4 mixed clients against the DDTree server, every
greedy answer compared with a no-spec server; no errors, no mismatches, KV cache freed."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")


def test_soak_one_minute(tmp_path):
    cmd = [sys.executable, "-m", "ddtree.cli", "soak", "--duration", "45", "--clients", "4",
           "--max-tokens", "32", "--max-num-seqs", "4", "--compare", "--out", str(tmp_path),
           "--", "--gpu-memory-utilization", "0.05", "--enforce-eager"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("server_*.log"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["requests"] >= 4
    assert summary["errors"] == []
    assert summary["greedy_compared"] >= 1 and summary["greedy_mismatches"] == []
    assert summary["after"]["running"] == 0
    assert summary["after"]["kv_usage"] == summary["start"]["kv_usage"] == 0
    assert (tmp_path / "soak.png").exists()
