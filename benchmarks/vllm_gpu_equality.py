"""Greedy DDTree inside vLLM 0.26 on the GPU vs no-spec vLLM, token for token.

vLLM's defaults (V2 model runner, full CUDA graphs of the verify step, async scheduling,
FLASH_ATTN) unless a case says otherwise, bfloat16. Cases: the bundled pair (held-out prompts)
and a random Qwen3 target with a random DFlash drafter (random token prompts); a mixed batch of
8 requests per case (prompt lengths, max_tokens and stop tokens differ, so prefills share steps
with tree verifies). Every engine is its own process and they run side by side on the one GPU
(each with a fixed 1 GiB KV cache, so no memory profiling races).

    python benchmarks/vllm_gpu_equality.py --out DIR        # all cases, then the comparison
    python benchmarks/vllm_gpu_equality.py --case pair_ddtree_64 --out DIR   # one engine

Writes DIR/<case>.json, DIR/<case>.log and DIR/summary.json. Off the GPU (vLLM's CPU build,
``--dtype float32``, eager engines, the V1 runner) it is a dry run of the cases themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = (1, 15, 64, 255, 511, 1023)
CASES = [f"pair_{m}" for m in ("nospec", "dflash", *(f"ddtree_{b}" for b in BUDGETS))] + [
    "pair_ddtreetriton_64",
    "pair_ddtreeflash_64",
    "pair_ddtreeflash_255",
    "pair_ddtreesplit_255",
    "pair_ddtreetorch_64",
    "pair_ddtreesched_255",
    "pair_ddtreeauto_255",
    "pair_ddtreedefault_255",
    "pair_ddtreesync_15",
    "pair_ddtreesync_64",
    "pair_ddtreev1_64",
    "random_nospec",
    "random_dflash",
    "random_ddtree_15",
    "random_ddtree_64",
    "random_ddtreetorch_64",
    "pairopts_nospec",
    "pairopts_ddtree_64",
    "pairpen_nospec",
    "pairpen_dflash",
    "pairpen_ddtree_15",
    "pairpen_ddtree_64",
    "pairpen_ddtree_255",
    "pairjson_nospec",
    "pairjson_dflash",
    "pairjson_ddtree_15",
    "pairjson_ddtree_64",
    "pairjson_ddtree_255",
    "hybrid_nospec",
    "hybrid_dflash",
    "hybrid_ddtree_15",
    "hybrid_ddtree_30",  # B <= vocab - 2 (32 words): vLLM's warm-up ids
    # Budgets per batch size on the hybrid target (its V2 default since 2026-12-07): the tree
    # width changes between steps of a request, and the GDN stash and replay with it.
    "hybrid_ddtreesched_30",
    "hybrid_ddtreeauto_30",
]
# dflash: vLLM's own chain (its defaults), the control for the numerics of a verify forward.
# ddtree: DDTree on vLLM's defaults (V2 runner, the paged tree kernel in the verify graphs);
# ddtreetriton: with attention_backend TRITON_ATTN (the backend of GPUs without FA3);
# ddtreeflash: DDTREE_TREE_ATTENTION=flash (the context part by vLLM's FlashAttention);
# ddtreesplit: DDTREE_CONTEXT_SPLITS=4 (the tree kernel's context in 4 shares, merged);
# ddtreesync: DDTREE_SYNC_DEBUG=warn (torch's CUDA sync debug mode around DDTree's per-step
# code, eager and V2 alike; the log lists every sync it made; B=15: the chain-sized steps that
# go to vLLM's rejection sampler, B=64: the walk); ddtreev1: the V1 runner fallback;
# ddtreetorch: DDTREE_TREE_KERNELS=torch (the tree build, walk and KV compaction in torch ops
# instead of the default Triton kernels); ddtreesched: ddtree_budget_per_batch_size (B at 1-2
# requests, 15 from 3); ddtreedefault: no ddtree_budget_per_batch_size (the V2 runner's default
# on one GPU: "auto", tuned every 64 steps; every other ddtree case sets "fixed"); ddtreeauto:
# ddtree_budget_per_batch_size "auto" with DDTREE_TUNE_EVERY=4 (the budgets change under the
# requests). max_model_len is 1024, or 4 x the budget where that is more.
# (VLLM_USE_V2_MODEL_RUNNER=0: piecewise graphs, synchronous scheduling).
# pairopts: the pair with per-request options the V2 runner serves (one set per request),
# compared with no-spec under the same options, logprobs included (the check behind serving
# them on the V2 runner).
OPTIONS = [
    dict(logit_bias={297: 4.0}),
    dict(min_tokens=90),
    dict(logit_bias={202: -100.0}, min_tokens=30),
    dict(allowed_token_ids=list(range(100, 1100))),  # vLLM's V2 sampler takes <= 1024
    dict(logprobs=3),
    dict(logprobs=0, min_p=0.3),
    {},
    dict(logprobs=5, logit_bias={11: 2.0}),
]
# pairpen: penalties and bad words per request (DDTree's per-node history on the V2 runner,
# v2/penalties.py, v2/bad_words.py). Penalised logits sit close together (no-spec's margins
# down to ~1e-3 in float32), so bf16 flips are likelier than in pair: vLLM's chain on the same
# requests (pairpen_dflash) is the control.
PENALTIES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.8),
    dict(repetition_penalty=1.3),
    dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    dict(repetition_penalty=0.9),
    dict(bad_words=[" the", " of the", " return"]),  # ("\n\n" breaks vLLM's own tokenization)
    dict(frequency_penalty=-0.5, bad_words=[" and"]),
    dict(presence_penalty=2.0, logprobs=2),
]
# pairjson: structured output per request (the scheduler's grammar masks every tree node
# from its root path's state; on the V2 runner the drafts' parents reach it through
# v2/grammar.py); pairjson_dflash: vLLM's chain under the same grammars, the control. Built in
# run_case (vLLM's StructuredOutputsParams).
STRUCTURED = [
    dict(json={"type": "object", "properties": {"name": {"type": "string"},
                                                "n": {"type": "integer"}},
               "required": ["name", "n"]}),
    dict(regex=r"(def|class) [a-z_]{1,12}\((self)?\):"),
    dict(choice=["import os", "import sys", "print(x)"]),
    dict(json_object=True),
    None,
    dict(regex=r"[0-9]+( [+*-] [0-9]+){2,6}"),
    dict(json={"type": "array", "items": {"type": "integer"}, "maxItems": 12}),
    None,
]  # fmt: skip
# hybrid: a tiny Qwen3.5 (2 x (3 Gated DeltaNet + 1 attention) layers, M-RoPE) with a DFlash
# drafter distilled from it (tests/models.make_hybrid_pair): the V2 runner's GDN tree verify
# and commit (vllm_plugin/v2/gdn.py).
MAX_TOKENS = [128, 96, 64, 40, 200, 17, 150, 1]
PROMPT_LENS = [64, 48, 33, 20, 64, 12, 57, 5]


def _models(kind: str, out: Path) -> tuple[Path, Path]:
    if kind.startswith("pair"):
        return ROOT / "models" / "target", ROOT / "models" / "drafter"
    if kind == "hybrid":
        return out / "hybrid" / "target", out / "hybrid" / "drafter"
    return out / "random_target", out / "random_drafter"


def make_hybrid_pair(out: Path) -> None:
    """The CPU tests' hybrid pair (``tests/models.py``), made here once for every case."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from models import make_hybrid_pair as make

    # Few threads: beside the engines' and GPU tests' compiles, 16 OpenMP threads on 16 busy
    # cores made its 400 training steps take 4.5 minutes (1.3 s each) on an H100 host.
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    make(out / "hybrid")


