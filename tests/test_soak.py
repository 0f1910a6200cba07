"""`ddtree soak`, the CI version: 30 s of 4 mixed clients against the session's DDTree server,
every greedy answer compared with the no-spec server; no errors, no mismatches, KV freed."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from ddtree.bench.soak import root_cause, soak  # noqa: E402

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def test_soak_30_seconds(servers, tmp_path):
    server, reference = servers
    args = SimpleNamespace(
        duration=30, clients=4, max_tokens=32, max_requests=None, seed=0, out=tmp_path
    )
    code = soak(args, server, reference)
    logs = "".join(root_cause(Path(s.log.name).read_text(errors="replace")) for s in servers)
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, (summary["errors"][:5], summary["greedy_mismatches"][:2], logs)
    assert summary["requests"] >= 4
    assert summary["dropped_streams"] >= 1  # clients that hung up mid-stream: aborts mid-step
    assert summary["errors"] == []
    assert summary["greedy_compared"] >= 1 and summary["greedy_mismatches"] == []
    assert summary["after"]["running"] == 0
    assert summary["after"]["kv_usage"] == summary["start"]["kv_usage"] == 0
    assert (tmp_path / "soak.png").exists()
