"""`ddtree soak`, the CI version: 45 s of 4 mixed clients against the DDTree server, every
greedy answer compared with a no-spec server; no errors, no mismatches, KV cache freed."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from ddtree.bench.soak import root_cause  # noqa: E402


# The KV cache is given in bytes. On the CPU, `--gpu-memory-utilization F` is F x total RAM for
# the whole worker and the KV cache gets what the worker's RSS leaves: at 0.05 (1.18 GiB of
# 23.5) 0.2 GiB after an RSS of 0.96 GiB, but -0.05 GiB (engine init fails) right after
# `make venv` (fresh-clone CI): the just-written shared libraries (torch, nvidia, triton) are in
# the page cache in large folios, mapped whole on fault, and add ~0.25 GiB of file-backed RSS.
def test_soak_one_minute(tmp_path):
    cmd = [sys.executable, "-m", "ddtree.cli", "soak", "--duration", "45", "--clients", "4",
           "--max-tokens", "32", "--max-num-seqs", "4", "--compare", "--out", str(tmp_path),
           "--", "--kv-cache-memory-bytes", "256M", "--enforce-eager"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    texts = [p.read_text(errors="replace") for p in sorted(tmp_path.glob("server_*.log"))]
    logs = "".join(root_cause(text) + text[-2000:] for text in texts)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["requests"] >= 4
    assert summary["dropped_streams"] >= 1  # clients that hung up mid-stream: aborts mid-step
    assert summary["errors"] == []
    assert summary["greedy_compared"] >= 1 and summary["greedy_mismatches"] == []
    assert summary["after"]["running"] == 0
    assert summary["after"]["kv_usage"] == summary["start"]["kv_usage"] == 0
    assert (tmp_path / "soak.png").exists()