class _in_thread(threading.Thread):
    """``fn(*args)`` in a thread; ``join`` re-raises what it raised."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.error = fn, args, None
        self.start()

    def run(self) -> None:
        try:
            self.fn(*self.args)
        except BaseException as err:  # noqa: BLE001 -- handed to join
            self.error = err

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def make_random_pair(out: Path) -> None:
    """A random Qwen3 target (sharpened head) + random DFlash drafter, saved for vLLM."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree.dflash import DFlashDraftModel, save_drafter

    torch.manual_seed(0)
    shape = dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
    )
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=4, tie_word_embeddings=False, **shape))
    with torch.no_grad():
        target.lm_head.weight.mul_(20)  # sharp logits: few near-ties in bfloat16
    target.save_pretrained(out / "random_target")
    config = Qwen3Config(num_hidden_layers=2, **shape)
    config.block_size = 16
    config.num_target_layers = 4
    config.dflash_config = {"mask_token_id": 1023, "target_layer_ids": [0, 1, 2]}
    save_drafter(DFlashDraftModel(config), out / "random_drafter")


def _prompts(kind: str, target: Path) -> list[list[int]]:
    if kind.startswith("pair"):
        from transformers import AutoTokenizer

        from ddtree.bench.tau import held_out_prompts

        full = held_out_prompts(AutoTokenizer.from_pretrained(target), len(PROMPT_LENS))
        return [p[:n] for p, n in zip(full, PROMPT_LENS, strict=True)]
    import torch

    gen = torch.Generator().manual_seed(0)
    high = 30 if kind == "hybrid" else 1000  # the hybrid target's 32 words
    return [torch.randint(2 if kind == "hybrid" else 4, high, (n,), generator=gen).tolist()
            for n in PROMPT_LENS]  # fmt: skip


