import os

import pytest
import torch
from hypothesis import settings


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# CI runs a fixed, derandomized set of examples so that a red run is reproducible.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    """One DDTree server (B=64) and one no-spec server for the session: ``ddtree serve`` on
    the bundled pair, vLLM's OpenAI server in its own processes, as users run it. The KV cache
    is given in bytes: on the CPU ``--gpu-memory-utilization F`` is F x total RAM for the whole
    worker, and the cache gets what the worker's RSS leaves (too little right after a fresh
    install, when the new shared libraries are mapped in large folios)."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    import argparse

    from ddtree.bench import soak

    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    out = tmp_path_factory.mktemp("servers")
    args = parser.parse_args(
        ["--budget", "64", "--max-num-seqs", "4", "--compare", "--out", str(out)]
    )
    # A tool parser, so that tool calls (named / required tool_choice) can be served.
    args.vllm_args = ["--kv-cache-memory-bytes", "256M", "--enforce-eager"]
    args.vllm_args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    server, reference = soak.start_servers(args)
    try:
        yield server, reference
    finally:
        server.stop()
        reference.stop()
