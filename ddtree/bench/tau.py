"""Acceptance length (tau) vs budget with the transformers reference loop, on held-out prompts.

tau = tokens emitted per target verify step (accepted + bonus), pooled over prompts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ddtree.generate import generate
from ddtree.train.data import read_texts, stdlib_files

BUDGETS = (16, 32, 64, 128, 255, 511, 1023)


def held_out_prompts(tokenizer, count: int = 12, length: int = 64) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, each from a ``def`` line of a held-out module,
    spread evenly over all such lines (deterministic)."""
    starts = []
    for path, text in zip(files := stdlib_files(held_out=True), read_texts(files), strict=True):
        offset = 0
        for line in text.splitlines(keepends=True):
            if line.lstrip().startswith("def "):
                starts.append((path.name, text, offset))
            offset += len(line)
    if len(starts) < count:
        raise RuntimeError(f"only {len(starts)} held-out def lines, {count} prompts asked")
    picked = [starts[i * len(starts) // count] for i in range(count)]
    prompts = []
    for _, text, offset in picked:
        ids = tokenizer(text[offset:], add_special_tokens=False)["input_ids"][:length]
        prompts.append(ids)
    return prompts


def measure_tau(
    target,
    drafter,
    prompts,
    *,
    budgets=BUDGETS,
    temperatures=(0.0, 1.0),
    max_new_tokens=96,
    seed: int = 0,
) -> dict:
    """tau and per-depth acceptance for the DFlash chain and DDTree at each budget."""
    runs = [("dflash", 0)] + [("ddtree", b) for b in budgets]
    rows = []
    for temperature in temperatures:
        for method, budget in tqdm(runs, desc=f"tau T={temperature}"):
            steps = tokens = 0
            per_depth: list[int] = []
            t0 = time.perf_counter()
            for i, prompt in enumerate(prompts):
                r = generate(
                    target,
                    drafter,
                    prompt,
                    method,
                    budget=budget,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    seed=seed + i,
                )
                steps += len(r.taus)
                tokens += sum(r.taus)
                per_depth = [
                    a + b
                    for a, b in zip(
                        per_depth or [0] * len(r.accepted_per_depth),
                        r.accepted_per_depth,
                        strict=True,
                    )
                ]
            rows.append(
                {
                    "method": method,
                    "budget": budget,
                    "temperature": temperature,
                    "tau": tokens / max(steps, 1),
                    "steps": steps,
                    "acceptance_per_depth": [a / max(steps, 1) for a in per_depth],
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            )
            tqdm.write(f"T={temperature} {method} B={budget}: tau {rows[-1]['tau']:.3f}")
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "rows": rows}


def plot_tau(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for temperature in sorted({r["temperature"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["temperature"] == temperature]
        tree = [r for r in rows if r["method"] == "ddtree"]
        line = ax.plot(
            [r["budget"] for r in tree],
            [r["tau"] for r in tree],
            marker="o",
            label=f"DDTree, T={temperature:g}",
        )[0]
        chain = next(r for r in rows if r["method"] == "dflash")
        ax.axhline(
            chain["tau"],
            linestyle="--",
            color=line.get_color(),
            label=f"DFlash chain, T={temperature:g}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget B (nodes)")
    ax.set_ylabel("tau (tokens per verify step)")
    ax.set_title(result.get("title", "acceptance vs budget"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(target_dir: Path, draft_dir: Path, out_json: Path, plot: Path | None, **kw) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddtree.dflash import load_drafter

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device)
    drafter = load_drafter(draft_dir, target.config, dtype=torch.float32, device=device)
    prompts = held_out_prompts(tokenizer, kw.pop("count", 12))
    result = measure_tau(target.eval(), drafter, prompts, **kw)
    result["title"] = f"{target_dir.name} + {draft_dir.name}, held-out stdlib prompts"
    result["command"] = " ".join(["ddtree", *sys.argv[1:]])
    result["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    if plot is not None:
        plot_tau(result, plot)
    return result