def run_case(name: str, out: Path, dtype: str) -> None:
    import vllm
    from vllm.inputs import TokensPrompt

    kind, method = name.split("_", 1)
    pair = kind.startswith("pair")
    target, drafter = _models(kind, out)
    spec = None
    extra = {}
    max_model_len = 1024
    if method == "dflash":
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15}
    elif method != "nospec":
        if method.startswith("ddtreesync_"):
            os.environ["DDTREE_SYNC_DEBUG"] = "warn"
        if method.startswith("ddtreetriton_"):
            extra["attention_backend"] = "TRITON_ATTN"
        if method.startswith("ddtreev1_"):
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        if method.startswith("ddtreetorch_"):
            os.environ["DDTREE_TREE_KERNELS"] = "torch"
        if method.startswith("ddtreeflash_"):
            os.environ["DDTREE_TREE_ATTENTION"] = "flash"
        if method.startswith("ddtreesplit_"):
            os.environ["DDTREE_CONTEXT_SPLITS"] = "4"
        budget = int(method.split("_")[-1])
        max_model_len = max(max_model_len, 4 * budget)  # V2 needs >= 2B + 3 (warm-up)
        spec = {"method": "ddtree", "model": str(drafter), "ddtree_budget": budget}
        if not method.startswith("ddtreedefault_"):  # B at every batch size
            spec["ddtree_budget_per_batch_size"] = "fixed"
        if method.startswith("ddtreesched_"):  # the scheduler verifies 15 of B at 3+ requests
            spec["ddtree_budget_per_batch_size"] = [[1, 2, budget], [3, 8, 15]]
        if method.startswith("ddtreeauto_"):
            os.environ["DDTREE_TUNE_EVERY"] = "4"
            spec["ddtree_budget_per_batch_size"] = "auto"
    import torch

    if not torch.cuda.is_available():  # a CPU dry run of the script (--dtype float32)
        extra["enforce_eager"] = True
        if method.startswith("ddtreeauto_"):  # "auto" needs the worker in the engine core's
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # process: the CPU build's mp
    if kind == "hybrid":  # text only: the vision tower is never run
        extra["language_model_only"] = True
        if torch.cuda.is_available():  # vLLM's default GDN prefill on sm90 needs flashinfer
            extra["additional_config"] = {"gdn_prefill_backend": "triton"}
    if kind in ("pairpen", "pairjson"):
        # Margins and logprobs after the penalties / grammar mask, what greedy decides on.
        extra["logprobs_mode"] = "processed_logprobs"
    t0 = time.time()
    llm = vllm.LLM(
        model=str(target),
        speculative_config=spec,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=8,
        seed=0,
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.05,
        skip_tokenizer_init=not pair,
        disable_log_stats=False,
        **extra,
    )
    started = time.time() - t0
    prompts = _prompts(kind, target)
    stop = [[], [], [202 if pair else 7], [], [], [], [10], []]  # 202: newline
    # no-spec: top-2 margins, to judge any divergence (pairopts: the options' logprobs only)
    logprobs = 2 if spec is None and kind != "pairopts" else None
    options = {"pairopts": OPTIONS, "pairpen": PENALTIES}.get(kind, [{}] * len(MAX_TOKENS))
    if kind == "pairjson":
        from vllm.sampling_params import StructuredOutputsParams

        options = [
            {} if o is None else {"structured_outputs": StructuredOutputsParams(**o)}
            for o in STRUCTURED
        ]
    params = [
        vllm.SamplingParams(
            temperature=0,
            max_tokens=m,
            stop_token_ids=s,
            detokenize=False,
            **{"logprobs": logprobs, **o},
        )
        for m, s, o in zip(MAX_TOKENS, stop, options, strict=True)
    ]
    t1 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    seconds = time.time() - t1
    # DDTree's sampling (T=1, top-k, top-p) must run too; its tokens are not compared. (The
    # dflash control skips it: vLLM 0.26's rejection sampler fails on top-k + top-p on the CPU.)
    sampled = []
    if method.startswith("ddtree"):
        sampled = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            vllm.SamplingParams(
                temperature=1.0, top_k=50, top_p=0.9, max_tokens=64, seed=1, detokenize=False
            ),
        )
    config = llm.llm_engine.vllm_config
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            metrics[metric.name] = value if value is not None else getattr(metric, "values", None)
    result = {
        "case": name,
        "outputs": [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs],
        "top2_margins": [_margins(o.outputs[0].logprobs) for o in outs] if spec is None else None,
        "logprobs": [_logprobs(o.outputs[0].logprobs) for o in outs],
        "sampled_lengths": [len(o.outputs[0].token_ids) for o in sampled],
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "v2_model_runner": config.use_v2_model_runner,
        "engine_start_s": round(started, 1),
        "generate_s": round(seconds, 2),
        "spec_metrics": metrics,
    }
    (out / f"{name}.json").write_text(json.dumps(result) + "\n")
    print(f"wrote {out / f'{name}.json'}", flush=True)
    llm.llm_engine.engine_core.shutdown()


