"""How much tau moves when only the attention's rounding changes (CPU, reference loop).

The H200 bench showed DDTree B=15 with the forced chain (the same 15 drafts as vLLM's chain)
at tau 2.31 against the chain's 2.51, while on the CPU in float32 both accept the same tokens.
This runs the transformers reference loop (``ddtree.generate``) with the bundled pair on the
bench's held-out prompts: the chain and chain-seeded DDTree-15 in float32 (identical), and the
bf16 chain twice, once with its attention computed in float32 (the only change). The bf16 pair
parts at near-ties and tau moves by about as much as on the GPU: tau comparisons between engines
that round differently carry this much prompt noise.

    python benchmarks/rounding_tau.py --out /tmp/rounding_tau.json   # ~10-20 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from vllm_gpu_equality import first_divergence  # benchmarks/ is the script's path

ROOT = Path(__file__).resolve().parent.parent
SDPA = F.scaled_dot_product_attention
ATTENTION_IN_FP32 = {"on": False}


def _sdpa(query, key, value, *args, **kwargs):
    """transformers' SDPA call, in float32 when ``ATTENTION_IN_FP32`` is on."""
    if ATTENTION_IN_FP32["on"] and query.dtype == torch.bfloat16:
        out = SDPA(query.float(), key.float(), value.float(), *args, **kwargs)
        return out.to(query.dtype)
    return SDPA(query, key, value, *args, **kwargs)


def run(prompts, dtype: torch.dtype, method: str, max_new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from ddtree.dflash import load_drafter
    from ddtree.generate import generate

    target = AutoModelForCausalLM.from_pretrained(
        ROOT / "models" / "target", dtype=dtype, attn_implementation="sdpa"
    ).eval()
    drafter = load_drafter(ROOT / "models" / "drafter", target.config, dtype=dtype, device="cpu")
    steps, per_depth, per_prompt, outputs = 0, [0] * 15, [], []
    for prompt in prompts:
        result = generate(target, drafter, prompt, method, budget=15, max_new_tokens=max_new_tokens)
        steps += len(result.taus)
        for depth, count in enumerate(result.accepted_per_depth):
            per_depth[depth] += count
        per_prompt.append(round(result.tau, 3))
        outputs.append(result.tokens)
    tokens = sum(len(o) for o in outputs)
    return {
        "tau": round(tokens / steps, 4),
        "steps": steps,
        "accepted_per_depth": per_depth,  # absolute counts: rates per step hide the step count
        "tau_per_prompt": per_prompt,
        "outputs": outputs,
    }


def first_splits(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per prompt: the first token where two runs differ (None: equal)."""
    return [first_divergence(u, v) for u, v in zip(a, b, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from ddtree.bench.tau import held_out_prompts

    torch.set_num_threads(2)
    F.scaled_dot_product_attention = _sdpa  # transformers' SDPA module calls it by name
    prompts = held_out_prompts(AutoTokenizer.from_pretrained(ROOT / "models" / "target"),
                               args.prompts)  # fmt: skip
    configs = {  # name: (dtype, method, attention in float32)
        "chain_fp32": (torch.float32, "dflash", False),
        "ddtree15_fp32": (torch.float32, "ddtree", False),
        "chain_bf16": (torch.bfloat16, "dflash", False),
        "chain_bf16_fp32_attention": (torch.bfloat16, "dflash", True),
    }
    results = {}
    for name, (dtype, method, fp32_attention) in configs.items():
        ATTENTION_IN_FP32["on"] = fp32_attention
        results[name] = run(prompts, dtype, method, args.max_tokens)
        print(name, results[name]["tau"], results[name]["steps"], flush=True)
    pairs = [("chain_fp32", "ddtree15_fp32"), ("chain_bf16", "chain_bf16_fp32_attention")]
    summary = {
        "command": "python benchmarks/rounding_tau.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "runs": {n: {k: v for k, v in r.items() if k != "outputs"} for n, r in results.items()},
        "first_split": {
            f"{a} vs {b}": first_splits(results[a]["outputs"], results[b]["outputs"])
            for a, b in pairs
        },
    }
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    for pair, split in summary["first_split"].items():
        print(pair, "first split per prompt:", split)


if __name__ == "__main__":
    main()
