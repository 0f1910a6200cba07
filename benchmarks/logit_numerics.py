"""Whole-model bf16 error per generated token, teacher-forced: no-spec decode vs vLLM's DFlash
chain verify vs DDTree's tree verify, each against a float32 reference (issue 19, item 4).

Every engine under test (bf16 by default) answers the same held-out prompts greedily with
``logprobs=0``: the logprob of each emitted token as the forward that produced it computed it
(a decode step for no-spec, the chain's verify rows, the tree's verify rows). A float32 no-spec
engine then reads each answer as a continuation of its prompt (``prompt_logprobs=0``): the same
tokens in the same contexts, in float32. Per engine: mean / p99 / max of |logprob - float32
logprob| over all emitted tokens, a markdown table, JSON (``--out``) and a CDF plot of the
errors (``--plot``). Engines run one after another in this process.

    python benchmarks/logit_numerics.py --budgets 15,63,255 --out numerics.json --plot cdf.png
    python benchmarks/logit_numerics.py --dtype float32 --budgets 8 --prompts 2 \\
        --max-tokens 16   # on the CPU build: every engine in float32 (errors ~1e-6; a check)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _engine(target: Path, spec: dict | None, dtype: str, max_model_len: int):
    import torch
    import vllm

    kwargs = dict(
        model=str(target), speculative_config=spec, dtype=dtype, max_model_len=max_model_len,
        max_num_seqs=4, seed=0,
    )  # fmt: skip
    if torch.cuda.is_available():
        kwargs.update(kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.05)
    else:
        kwargs.update(enforce_eager=True, gpu_memory_utilization=0.1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: engines in sequence
    # In one process the plugin is ours to register: from a source tree (the GPU host's
    # PYTHONPATH) vLLM's entry-point loader does not find it.
    from ddtree.vllm_plugin.patches import register

    register()
    return vllm.LLM(**kwargs)


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def answers(llm, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list]]:
    """Greedy answers and the logprob of each emitted token (as its forward computed it)."""
    import vllm
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for out in outs:
        tokens = list(out.outputs[0].token_ids)
        logprobs = [
            step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)
        ]
        result.append((tokens, logprobs))
    return result


def reference(llm, prompts: list[list[int]], answered: list[list[int]]) -> list[list[float]]:
    """The float32 logprob of every answer token, teacher-forced (prompt + answer as a prompt)."""
    import vllm
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    full = [p + a for p, a in zip(prompts, answered, strict=True)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=f) for f in full], params)
    result = []
    for out, prompt, tokens in zip(outs, prompts, answered, strict=True):
        steps = out.prompt_logprobs[len(prompt) :]
        result.append([step[t].logprob for step, t in zip(steps, tokens, strict=True)])
    return result


def summary(errors: list[float]) -> dict:
    ordered = sorted(errors)
    pick = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None
    return {
        "tokens": len(ordered),
        "mean": sum(ordered) / len(ordered) if ordered else None,
        "p99": pick,
        "max": ordered[-1] if ordered else None,
    }


def plot(errors: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in errors.items():
        ordered = sorted(max(v, 1e-9) for v in values)
        share = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.plot(ordered, share, label=name, lw=2 if name in ("no-spec", "dflash") else 1.4)
    ax.set_xscale("log")
    ax.set_xlabel("|logprob - float32 logprob| of an emitted token (0 drawn at 1e-9)")
    ax.set_ylabel("share of tokens at or below")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "drafter")
    parser.add_argument("--budgets", default="15,63,255")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", help="of the engines under test")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",") if b]
    if args.prompts < 1 or args.max_tokens < 1 or not budgets or min(budgets) < 1:
        raise SystemExit("logit_numerics: --prompts, --max-tokens and --budgets must be >= 1")

    from transformers import AutoTokenizer

    from ddtree.bench.tau import held_out_prompts

    prompts = held_out_prompts(AutoTokenizer.from_pretrained(args.target), args.prompts)
    max_model_len = max(1024, 4 * max(budgets), 2 * (64 + args.max_tokens))
    engines = {"no-spec": None}
    engines["dflash"] = {"method": "dflash", "model": str(args.draft), "num_speculative_tokens": 15}
    for budget in budgets:
        engines[f"ddtree-{budget}"] = {
            "method": "ddtree", "model": str(args.draft), "ddtree_budget": budget,
            "ddtree_budget_per_batch_size": "fixed",  # B at every batch size, as named
        }  # fmt: skip
    got = {}
    for name, spec in engines.items():
        llm = _engine(args.target, spec, args.dtype, max_model_len)
        got[name] = answers(llm, prompts, args.max_tokens)
        _close(llm)
        print(f"{name}: {sum(len(t) for t, _ in got[name])} tokens", flush=True)
    llm = _engine(args.target, None, "float32", max_model_len)
    errors, rows = {}, {}
    for name, result in got.items():
        want = reference(llm, prompts, [tokens for tokens, _ in result])
        pairs = [zip(lps, ref, strict=True) for (_, lps), ref in zip(result, want, strict=True)]
        errors[name] = [abs(a - b) for pair in pairs for a, b in pair]
        rows[name] = summary(errors[name])
    _close(llm)
    print(f"\n{args.dtype} engines vs float32 no-spec, teacher-forced, per emitted token:\n")
    print("| engine | tokens | mean abs error | p99 | max |\n|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        cells = " | ".join(f"{row[k]:.2e}" for k in ("mean", "p99", "max"))
        print(f"| {name} | {row['tokens']} | {cells} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=1) + "\n")
    if args.plot is not None:
        plot(errors, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