def _margins(logprobs) -> list[float] | None:
    """Per generated position: top-1 minus top-2 logprob (how close greedy was to a tie)."""
    if not logprobs:
        return None
    out = []
    for position in logprobs:
        values = sorted((lp.logprob for lp in position.values()), reverse=True)
        out.append(round(values[0] - values[1], 4) if len(values) > 1 else None)
    return out


def _logprobs(logprobs) -> list[dict[str, float]] | None:
    """Per generated position: token -> logprob of what vLLM returned (sampled + top-k)."""
    if not logprobs:
        return None
    return [{str(t): lp.logprob for t, lp in position.items()} for position in logprobs]


def _logprob_gap(a: list | None, b: list | None, equal_until: int) -> float | None:
    """Largest |logprob difference| over the positions both returned before the outputs part
    (inf if the returned token sets differ there, or only no-spec's ``a`` is missing); None
    when the case's request ``b`` asked for none (no-spec may, for its margins)."""
    if b is None:
        return None
    if a is None:
        return float("inf")
    gap = 0.0
    for x, y in list(zip(a, b, strict=False))[:equal_until]:
        if x.keys() != y.keys():
            return float("inf")
        gap = max(gap, max(abs(x[t] - y[t]) for t in x))
    return round(gap, 5)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where the token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _dist_info(site: Path) -> None:
    """Make ``ddtree`` (on PYTHONPATH, not pip-installed) visible to vLLM's plugin loader."""
    info = site / "ddtree-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ddtree\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nddtree = ddtree.vllm_plugin.patches:register\n"
    )


