"""The paged tree attention kernel (the V2 verify graphs') timed per launch shape, at Qwen3-8B
attention shapes: which rows per program, key block, warps, pipeline stages and context
splits (the cached context in shares, merged by log-sum-exp) to use.

Each (requests R, budget B, cached context C) case is one verify step's attention of one layer:
R trees of 1 + B slots (D = 15) over a paged bf16 cache in random block order, the forced chain's
16 rows left to the backend (``first_slot`` 16, as the engine calls it). Every launch shape is
timed from one CUDA graph of 20 launches (CUDA events, median of 5 replays: no host launch
cost), and its output compared with the default shape's (the engine's, tested against the
reference in tests/test_paged_tree_kernel.py). Writes JSON rows and a table: per case the
default's time, the fastest shape's, and the one shape that is fastest over all cases; a plot
of each (R, B) against the context beside FlashAttention (``--replot``: from the JSON alone).

    python benchmarks/paged_tree_time.py --out /tmp/paged_tree_time.json     # CUDA
    TRITON_INTERPRET=1 python benchmarks/paged_tree_time.py --smoke --out X  # the script's own
                                                                              # check, any machine
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import ddtree
from ddtree.vllm_plugin.attention.paged_tree_kernel import (
    paged_tree_attention,
    shares_for_grid,
    split_scratch,
)
from ddtree.vllm_plugin.v2.engine import AUTO_MAX_SHARES

# the engine's launch shape: paged_tree_attention's own defaults
DEFAULT = {
    name: inspect.signature(paged_tree_attention).parameters[name].default
    for name in ("rows_per_program", "block_n", "num_warps", "num_stages", "context_splits")
}
CHAIN_SLOTS = 16  # the root and a forced chain of D = 15: the backend's rows
MIXED_QUERY_LEN = 2048  # a mixed step's longest query (a prefill chunk): the grid it launches


def engine_config(case: dict, num_sms: int) -> dict:
    """The launch shape the engine uses for this case: the defaults, with the context shares
    ``DDTREE_CONTEXT_SPLITS=auto`` picks for its grid."""
    _, heads, _ = case["query"].shape
    kv_heads = case["kv_cache"].shape[1]
    reqs = case["tree_rows"].shape[0]
    shares = shares_for_grid(
        reqs, case["max_query_len"], CHAIN_SLOTS, kv_heads, heads // kv_heads, num_sms,
        AUTO_MAX_SHARES,
    )  # fmt: skip
    return {**DEFAULT, "context_splits": shares}


def make_case(reqs: int, budget: int, context: int, shape: dict, device: str) -> dict:
    """The kernel's inputs for ``reqs`` trees of ``budget`` nodes over ``context`` tokens."""
    gen = torch.Generator().manual_seed(reqs * 7919 + budget * 31 + context)
    heads, kv_heads, head, block = shape["heads"], shape["kv_heads"], shape["head"], shape["block"]
    slots = budget + 1
    trees = ddtree.build_tree(torch.randn(reqs, 15, shape["vocab"], generator=gen) * 2, budget)
    per_req = -(-(context + slots) // block)
    num_blocks = reqs * per_req
    memory = torch.randn(num_blocks, block, kv_heads, 2 * head, generator=gen) * 0.5
    cu = torch.arange(reqs + 1, dtype=torch.int32) * slots
    inputs = {
        "query": torch.randn(reqs * slots, heads, head, generator=gen),
        "kv_cache": memory.permute(0, 2, 1, 3),  # vLLM's logical view of NHD memory
        "query_start_loc": cu,
        "seq_lens": torch.full((reqs,), context + slots, dtype=torch.int32),
        "block_table": torch.randperm(num_blocks, generator=gen).view(reqs, per_req).int(),
        "tree_rows": torch.arange(reqs, dtype=torch.int32),
        "depths": trees.depths.int().contiguous(),
        "ancestors": trees.ancestors.int().contiguous(),
    }
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = {}
    for name, t in inputs.items():
        t = t.to(dtype) if t.is_floating_point() else t
        out[name] = t.to(device)
    out["output"] = torch.zeros_like(out["query"])
    out["scale"] = head**-0.5
    out["max_query_len"] = slots
    out["partials"] = {}  # context splits -> the shares' scratch
    return out


def launch(case: dict, config: dict) -> None:
    splits = config["context_splits"]
    if splits > 1 and splits not in case["partials"]:  # scratch made once, before a capture
        rows, heads, head = case["query"].shape
        case["partials"][splits] = split_scratch(rows, heads, splits, head, case["query"].device)
    paged_tree_attention(
        case["query"], case["kv_cache"], case["output"], case["query_start_loc"],
        case["seq_lens"], case["block_table"], case["tree_rows"], case["depths"],
        case["ancestors"], case["scale"], case["max_query_len"], first_slot=CHAIN_SLOTS,
        partials=case["partials"].get(splits), **config,
    )  # fmt: skip


def time_us(case: dict, config: dict, device: str) -> float:
    """Microseconds per launch: from a CUDA graph of 20 launches (median of 5 replays), or
    one eager call where there is no GPU (the smoke run: not a timing)."""
    if device != "cuda":
        import time

        start = time.perf_counter()
        launch(case, config)
        return 1e6 * (time.perf_counter() - start)
    return graph_us(lambda: launch(case, config))


def graph_us(fn) -> float:
    """Microseconds per ``fn()`` from a CUDA graph of 20 calls (median of 5 replays)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * begin.elapsed_time(end) / 20)
    return statistics.median(times)


def flash_us(case: dict, rows: int) -> float | None:
    """vLLM's FlashAttention as the backend's causal pass runs it: ``rows`` query rows per
    request over its context and those rows' own keys (16: what the chain's verify pays per
    layer; 1 + B: what DDTree's backend pass pays before the tree kernel). None without vLLM's
    FlashAttention."""
    try:
        from vllm.v1.attention.backends.fa_utils import (
            flash_attn_varlen_func,
            get_flash_attn_version,
        )
    except ImportError:
        return None
    reqs = case["tree_rows"].shape[0]
    slots = case["max_query_len"]
    query = case["query"].view(reqs, slots, *case["query"].shape[1:])[:, :rows].contiguous()
    query = query.flatten(0, 1)
    head = query.shape[-1]
    keys, values = case["kv_cache"].transpose(1, 2).split(head, dim=-1)
    context = case["seq_lens"] - slots  # [R]
    cu = torch.arange(reqs + 1, dtype=torch.int32, device=query.device) * rows
    used = (context + rows).int()
    longest = int(case["seq_lens"].max())  # host values here: none is read inside the capture
    version = get_flash_attn_version()

    def call():
        flash_attn_varlen_func(
            q=query, k=keys, v=values, cu_seqlens_q=cu, max_seqlen_q=rows, seqused_k=used,
            max_seqlen_k=longest, softmax_scale=case["scale"], causal=True,
            block_table=case["block_table"], fa_version=version,
        )  # fmt: skip

    return graph_us(call)


def flash_context_launch(case: dict):
    """``DDTREE_TREE_ATTENTION=flash`` as the engine runs it: one non-causal FlashAttention call
    over every row's cached context (output and log-sum-exp into persistent buffers), then the
    tree kernel over the tree's own slots only. A function that launches both; None without
    vLLM's FlashAttention."""
    from types import SimpleNamespace

    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    except ImportError:
        return None
    from ddtree.vllm_plugin.attention.flash import context_attention

    query = case["query"]
    reqs = case["tree_rows"].shape[0]
    impl = SimpleNamespace(
        head_size=query.shape[-1], scale=case["scale"],
        vllm_flash_attn_version=get_flash_attn_version(),
    )  # fmt: skip
    metadata = SimpleNamespace(
        query_start_loc=case["query_start_loc"], seq_lens=case["seq_lens"],
        block_table=case["block_table"], max_query_len=case["max_query_len"],
        max_seq_len=int(case["seq_lens"].max()),
    )  # fmt: skip
    context = torch.zeros(reqs + 1, dtype=torch.int32, device=query.device)
    out = torch.empty_like(query)

    def call():
        given = context_attention(impl, query, case["kv_cache"], metadata, context, out)
        paged_tree_attention(
            query, case["kv_cache"], case["output"], case["query_start_loc"], case["seq_lens"],
            case["block_table"], case["tree_rows"], case["depths"], case["ancestors"],
            case["scale"], case["max_query_len"], first_slot=CHAIN_SLOTS, **given,
        )  # fmt: skip

    return call


def label(config: dict) -> str:
    return "rpp{rows_per_program}/n{block_n}/w{num_warps}/s{num_stages}/k{context_splits}".format(
        **{k: "d" if v is None else v for k, v in config.items()}
    )


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        shape = {"heads": 4, "kv_heads": 2, "head": 16, "block": 16, "vocab": 64}
        cases = [(2, 23, 20)]
        grid = [
            DEFAULT,
            {**DEFAULT, "rows_per_program": 16, "block_n": 16, "num_warps": 8, "num_stages": 1},
            {**DEFAULT, "context_splits": 2},
        ]
    else:
        shape = {"heads": 32, "kv_heads": 8, "head": 128, "block": 16, "vocab": 4096}
        cases = list(itertools.product(args.requests, args.budgets, args.contexts))
        grid = [DEFAULT] + [
            dict(zip(DEFAULT, values, strict=True))
            for values in itertools.product(
                args.rows_per_program,
                args.block_n,
                args.num_warps,
                args.num_stages,
                args.context_splits,
            )  # fmt: skip
        ]
    rows = []
    for reqs, budget, context in tqdm(cases, desc="cases"):
        case = make_case(reqs, budget, context, shape, device)
        launch(case, DEFAULT)
        want = case["output"].float().clone()
        tree_rows = torch.ones(reqs, budget + 1, dtype=torch.bool)
        tree_rows[:, :CHAIN_SLOTS] = False
        tree_rows = tree_rows.flatten().to(device)
        if device == "cuda":  # the attention the chain pays, and DDTree's backend pass
            for rows_q, name in ((CHAIN_SLOTS, "flash_chain_rows"), (budget + 1, "flash_all_rows")):
                us = flash_us(case, rows_q)
                if us is not None:
                    rows.append(
                        {"requests": reqs, "budget": budget, "context": context,
                         "config": name, "us": round(us, 2)}
                    )  # fmt: skip
        for config in grid:
            case["output"].zero_()
            us = time_us(case, config, device)
            diff = (case["output"].float() - want)[tree_rows].abs().max().item()
            rows.append(
                {
                    "requests": reqs, "budget": budget, "context": context,
                    "config": label(config), **config, "us": round(us, 2),
                    "max_abs_diff_vs_default": diff,
                }
            )  # fmt: skip
        # The engine's own launch (auto shares), and the default launched on a mixed step's
        # grid (the longest query a prefill's): programs past the trees' slots return at once.
        num_sms = (
            torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
        )
        extra = [("engine_auto", engine_config(case, num_sms), case["max_query_len"])]
        extra.append(("mixed_grid", DEFAULT, MIXED_QUERY_LEN))
        for name, config, query_len in extra:
            case["output"].zero_()
            saved, case["max_query_len"] = case["max_query_len"], query_len
            us = time_us(case, config, device)
            case["max_query_len"] = saved
            diff = (case["output"].float() - want)[tree_rows].abs().max().item()
            rows.append(
                {
                    "requests": reqs, "budget": budget, "context": context, "config": name,
                    **config, "us": round(us, 2), "max_abs_diff_vs_default": diff,
                }
            )  # fmt: skip
        # last in the case: a failed capture must not cost the timings above
        flash_context = flash_context_launch(case) if device == "cuda" else None
        if flash_context is not None:  # the flash context's time and its output vs the kernel's
            case["output"].zero_()
            try:
                us = graph_us(flash_context)
            except Exception as error:  # the table shows "-"; the other timings stand
                print(f"flash context, case {reqs}/{budget}/{context}: {error!r}", file=sys.stderr)
            else:
                diff = (case["output"].float() - want)[tree_rows].abs().max().item()
                rows.append(
                    {"requests": reqs, "budget": budget, "context": context,
                     "config": "flash_context", "us": round(us, 2),
                     "max_abs_diff_vs_default": diff}
                )  # fmt: skip
    return {"device": device, "shape": shape, "rows": rows}


def summary(result: dict) -> str:
    """Per case: the default's time, the fastest shape's; then the one shape fastest over all
    cases (geometric mean of its time over the default's), with its time per case."""
    flash = {
        (r["requests"], r["budget"], r["context"], r["config"]): r["us"]
        for r in result["rows"]
        if r["config"].startswith("flash_")
    }
    special = ("engine_auto", "mixed_grid", "flash_context")
    extra = {
        (r["requests"], r["budget"], r["context"], r["config"]): r
        for r in result["rows"]
        if r["config"] in special
    }
    rows = [
        r
        for r in result["rows"]
        if not r["config"].startswith("flash_") and r["config"] not in special
    ]
    cases = sorted({(r["requests"], r["budget"], r["context"]) for r in rows})
    default = label(DEFAULT)
    by = {(r["requests"], r["budget"], r["context"], r["config"]): r for r in rows}
    configs = sorted({r["config"] for r in rows})

    def ratio(config: str) -> float:
        logs = [
            math.log(by[(*c, config)]["us"] / by[(*c, default)]["us"])
            for c in cases
            if (*c, config) in by
        ]
        return math.exp(sum(logs) / len(logs))

    overall = min(configs, key=ratio)
    lines = [
        f"default: {default}; best over all cases: {overall} ({ratio(overall):.3f}x the "
        "default's time, geometric mean)",
        "",
        "FlashAttention (vLLM's, causal, CUDA graph): 16 rows per request = the chain's verify "
        "attention per layer; 1 + B rows = DDTree's backend pass, before the tree kernel.",
        "",
        f"engine: the engine's launch (auto shares: k); mixed grid: the default launched for a "
        f"step whose longest query is {MIXED_QUERY_LEN} (a prefill among the trees); flash "
        "context: DDTREE_TREE_ATTENTION=flash (FlashAttention over the context, then the kernel "
        "over the tree's slots).",
        "",
        "| R | B | C | default us | fastest us | fastest shape | best-overall us | max diff "
        "| FA 16 rows us | FA 1+B rows us | engine us (k) | mixed grid us | flash context us |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        mine = [r for r in rows if (r["requests"], r["budget"], r["context"]) == c]
        fastest = min(mine, key=lambda r: r["us"])
        diff = max(r["max_abs_diff_vs_default"] for r in mine)
        fa = [flash.get((*c, name)) for name in ("flash_chain_rows", "flash_all_rows")]
        fa_cells = " | ".join("-" if us is None else f"{us:.2f}" for us in fa)
        engine, mixed = extra.get((*c, "engine_auto")), extra.get((*c, "mixed_grid"))
        engine_cell = "-" if engine is None else f"{engine['us']:.2f} ({engine['context_splits']})"
        mixed_cell = "-" if mixed is None else f"{mixed['us']:.2f}"
        flash_ctx = extra.get((*c, "flash_context"))
        flash_cell = "-" if flash_ctx is None else f"{flash_ctx['us']:.2f}"
        lines.append(
            f"| {c[0]} | {c[1]} | {c[2]} | {by[(*c, default)]['us']:.2f} | {fastest['us']:.2f} "
            f"| {fastest['config']} | {by[(*c, overall)]['us']:.2f} | {diff:.1e} | {fa_cells} "
            f"| {engine_cell} | {mixed_cell} | {flash_cell} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """One panel per (requests, budget): microseconds per layer against the cached context —
    the default launch, the engine's (auto shares), the fastest shape per case, and vLLM's
    FlashAttention over the chain's 16 rows and over DDTree's 1 + B rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    panels = sorted({(r["requests"], r["budget"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    default = label(DEFAULT)
    lines = [  # (legend, the row that gives the point: a config name or "fastest", style)
        ("tree kernel, default launch", default, "C0", "-"),
        ("tree kernel, engine (auto shares)", "engine_auto", "C2", "-"),
        ("tree kernel, fastest shape", "fastest", "C0", ":"),
        ("flash context + tree kernel", "flash_context", "C4", "-"),
        ("FlashAttention, 16 rows (chain)", "flash_chain_rows", "C1", "--"),
        ("FlashAttention, 1 + B rows", "flash_all_rows", "C3", "--"),
    ]
    for ax, (reqs, budget) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if (r["requests"], r["budget"]) == (reqs, budget)]
        contexts = sorted({r["context"] for r in mine})
        for name, config, color, style in lines:
            ys = []
            for c in contexts:
                here = [r for r in mine if r["context"] == c]
                if config == "fastest":
                    ys.append(min((r["us"] for r in here if "/" in r["config"]), default=None))
                else:
                    ys.append(next((r["us"] for r in here if r["config"] == config), None))
            if any(y is not None for y in ys):
                ax.plot(contexts, ys, style, color=color, marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="cached context (tokens)",
               title=f"{reqs} request(s), B={budget}")  # fmt: skip
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("us per layer (CUDA graph)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"paged tree attention vs FlashAttention, {result.get('machine', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON rows; beside it a .md")
    parser.add_argument("--requests", type=ints, default=[1, 8])
    parser.add_argument("--budgets", type=ints, default=[63, 255])
    parser.add_argument("--contexts", type=ints, default=[128, 1024, 4096])
    parser.add_argument("--rows-per-program", type=ints, default=[16, 64])
    parser.add_argument("--block-n", type=ints, default=[32, 64])
    parser.add_argument("--num-warps", type=ints, default=[4, 8])
    parser.add_argument("--num-stages", type=ints, default=[3])
    parser.add_argument("--context-splits", type=ints, default=[1, 4, 8])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, two launch shapes")
    parser.add_argument(
        "--replot", action="store_true", help="only the table and plot again from --out's JSON"
    )
    args = parser.parse_args()
    if args.replot:
        result = json.loads(args.out.read_text())
    else:
        result = run(args)
        result["command"] = " ".join(["python", *sys.argv])
        result["machine"] = (
            torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    table = summary(result)
    args.out.with_suffix(".md").write_text(table + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(table)
    worst = max(r.get("max_abs_diff_vs_default", 0.0) for r in result["rows"])
    if not worst < (2e-2 if result["device"] == "cuda" else 1e-4):
        print(f"a launch shape's output differs from the default's by {worst}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
