"""Tree GDN kernel (``ddtree.kernels.gdn_tree``) vs vLLM's chain kernel at Qwen3.6-27B GDN shapes
(GPU): time per layer call, and bf16 error against a float64 reference.

Shapes: 16 key heads, 48 value heads, head size 128 (Qwen3.6-27B's linear-attention layers),
bf16 q/k/v, float32 state. For T tokens per request (T = 1 + B tree slots, or a T-token chain):

- ``tree_ms``: ``tree_gdn_fused`` on a DDTree tree of budget T - 1 (depth 15, random drafts);
- ``chain_ms``: vLLM's ``fused_recurrent_gated_delta_rule`` on a chain of T tokens as a DFlash
  chain's verify calls it per GDN layer (varlen, every token's state written to its own slot);
- ``tree_err`` / ``chain_err``: max |out - float64 reference| / RMS(reference) (the tree's
  reference: ``ddtree.gdn.tree_gdn``; the chain's: ``ddtree.gdn.chain_gdn``), at batch 1.

    python benchmarks/gdn_tree.py --out gdn_tree.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tree import timed  # benchmarks/tree.py: median seconds, CUDA events

HEADS, HEADS_V, DIM = 16, 48, 128


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.pow(2).mean().sqrt())


def measure(batch: int, tokens: int, seed: int = 0) -> dict:
    from vllm.third_party.flash_linear_attention.ops.fused_recurrent import (
        fused_recurrent_gated_delta_rule,
    )

    import ddtree
    from ddtree.gdn import chain_gdn, tree_gdn
    from ddtree.kernels.gdn_tree import tree_gdn_fused

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rand(batch, tokens, HEADS, DIM).bfloat16()
    k = rand(batch, tokens, HEADS, DIM).bfloat16()
    v = rand(batch, tokens, HEADS_V, DIM).bfloat16()
    g = (-torch.rand(batch, tokens, HEADS_V, device="cuda", generator=gen) * 0.1).float()
    beta = torch.rand(batch, tokens, HEADS_V, device="cuda", generator=gen).float()
    state = rand(batch, HEADS_V, DIM, DIM) * 0.1
    trees = ddtree.build_tree(rand(batch, 15, 5000) * 3, tokens - 1, chain_seed=True)
    ancestors, depths = trees.ancestors.contiguous(), trees.depths.contiguous()
    out = torch.empty(batch, tokens, HEADS_V, DIM, device="cuda")

    def tree():
        tree_gdn_fused(q, k, v, g, beta, state, ancestors, depths, use_qk_l2norm=True, out=out)

    # vLLM's chain verify: requests flattened with cu_seqlens, every token's state written to
    # its own slot (slot 0 is vLLM's null block), the start state read from slot [b, 0].
    flat = [t.reshape(1, batch * tokens, *t.shape[2:]) for t in (q, k, v, g, beta)]
    cu_seqlens = torch.arange(0, batch * tokens + 1, tokens, device="cuda", dtype=torch.int32)
    slots = torch.arange(1, batch * tokens + 1, device="cuda", dtype=torch.int32)
    slots = slots.view(batch, tokens)
    pool = torch.zeros(1 + batch * tokens, HEADS_V, DIM, DIM, device="cuda")
    accepted = torch.ones(batch, dtype=torch.int32, device="cuda")

    def chain():  # (timed repeats start from the last call's states: same work)
        got, _ = fused_recurrent_gated_delta_rule(
            *flat, initial_state=pool, inplace_final_state=True, cu_seqlens=cu_seqlens,
            ssm_state_indices=slots, num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return got.view(batch, tokens, HEADS_V, DIM)

    row = {"batch": batch, "tokens": tokens}
    row["tree_ms"] = timed(tree, "cuda", 20) * 1e3
    row["chain_ms"] = timed(chain, "cuda", 20) * 1e3
    row["tree_err"] = row["chain_err"] = None
    if batch > 1:  # the references keep every token's float64 state: batch 1 only
        return row
    tree()
    double = [t.double() for t in (q, k, v, g, beta)]
    want, _ = tree_gdn(*double, state.double(), trees.parents)
    row["tree_err"] = _error(out, want)
    want, _ = chain_gdn(*double, state.double())
    pool[slots[:, 0].long()] = state
    row["chain_err"] = _error(chain(), want)
    return row


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,65,129,256")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [
        measure(b, t)
        for b in (int(x) for x in args.batches.split(","))
        for t in (int(x) for x in args.tokens.split(","))
    ]
    print(
        "| batch | T | tree ms | chain ms | tree err | chain err |\n|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['batch']} | {r['tokens']} | {r['tree_ms']:.3f} | {r['chain_ms']:.3f} | "
            f"{_fmt(r['tree_err'])} | {_fmt(r['chain_err'])} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