def drive(out: Path, site: Path | None, dtype: str, cases: list[str], jobs: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    make_random_pair(out)
    # The hybrid pair trains on the host's CPUs (minutes there, beside the GPU tests' compiles):
    # in a thread while the other cases' engines start, its cases launched last.
    hybrid = [name for name in cases if name.startswith("hybrid_")]
    cases = [name for name in cases if name not in hybrid] + hybrid
    training = _in_thread(make_hybrid_pair, out) if hybrid else None
    env = dict(os.environ)
    if site is not None:
        _dist_info(site)
        env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    # At most ``jobs`` engines start at once: all 34 together on a 16-core host took 150-370 s
    # each to start (~30-50 s alone), the host's CPUs and memory shared by every compile.
    procs, codes = {}, {}
    for name in cases:
        if training is not None and name in hybrid:
            training.join()
            training = None
        while len(procs) - len(codes) >= jobs:
            time.sleep(1)
            codes.update({n: p.returncode for n, p in procs.items() if p.poll() is not None})
        log = (out / f"{name}.log").open("w")
        cmd = [sys.executable, __file__, "--case", name, "--out", str(out), "--dtype", dtype]
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        time.sleep(3)
    codes = {name: p.wait() for name, p in procs.items()}
    return summarize(out, cases, codes)


def summarize(out: Path, cases: list[str], codes: dict[str, int | None]) -> dict:
    """Compare each case's DIR/<case>.json with its kind's no-spec run; write summary.json.
    A case without its json (or its no-spec's) gets ``equal: None``."""
    results = {}
    for name in cases:
        path = out / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else None
    rows = []
    for name in cases:
        kind, method = name.split("_", 1)
        if method == "nospec":
            continue
        base, got = results[f"{kind}_nospec"], results[name]
        row = {"case": name, "exit_code": codes.get(name)}
        if base is None or got is None:
            row["equal"] = None
        else:
            pairs = list(zip(base["outputs"], got["outputs"], strict=True))
            row["equal"] = all(a == b for a, b in pairs)
            row["requests_equal"] = sum(a == b for a, b in pairs)
            row["tokens"] = sum(len(a[0]) for a, _ in pairs)
            row["first_divergence"] = [first_divergence(a[0], b[0]) for a, b in pairs]
            if kind in ("pairopts", "pairpen"):  # both asked for the same logprobs
                row["logprob_gap"] = [
                    _logprob_gap(x, y, len(a[0]) if d is None else d)
                    for x, y, a, d in zip(
                        base["logprobs"], got["logprobs"], base["outputs"],
                        row["first_divergence"], strict=True,
                    )
                ]  # fmt: skip
            margins = base.get("top2_margins") or [None] * len(pairs)
            row["nospec_margin_at_divergence"] = [
                None if d is None or m is None or d >= len(m) else m[d]
                for d, m in zip(row["first_divergence"], margins, strict=True)
            ]
            row["nospec_min_margin"] = min(
                (x for m in margins if m for x in m if x is not None), default=None
            )
            row["cudagraph_mode"] = got["cudagraph_mode"]
            row["nospec_cudagraph_mode"] = base["cudagraph_mode"]
            row["v2_model_runner"] = got["v2_model_runner"]
            row["generate_s"] = got["generate_s"]
            row["nospec_generate_s"] = base["generate_s"]
            row["spec_metrics"] = got["spec_metrics"]
            drafts = got["spec_metrics"].get("vllm:spec_decode_num_drafts")
            accepted = got["spec_metrics"].get("vllm:spec_decode_num_accepted_tokens")
            # tau over both runs (greedy batch + the T=1 batch): 1 + accepted per draft step
            row["tau"] = round(1 + accepted / drafts, 3) if drafts else None
        log_path = out / f"{name}.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        row["sync_warnings"] = log.count("called a synchronizing CUDA operation")
        if row["sync_warnings"]:  # where (a warning names its Python caller's file:line)
            sites = re.findall(r"(\S+\.py:\d+): UserWarning: called a synchronizing", log)
            row["sync_sites"] = sorted(set(sites))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "spec_metrics"}))
    summary = {"exit_codes": codes, "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", choices=CASES, default=None)
    parser.add_argument("--cases", default=",".join(CASES), help="driver: comma-separated cases")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--jobs", type=int, default=12, help="driver: engines started at once")
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="driver: only compare the json files already in --out (e.g. of a run cut off)",
    )
    parser.add_argument(
        "--site",
        type=Path,
        default=Path("/tmp/ddtree-site"),
        help="where to put the plugin's entry-point metadata",
    )
    args = parser.parse_args()
    if args.case is not None:
        run_case(args.case, args.out, args.dtype)
        return 0
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    if args.summarize:
        cases = [c for c in cases if (args.out / f"{c}.json").exists() or c.endswith("_nospec")]
        summary = summarize(args.out, cases, {})
    else:
        summary = drive(args.out, args.site, args.dtype, cases, args.jobs)
    return 0 if all(r.get("equal") for r in summary["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
