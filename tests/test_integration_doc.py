"""docs/integration.md names every vLLM symbol the plugin replaces (the V2 runner's patches,
applied on CUDA only, are applied here in a fresh interpreter to list them)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter

DOC = Path(__file__).resolve().parent.parent / "docs" / "integration.md"


def test_every_patched_symbol_is_documented():
    pytest.importorskip("vllm")
    code = (
        "from ddtree.vllm_plugin import hooks, patches\n"
        "patches.register()\n"
        "patches._patch_v2_runner()\n"
        "patches._patch_v2_gdn()\n"
        "print('PATCHED ' + ' '.join(hooks.PATCHED))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("PATCHED "))
    patched = line.split()[1:]
    assert len(patched) >= 21, patched  # 12 common + V1 + CPU attention, 9 V2
    text = DOC.read_text()
    missing = [p for p in patched if ".".join(p.split(".")[-2:]) not in text]
    assert not missing, missing
    for impl in ("FlashAttentionImpl.forward", "TritonAttentionImpl.forward"):
        assert impl in text  # patched on CUDA only
