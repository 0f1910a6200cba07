"""Benchmark: DDTree build + walk on the device vs the paper's heap (ddtree.reference).

Times, per (batch, budget, vocab) at depth 15: build_tree + walk (eager; on CUDA also replayed
from one captured CUDA graph, the capture run under torch's sync-debug "error" mode so that any
host sync fails), the vocabulary stage alone (top-k + logsumexp), and the reference heap in
plain Python (batch 1 only; it is per request). ``--impl fused`` (or ``both``) times the Triton
kernels of ddtree.kernels the same way (CUDA only), each stage also on its own, and checks that
the fused tree equals the torch tree stage on the same ranked log-probs. Writes JSON with the
command and machine.

    python benchmarks/tree.py --device cuda --out benchmarks/results/tree_h200.json
    python benchmarks/tree.py --impl both --vocabs 151936 --out /tmp/tree_fused_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import ddtree
from ddtree.reference import build_tree_reference, walk_reference
from ddtree.tree import draft_topk

DEPTH = 15


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of ``fn()``, synchronising around each call on CUDA."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_time(step, repeats: int) -> float:
    """Median seconds of one replay of a CUDA graph holding ``step()``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # a host sync inside the step raises here
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Replay many times between two events so that per-replay launch gaps are included.
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e4)
    del graph
    return statistics.median(times)


