"""DDTree as vLLM 0.26's speculative method "ddtree" (V1 model runner; CPU and CUDA).

``patches.register`` is the ``vllm.general_plugins`` entry point and lists every patched
symbol; ``config`` the options and settings; ``state`` an engine's state; ``v1/`` the step on
the V1 model runner, one file per stage; ``attention/`` the tree-masked attention and KV moves
per backend; ``graphs`` DDTree's own CUDA graphs. Map: docs/integration.md.
"""

from __future__ import annotations

import os
from pathlib import Path


def plugin_env() -> dict:
    """The workers' environment: vLLM must find ddtree's plugin entry point. When ddtree runs
    from a source tree (PYTHONPATH, not pip-installed) its metadata is written to a temp dir."""
    import tempfile
    from importlib.metadata import entry_points

    env = dict(os.environ)
    if any(ep.name == "ddtree" for ep in entry_points(group="vllm.general_plugins")):
        return env
    site = Path(tempfile.mkdtemp(prefix="ddtree-site-"))
    info = site / "ddtree-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ddtree\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nddtree = ddtree.vllm_plugin.patches:register\n"
    )
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), str(root), env.get("PYTHONPATH")) if p
    )
    return env
