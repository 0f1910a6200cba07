"""Profile one build_tree + walk step: CUDA time per kernel family (what bounds the step).

python benchmarks/profile_tree.py --batch 1 --budget 1024 --vocab 151936
python benchmarks/profile_tree.py --impl fused --batch 1 --budget 1024  # ddtree.kernels
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import ddtree
from ddtree.tree import draft_topk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--rows", type=int, default=25, help="kernels to list")
    parser.add_argument("--impl", choices=("torch", "fused"), default="torch")
    args = parser.parse_args()
    logits = (torch.randn(args.batch, args.depth, args.vocab, device="cuda") * 4).bfloat16()
    target = torch.randint(0, args.vocab, (args.batch, 1 + args.budget), device="cuda")
    k = min(args.budget, args.vocab)

    def step():
        tree = ddtree.build_tree(logits, args.budget, chain_seed=True, check_values=False)
        return ddtree.walk(tree, target)

    parts = {
        "build+walk": step,
        "vocab stage (draft_topk)": lambda: draft_topk(logits, k),
        "float topk alone": lambda: logits.float().topk(k, dim=-1),
        "logsumexp alone": lambda: torch.logsumexp(logits.float(), -1),
    }
    if args.impl == "fused":
        from ddtree import kernels

        buffers = kernels.tree_buffers(args.batch, args.depth, args.vocab, args.budget, "cuda")
        acc = kernels.acceptance_buffers(args.batch, args.depth, args.budget + 1, "cuda")

        def fused_step():
            tree = kernels.build_tree_fused(logits, args.budget, chain_seed=True, buffers=buffers)
            return kernels.walk_fused(tree, target, out=acc)

        parts = {"fused build+walk (ddtree.kernels)": fused_step}
    for name, fn in parts.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        events = prof.key_averages()
        total = sum(e.device_time_total for e in events) / 5
        print(
            f"\n## {name}: batch {args.batch}, B {args.budget}, V {args.vocab}: "
            f"{total / 1e3:.3f} ms of kernels per call, "
            f"{sum(e.count for e in events) // 5} kernel launches per call"
        )
        print(
            events.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60)
        )


if __name__ == "__main__":
    main()
