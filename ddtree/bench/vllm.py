"""``ddtree bench``: no-spec vs vLLM's DFlash chain vs DDTree inside vLLM (offline engines).

Every engine is its own process. They start side by side (model load, compilation and CUDA
graph capture in parallel), wait until all are ready, then measure one at a time under a file
lock, so no measurement shares the device with another engine's work. Per engine and per
(concurrency, temperature): output tokens/s, mean acceptance length (tau = 1 + accepted /
drafts, from vLLM's own spec-decode counters), accepted tokens per depth and the time per step.

Writes ``OUT/<engine>.json`` (+ ``.log``), ``OUT/bench.json`` (all rows) and ``OUT/bench.png``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ddtree.vllm_plugin import plugin_env

# Qwen3-8B's shapes, and a DFlash drafter of z-lab's Qwen3-8B-DFlash-b16 shapes (5 layers).
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=151643,
    eos_token_id=151645, attention_bias=False, attention_dropout=0.0,
)  # fmt: skip
DFLASH_8B = dict(
    QWEN3_8B, architectures=["DFlashDraftModel"], num_hidden_layers=5, block_size=16,
    num_target_layers=36, dflash_config={"mask_token_id": 151669,
                                         "target_layer_ids": [1, 9, 17, 25, 33]},
)  # fmt: skip


def write_dummy_shapes(out: Path) -> tuple[Path, Path]:
    """config.json-only checkpoints (vLLM's ``load_format="dummy"`` fills random weights)."""
    target, drafter = out / "qwen3_8b_shapes", out / "dflash_8b_shapes"
    for path, config in ((target, QWEN3_8B), (drafter, DFLASH_8B)):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return target, drafter


def engine_names(methods: list[str], budgets: list[int]) -> list[str]:
    names = [m for m in methods if m != "ddtree"]
    if "ddtree" in methods:
        names += [f"ddtree-{b}" for b in budgets]
    return names


# vLLM's DFlash chain under other engine settings: (V1 runner, cudagraph_mode, async_scheduling);
# None = vLLM's choice. "dflash" is what users get (V2 runner, FULL_AND_PIECEWISE, async on);
# "dflash-v1-sync" is DDTree's own settings; the others split the gap between the two.
CHAIN_SETTINGS = {
    "dflash": (False, None, None),
    "dflash-v1": (True, "PIECEWISE", None),  # async scheduling as vLLM decides: on
    "dflash-v1-sync": (True, "PIECEWISE", False),
    "dflash-v1-full": (True, None, False),  # V1 with vLLM's default graphs (FULL_AND_PIECEWISE)
    "dflash-v1-full-async": (True, None, None),
    "dflash-v2-sync": (False, None, False),
}
METHODS = ("ar", *CHAIN_SETTINGS, "ddtree")


def engine_kwargs(name: str, args) -> dict:
    """``vllm.LLM`` arguments of one engine: ``ar``, a DFlash chain (``CHAIN_SETTINGS``) or
    ``ddtree-<budget>``."""
    import torch

    cuda = torch.cuda.is_available()
    widest = max(args.concurrency) * (1 + max([15, *args.budgets]))
    kw = dict(
        model=str(args.target), dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=max(args.concurrency), seed=0, disable_log_stats=False,
        max_num_batched_tokens=max(8192, widest), skip_tokenizer_init=args.dummy,
        load_format="dummy" if args.dummy else "auto",
    )  # fmt: skip
    if cuda:
        kw.update(kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
                  gpu_memory_utilization=0.05)  # fmt: skip
    else:
        kw.update(enforce_eager=True, gpu_memory_utilization=0.1)
    if name == "ar":
        return kw
    if name in CHAIN_SETTINGS:
        spec = {"method": "dflash", "model": str(args.draft), "num_speculative_tokens": 15}
        v1, cudagraph_mode, async_scheduling = CHAIN_SETTINGS[name]
        if v1:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # this engine's own process
        if cuda and cudagraph_mode is not None:
            kw["compilation_config"] = {"cudagraph_mode": cudagraph_mode}
        if async_scheduling is not None:
            kw["async_scheduling"] = async_scheduling
    elif name.startswith("ddtree-"):
        spec = {"method": "ddtree", "model": str(args.draft), "ddtree_budget": int(name[7:]),
                **args.ddtree_options}  # fmt: skip
    else:
        raise ValueError(f"unknown engine {name!r}: one of {METHODS[:-1]} or ddtree-<budget>")
    kw["speculative_config"] = spec
    return kw


def _prompts(args, count: int) -> list[list[int]]:
    if args.dummy:
        import torch

        gen = torch.Generator().manual_seed(0)
        return [torch.randint(1000, 100000, (args.input_len,), generator=gen).tolist()
                for _ in range(count)]  # fmt: skip
    from transformers import AutoTokenizer

    from ddtree.bench.tau import held_out_prompts

    return held_out_prompts(AutoTokenizer.from_pretrained(args.target), count, args.input_len)


def _spec_counters(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            found[metric.name] = value if value is not None else list(metric.values)
        elif metric.name == "vllm:iteration_tokens_total":  # one observation per engine step
            found["engine_steps"] = metric.count
    return found


def _delta(after: dict, before: dict, name: str):
    a, b = after.get(name), before.get(name)
    if a is None:
        return None
    if isinstance(a, list):
        b = b or [0] * len(a)
        return [x - y for x, y in zip(a, b, strict=True)]
    return a - (b or 0)


def measure(llm, prompts, concurrency: int, temperature: float, max_tokens: int) -> dict:
    import vllm
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                 seed=None, detokenize=False)  # fmt: skip
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[:concurrency]]
    before = _spec_counters(llm)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _spec_counters(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"concurrency": concurrency, "temperature": temperature, "tokens": tokens,
           "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip
    steps = _delta(after, before, "engine_steps")
    if steps:  # exact, whatever the number of requests running in each step
        row["engine_steps"] = steps
        row["ms_per_engine_step"] = round(1000 * seconds / steps, 3)
    drafts = _delta(after, before, "vllm:spec_decode_num_drafts")
    if drafts:
        accepted = _delta(after, before, "vllm:spec_decode_num_accepted_tokens")
        row["tau"] = round(1 + accepted / drafts, 4)
        row["draft_steps"] = drafts
        row["ms_per_step"] = round(1000 * seconds * concurrency / drafts, 3)
        per_pos = _delta(after, before, "vllm:spec_decode_num_accepted_tokens_per_pos")
        if per_pos:
            row["accepted_per_depth"] = [round(x / drafts, 4) for x in per_pos[:16]]
    else:
        row["tau"] = 1.0
        row["ms_per_step"] = round(1000 * seconds * concurrency / tokens, 3)
    return row


def run_engine(name: str, args) -> None:
    """One engine: start, warm up, wait for the others, measure under the lock."""
    import vllm

    out = args.out
    t0 = time.time()
    llm = vllm.LLM(**engine_kwargs(name, args))
    started = round(time.time() - t0, 1)
    prompts = _prompts(args, max(args.concurrency))
    for temperature in args.temperatures:  # warm-up: first uses compile (Triton) / allocate
        for concurrency in args.concurrency:
            measure(llm, prompts, concurrency, temperature, 8)
    (out / f"{name}.ready").touch()
    while not all((out / f"{n}.ready").exists() or (out / f"{n}.failed").exists()
                  for n in args.engines):  # fmt: skip
        time.sleep(1)
    rows = []
    with open(out / ".device.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for temperature in args.temperatures:
            for concurrency in args.concurrency:
                row = measure(llm, prompts, concurrency, temperature, args.max_tokens)
                rows.append({"engine": name, **row})
                print(json.dumps(rows[-1]), flush=True)
        fcntl.flock(lock, fcntl.LOCK_UN)
    config = llm.llm_engine.vllm_config
    result = {
        "engine": name,
        "engine_start_s": started,
        "v2_model_runner": getattr(config, "use_v2_model_runner", None),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "max_cudagraph_capture_size": config.compilation_config.max_cudagraph_capture_size,
        "rows": rows,
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    llm.llm_engine.engine_core.shutdown()


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(3, len(temps), figsize=(6 * len(temps), 12), squeeze=False)
    for col, temperature in enumerate(temps):
        sub = [r for r in rows if r["temperature"] == temperature]
        for concurrency in sorted({r["concurrency"] for r in sub}):
            at = [r for r in sub if r["concurrency"] == concurrency]
            tree = sorted(
                (int(r["engine"][7:]), r) for r in at if r["engine"].startswith("ddtree-")
            )
            line = axes[0, col].plot([b for b, _ in tree], [r["tokens_per_s"] for _, r in tree],
                                     "o-", label=f"DDTree, c={concurrency}")[0]  # fmt: skip
            axes[1, col].plot([b for b, _ in tree], [r["tau"] for _, r in tree], "o-",
                              color=line.get_color(), label=f"DDTree, c={concurrency}")  # fmt: skip
            axes[2, col].plot([b for b, _ in tree], [r["ms_per_step"] for _, r in tree], "o-",
                              color=line.get_color(), label=f"DDTree, c={concurrency}")  # fmt: skip
            styles = {"dflash": "--", "dflash-v1": "-.", "dflash-v1-sync": (0, (3, 1, 1, 1, 1, 1)),
                      "dflash-v1-full": (0, (5, 1)), "dflash-v1-full-async": (0, (1, 3)),
                      "dflash-v2-sync": (0, (8, 2, 2, 2)), "ar": ":"}  # fmt: skip
            for r, style in ((r, styles[r["engine"]]) for r in at if r["engine"] in styles):
                axes[0, col].axhline(r["tokens_per_s"], ls=style, color=line.get_color(),
                                     label=f"{r['engine']}, c={concurrency}")  # fmt: skip
                if r["engine"] == "dflash":
                    axes[1, col].axhline(r["tau"], ls=style, color=line.get_color())
                axes[2, col].axhline(r["ms_per_step"], ls=style, color=line.get_color())
        labels = ((0, "output tokens/s"), (1, "tau (mean acceptance length)"),
                  (2, "ms per step (verify + draft)"))  # fmt: skip
        has_tree = any(r["engine"].startswith("ddtree-") for r in sub)  # log axes need points
        for row, label in labels:
            ax = axes[row, col]
            if has_tree:
                ax.set_xscale("log", base=2)
            ax.set_xlabel("DDTree budget B (tree nodes)")
            ax.set_ylabel(label)
            ax.set_title(f"{title}, T={temperature}")
            ax.grid(alpha=0.3)
        if has_tree:
            axes[0, col].set_yscale("log")
            axes[2, col].set_yscale("log")
        axes[0, col].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def drive(args) -> list[dict]:
    from tqdm import tqdm

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.ready"), *out.glob("*.failed")]:
        stale.unlink()
    procs, env = {}, plugin_env()
    for name in args.engines:
        log = (out / f"{name}.log").open("w")
        cmd = [sys.executable, "-m", "ddtree.cli", "bench", *args.argv, "--engine", name]
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        time.sleep(2)
    pending = dict(procs)
    with tqdm(total=len(procs), desc="engines done") as bar:
        while pending:
            for name, proc in list(pending.items()):
                if proc.poll() is not None:
                    if proc.returncode != 0:
                        (out / f"{name}.failed").touch()
                        tqdm.write(f"{name}: exit {proc.returncode}, see {out / name}.log")
                    del pending[name]
                    bar.update(1)
            time.sleep(1)
    rows, engines = [], {}
    for name in args.engines:
        path = out / f"{name}.json"
        if path.exists():
            engines[name] = json.loads(path.read_text())
            rows += engines[name]["rows"]
    summary = {"command": " ".join(["ddtree", "bench", *args.argv]),
               "exit_codes": {n: p.returncode for n, p in procs.items()},
               "engines": {n: {k: v for k, v in e.items() if k != "rows"}
                           for n, e in engines.items()},
               "rows": rows}  # fmt: skip
    (out / "bench.json").write_text(json.dumps(summary, indent=1) + "\n")
    if rows:
        plot(rows, out / "bench.png", args.title or Path(args.target).name)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, default=None, help="default: models/target")
    parser.add_argument("--draft", type=Path, default=None, help="default: models/drafter")
    parser.add_argument("--dummy-shapes", choices=["qwen3-8b"], default=None,
                        help="random weights of these shapes (target + drafter)")  # fmt: skip
    parser.add_argument("--methods", default="ar,dflash,ddtree",
                        help=f"comma-separated: {', '.join(METHODS)}")  # fmt: skip
    parser.add_argument("--budgets", default="16,32,64,128,255,511,1023")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="per engine (GPU)")
    parser.add_argument(
        "--ddtree-options",
        type=json.loads,
        default={},
        help="more ddtree keys as JSON, e.g. '{\"ddtree_max_verify_cost\": null}'",
    )
    parser.add_argument("--title", default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # one worker


def run(args: argparse.Namespace, argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    args.dummy = args.dummy_shapes is not None
    if args.dummy:
        args.target, args.draft = write_dummy_shapes(args.out / "models")
    else:
        args.target = args.target or root / "models" / "target"
        args.draft = args.draft or root / "models" / "drafter"
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.temperatures = [float(t) for t in args.temperatures.split(",") if t]
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        if method not in METHODS:
            raise SystemExit(
                f"ddtree bench: unknown method {method!r} in --methods (one of {METHODS})"
            )
    if not isinstance(args.ddtree_options, dict):
        raise SystemExit("ddtree bench: --ddtree-options must be a JSON object")
    args.engines = engine_names(methods, args.budgets)
    args.argv = list(argv)
    if args.engine is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        try:
            run_engine(args.engine, args)
        except BaseException:
            (args.out / f"{args.engine}.failed").touch()
            raise
        return 0
    rows = drive(args)
    return 0 if rows and len({r["engine"] for r in rows}) == len(args.engines) else 1