def kernel_split(fn, repeats: int) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel ``fn()`` launches (torch.profiler over
    eager calls: the same kernels as the graph replays, without the graph's launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return {e.key[:60]: round(e.self_device_time_total / repeats, 2) for e in kernels}


def fused_row(logits, target, budget: int, repeats: int) -> dict:
    """Times of the ddtree.kernels path (preallocated buffers, as an engine would hold them)."""
    from ddtree import kernels
    from ddtree.tree import tree_from_ranked

    batch, depth, vocab = logits.shape
    # As the V2 engine holds them: ancestors and packed bits, no bool [b, 1+B, 1+B] mask.
    buffers = kernels.tree_buffers(batch, depth, vocab, budget, logits.device, with_mask=False)
    masked = kernels.tree_buffers(batch, depth, vocab, budget, logits.device)
    acc = kernels.acceptance_buffers(batch, depth, budget + 1, logits.device)
    ranked = (buffers.logprobs, buffers.token_ids)

    def build_walk():
        tree = kernels.build_tree_fused(logits, budget, chain_seed=True, buffers=buffers)
        return kernels.walk_fused(tree, target, out=acc)

    def vocab_stage():
        kernels.draft_topk_fused(logits, min(budget, vocab), out=ranked, workspace=buffers.vocab)

    def tree_stage():
        kernels.tree_from_ranked_fused(*ranked, budget, chain_seed=True, buffers=buffers)

    def build_walk_masked():
        tree = kernels.build_tree_fused(logits, budget, chain_seed=True, buffers=masked)
        return kernels.walk_fused(tree, target, out=acc)

    row = {
        "fused_build_walk_graph_ms": 1e3 * graph_time(build_walk, repeats),
        "fused_build_walk_with_mask_graph_ms": 1e3 * graph_time(build_walk_masked, repeats),
        "fused_build_walk_eager_ms": 1e3 * timed(build_walk, "cuda", repeats),
        "fused_vocab_stage_graph_ms": 1e3 * graph_time(vocab_stage, repeats),
        "fused_tree_stage_graph_ms": 1e3 * graph_time(tree_stage, repeats),
        "fused_walk_graph_ms": 1e3
        * graph_time(lambda: kernels.walk_fused(buffers.tree, target, out=acc), repeats),
    }
    # With programmatic dependent launch a kernel starts early and waits for its predecessor,
    # and the profiler counts the wait: the split is taken with it off.
    from ddtree.kernels import _common

    pdl_setting, _common.PDL_SETTING = _common.PDL_SETTING, False
    try:
        row["fused_kernels_us"] = kernel_split(build_walk, repeats)  # PDL off
    finally:
        _common.PDL_SETTING = pdl_setting
    build_walk()
    build_walk_masked()
    ref = tree_from_ranked(*ranked, budget, chain_seed=True)
    fields = ("tokens", "parents", "depths", "scores", "ancestors", "num_nodes")
    row["fused_equals_torch_tree"] = (
        all(torch.equal(getattr(buffers.tree, f), getattr(ref, f)) for f in fields)
        and torch.equal(buffers.tree.ancestor_bits, kernels.pack_ancestor_bits(ref.mask))
        and torch.equal(masked.tree.mask, ref.mask)
    )
    return row


def reference_time(logits_row: torch.Tensor, budget: int) -> float:
    logits_row = logits_row.cpu()
    t0 = time.perf_counter()
    tree = build_tree_reference(logits_row, budget, chain_seed=True)
    walk_reference(tree.tokens, tree.parents, [0] * len(tree.tokens))
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    parser.add_argument("--vocabs", default="151936,248320")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per point")
    parser.add_argument("--no-reference", action="store_true", help="skip the Python heap")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument(
        "--impl", choices=("torch", "fused", "both"), default="torch", help="which tree step"
    )
    parser.add_argument("--tree-warps", type=int, help="override the fused tree kernel's warps")
    parser.add_argument(
        "--select-warps", type=int, help="override the vocabulary stage's top-k kernel's warps"
    )
    args = parser.parse_args()
    if args.tree_warps:
        from ddtree.kernels import build

        build.tree_num_warps = lambda budget: args.tree_warps
    if args.select_warps:
        from ddtree.kernels import vocab_topk

        vocab_topk.select_num_warps = lambda cap: args.select_warps
    device = args.device
    if args.impl != "torch" and device != "cuda":
        parser.error("--impl fused/both needs --device cuda (the Triton kernels)")
    repeats = args.repeats or (50 if device == "cuda" else 3)
    budgets = [int(x) for x in args.budgets.split(",")]
    vocabs = [int(x) for x in args.vocabs.split(",")]
    batches = [int(x) for x in args.batches.split(",")]

    rows = []
    grid = [(v, b, n) for v in vocabs for b in batches for n in budgets]
    gen = torch.Generator(device=device).manual_seed(0)
    for vocab, batch, budget in tqdm(grid, desc=f"tree bench ({device})"):
        # bf16 logits like a real drafter's, scaled so that the top tokens are well spread.
        logits = (torch.randn(batch, DEPTH, vocab, device=device, generator=gen) * 4).bfloat16()
        target = torch.randint(0, vocab, (batch, 1 + budget), device=device, generator=gen)

        def build_walk(logits=logits, target=target, budget=budget):
            tree = ddtree.build_tree(logits, budget, chain_seed=True, check_values=False)
            return ddtree.walk(tree, target)

        row = {"vocab": vocab, "batch": batch, "budget": budget, "depth": DEPTH}
        if args.impl in ("torch", "both"):
            row["build_walk_eager_ms"] = 1e3 * timed(build_walk, device, repeats)
            k = min(budget, vocab)
            row["vocab_stage_eager_ms"] = 1e3 * timed(
                lambda lg=logits, k=k: draft_topk(lg, k), device, repeats
            )
            if device == "cuda":
                row["build_walk_graph_ms"] = 1e3 * graph_time(build_walk, repeats)
                row["host_syncs_in_step"] = 0  # capture ran under sync-debug "error" mode
        if args.impl in ("fused", "both"):
            row.update(fused_row(logits, target, budget, repeats))
            row["host_syncs_in_step"] = 0
        if batch == 1 and not args.no_reference:
            row["reference_ms"] = 1e3 * reference_time(logits[0], budget)
        rows.append(row)
        tqdm.write(json.dumps(row))

    info = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "depth": DEPTH,
        "logits_dtype": "bfloat16",
        "impl": args.impl,
        "tree_warps": args.tree_warps,
        "select_warps": args.select_warps,
        "pdl": device == "cuda" and pdl_on(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=1) + "\n")
    print(table(rows))


def pdl_on() -> bool:
    """Whether the fused kernels launch with programmatic dependent launch here."""
    from ddtree.kernels._common import pdl

    return pdl(torch.device("cuda", torch.cuda.current_device()))


def table(rows: list[dict]) -> str:
    """A markdown table of the results."""
    cols = [
        c
        for c in (
            "build_walk_graph_ms",
            "build_walk_eager_ms",
            "vocab_stage_eager_ms",
            "fused_build_walk_graph_ms",
            "fused_build_walk_with_mask_graph_ms",
            "fused_build_walk_eager_ms",
            "fused_vocab_stage_graph_ms",
            "fused_tree_stage_graph_ms",
            "fused_walk_graph_ms",
            "reference_ms",
        )
        if any(c in r for r in rows)
    ]
    lines = ["| V | batch | B | " + " | ".join(cols) + " |", "|---" * (3 + len(cols)) + "|"]
    for r in rows:
        cells = [f"{r[c]:.3f}" if c in r else "" for c in cols]
        lines.append(f"| {r['vocab']} | {r['batch']} | {r['budget']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
