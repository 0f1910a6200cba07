"""`ddtree soak --attention-backend`: only the server under test changes its attention kernel,
so the no-spec reference stays what the mismatch rate is measured against."""

import argparse
from pathlib import Path

from ddtree.bench.soak import add_arguments, server_command


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*argv, "--out", str(Path("/tmp/unused"))])
    args.vllm_args = ["--kv-cache-memory-bytes", "2G"]
    return args


def test_attention_backend_reaches_the_server_under_test_only():
    args = _args("--budget", "0", "--compare", "--attention-backend", "TRITON_ATTN")
    tested = server_command(0, args, 8001, "ddtree", under_test=True)
    reference = server_command(0, args, 8002, "ddtree", under_test=False)
    assert tested[tested.index("--attention-backend") + 1] == "TRITON_ATTN"
    assert "--attention-backend" not in reference
    # vLLM's arguments follow "--", after ddtree serve's own
    assert tested.index("--") < tested.index("--kv-cache-memory-bytes") < len(tested)
    assert tested.index("--") < tested.index("--attention-backend")
    assert reference[reference.index("--budget") + 1] == "0"


def test_no_attention_backend_by_default():
    args = _args("--budget", "64")
    assert "--attention-backend" not in server_command(64, args, 8001, "ddtree", under_test=True)


def test_budget_per_batch_size_reaches_the_ddtree_server_only():
    args = _args("--budget", "64", "--compare", "--budget-per-batch-size", "fixed")
    tested = server_command(64, args, 8001, "ddtree", under_test=True)
    assert tested[tested.index("--budget-per-batch-size") + 1] == "fixed"
    assert "--budget-per-batch-size" not in server_command(0, args, 8002, "ddtree", False)
    args = _args("--budget-per-batch-size", "[[1, 4, 63], [5, 32, 15]]")
    tested = server_command(64, args, 8001, "ddtree", under_test=True)
    assert tested[tested.index("--budget-per-batch-size") + 1] == "[[1, 4, 63], [5, 32, 15]]"
