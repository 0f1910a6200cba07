"""vLLM's DFlash chain vs DDTree B=15 with the forced chain (the same 15-node chain as a tree),
greedy, on held-out prompts: acceptance counts and whether the outputs agree.

With ``ddtree_chain_seed`` and B = D = 15 the tree is the drafter's argmax chain, so the two
should accept the same tokens. On the CPU (V1 runner, float32) they do (346 tokens over 436
draft steps, identical outputs: benchmarks/results/chain_vs_tree15_cpu_2026-12-04/); on the
H200 (V2 runner, bf16) DDTree's tau was ~8% lower: this script is the check for that gap.

    python benchmarks/chain_vs_tree15.py            # vLLM's defaults for the platform
    python benchmarks/chain_vs_tree15.py --dtype float32   # on a GPU: logic vs bf16 numerics
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vllm_gpu_equality import first_divergence  # benchmarks/ is the script's path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--dtype", default=None, help="model dtype (default: float32 on the CPU, else vLLM's)"
    )
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    import vllm
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from ddtree.bench.tau import held_out_prompts
    from ddtree.vllm_plugin.patches import register

    register()  # the engines run in this process: the plugin too, installed or only on the path

    target, drafter = ROOT / "models" / "target", ROOT / "models" / "drafter"
    prompts = [
        TokensPrompt(prompt_token_ids=p)
        for p in held_out_prompts(AutoTokenizer.from_pretrained(target), args.prompts)
    ]
    specs = {
        "dflash": {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15},
        "ddtree15": {"method": "ddtree", "model": str(drafter), "ddtree_budget": 15},
    }
    kw = {"dtype": "float32", "enforce_eager": True} if not torch.cuda.is_available() else {}
    if args.dtype is not None:
        kw["dtype"] = args.dtype
    result = {}
    for name, spec in specs.items():
        llm = vllm.LLM(
            model=str(target), speculative_config=spec, max_num_seqs=1, seed=0,
            disable_log_stats=False, gpu_memory_utilization=0.2, **kw,
        )  # fmt: skip
        params = vllm.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params)
        counts = {
            m.name.removeprefix("vllm:spec_decode_"): m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
        }
        counts["tau"] = 1 + counts["num_accepted_tokens"] / max(counts["num_drafts"], 1)
        result[name] = {"counts": counts, "outputs": [list(o.outputs[0].token_ids) for o in outs]}
        print(name, counts, flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
    same = result["dflash"]["outputs"] == result["ddtree15"]["outputs"]
    first_split = [  # per prompt: the first token where the two differ (None: equal)
        first_divergence(a, b)
        for a, b in zip(result["dflash"]["outputs"], result["ddtree15"]["outputs"], strict=True)
    ]
    result["first_split"] = first_split
    print("same outputs:", same, "first split per prompt:", first_split)
    if args.out is not None:
        args.out.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
