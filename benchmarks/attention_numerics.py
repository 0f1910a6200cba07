"""bf16 error of the verify attention, DDTree's paged tree kernel vs vLLM's FlashAttention (GPU).

Issue 19 asks that DDTree's bf16 error not exceed the chain's. The verify forwards differ only
in attention: the chain's verify and a plain decode run FlashAttention (causal varlen over the
paged cache), DDTree's runs ``attention/paged_tree_kernel.py``. On the same bf16 queries and
paged K/V (Qwen3-8B heads: 32 query heads, 8 KV heads, head size 128, block 16), each output
is compared with a float64 reference:

- ``fa_decode``: FlashAttention, one query per request (what no-spec computes);
- ``fa_chain``: FlashAttention, 16 causal queries per request (the chain's verify);
- ``tree_chain``: the tree kernel on the same 16 queries as a chain-shaped tree (same mask);
- ``tree_B``: the tree kernel on a budget-B DDTree tree (its own ancestor mask);
- ``tree_B_4shares``: the same with the keys in 4 shares merged in float32 (what the engine
  runs where the launch grid is small: ``DDTREE_CONTEXT_SPLITS=auto``).

Error = |output - float64 reference| per element, relative to the reference's RMS, over
contexts of 64..4096 tokens. Prints a table; ``--out`` writes JSON.

    python benchmarks/attention_numerics.py --out numerics.json
    TRITON_INTERPRET=1 python benchmarks/attention_numerics.py --device cpu --contexts 40,100 \
        --budget 20 --seeds 1   # the tree rows in float32 on the CPU: checks this script
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
DEVICE = "cuda"  # --device cpu: the tree rows only, float32 under TRITON_INTERPRET=1 (a check
DTYPE = torch.bfloat16  # of this file: Triton's interpreter has no bfloat16)


def _cache(contexts: list[int], slots: int, gen: torch.Generator):
    """A paged bf16 cache [num_blocks, kvh, block, 2*hd] (FlashAttention's logical view over
    NHD memory), shuffled block tables, K/V scaled like a real model's (|k| ~ 3, |v| ~ 1)."""
    per_req = -(-(max(contexts) + slots) // BLOCK)
    num_blocks = per_req * len(contexts)
    memory = torch.randn(num_blocks, BLOCK, KV_HEADS, 2 * HEAD, device=DEVICE, generator=gen)
    memory[..., :HEAD] *= 3.0
    kv_cache = memory.to(DTYPE).permute(0, 2, 1, 3)
    tables = torch.randperm(num_blocks, device=DEVICE, generator=gen).view(len(contexts), per_req)
    return kv_cache, tables.int()


def _reference(query, kv_cache, table, context, mask_row) -> torch.Tensor:
    """float64 attention of one query row over context + the slots ``mask_row`` allows."""
    seen = mask_row.nonzero().squeeze(1)
    pos = torch.cat([torch.arange(context, device=DEVICE), context + seen])
    rows = kv_cache[table[pos // BLOCK].long(), :, pos % BLOCK].double()  # [n, kvh, 2hd]
    k, v = rows[..., :HEAD], rows[..., HEAD:]
    q = query.double().view(KV_HEADS, HEADS // KV_HEADS, HEAD)
    scores = torch.einsum("kgd,nkd->kgn", q, k) * HEAD**-0.5
    out = torch.einsum("kgn,nkd->kgd", scores.softmax(-1), v)
    return out.reshape(HEADS, HEAD)


def _flash(query, kv_cache, tables, cu_q, seq_lens, max_q, causal=True) -> torch.Tensor:
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD, dim=-1)
    return flash_attn_varlen_func(
        q=query,
        k=key_cache,
        v=value_cache,
        cu_seqlens_q=cu_q,
        max_seqlen_q=max_q,
        seqused_k=seq_lens,
        max_seqlen_k=int(seq_lens.max()),
        softmax_scale=HEAD**-0.5,
        causal=causal,
        block_table=tables,
        fa_version=get_flash_attn_version(),
    )


def _tree(query, kv_cache, tables, trees, contexts, splits: int = 1) -> torch.Tensor:
    from ddtree.vllm_plugin.attention.paged_tree_kernel import paged_tree_attention

    num_reqs, slots = trees.tokens.shape
    cu_q = torch.arange(num_reqs + 1, device=DEVICE, dtype=torch.int32) * slots
    seq_lens = torch.tensor(contexts, device=DEVICE, dtype=torch.int32) + slots
    out = torch.zeros_like(query)
    paged_tree_attention(
        query, kv_cache, out, cu_q, seq_lens, tables,
        torch.arange(num_reqs, device=DEVICE, dtype=torch.int32),
        trees.depths.int().contiguous(), trees.ancestors.int().contiguous(),
        HEAD**-0.5, slots, context_splits=splits,
    )  # fmt: skip
    return out


def _errors(got, want_rows) -> tuple[float, float]:
    """(mean, max) of |got - want| / RMS(want) over all rows and elements."""
    diff = torch.stack([(g.double() - w).abs() / w.pow(2).mean().sqrt() for g, w in zip(
        got, want_rows, strict=True)])  # fmt: skip
    return float(diff.mean()), float(diff.max())


def measure(contexts: list[int], budget: int, seed: int) -> dict[str, tuple[float, float]]:
    import ddtree

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    num_reqs, chain = len(contexts), 16
    slots = max(chain, budget + 1)
    kv_cache, tables = _cache(contexts, slots, gen)
    depth = 15
    logits = torch.randn(num_reqs, depth, 2000, device=DEVICE, generator=gen) * 3
    chain_tree = ddtree.build_tree(logits, depth, chain_seed=True)  # 16 slots, a chain
    tree = ddtree.build_tree(logits, budget, chain_seed=True)
    out = {}

    if DEVICE != "cuda":  # FlashAttention needs CUDA
        return _tree_rows(out, contexts, budget, kv_cache, tables, chain_tree, tree, gen)

    # fa_decode: the root row alone (context + itself).
    q1 = torch.randn(num_reqs, HEADS, HEAD, device=DEVICE, generator=gen).to(DTYPE)
    cu1 = torch.arange(num_reqs + 1, device=DEVICE, dtype=torch.int32)
    lens1 = torch.tensor(contexts, device=DEVICE, dtype=torch.int32) + 1
    got = _flash(q1, kv_cache, tables, cu1, lens1, 1)
    want = [_reference(q1[r], kv_cache, tables[r], contexts[r], torch.ones(1, dtype=torch.bool,
            device=DEVICE)) for r in range(num_reqs)]  # fmt: skip
    out["fa_decode"] = _errors(list(got), want)

    # fa_chain and tree_chain: 16 causal queries per request.
    q = torch.randn(num_reqs * chain, HEADS, HEAD, device=DEVICE, generator=gen).to(DTYPE)
    cu = torch.arange(num_reqs + 1, device=DEVICE, dtype=torch.int32) * chain
    lens = torch.tensor(contexts, device=DEVICE, dtype=torch.int32) + chain
    want = [
        _reference(q[r * chain + i], kv_cache, tables[r], contexts[r], chain_tree.mask[r, i])
        for r in range(num_reqs)
        for i in range(chain)
    ]
    out["fa_chain"] = _errors(list(_flash(q, kv_cache, tables, cu, lens, chain)), want)
    return _tree_rows(out, contexts, budget, kv_cache, tables, chain_tree, tree, gen, q, want)


def _tree_rows(out, contexts, budget, kv_cache, tables, chain_tree, tree, gen, q=None, want=None):
    """tree_chain (on the chain's queries) and tree_B rows of ``out``."""
    num_reqs, chain = len(contexts), 16
    if q is None:
        q = torch.randn(num_reqs * chain, HEADS, HEAD, device=DEVICE, generator=gen).to(DTYPE)
        want = [
            _reference(q[r * chain + i], kv_cache, tables[r], contexts[r], chain_tree.mask[r, i])
            for r in range(num_reqs)
            for i in range(chain)
        ]
    out["tree_chain"] = _errors(list(_tree(q, kv_cache, tables, chain_tree, contexts)), want)
    n = budget + 1
    qb = torch.randn(num_reqs * n, HEADS, HEAD, device=DEVICE, generator=gen).to(DTYPE)
    want = [
        _reference(qb[r * n + i], kv_cache, tables[r], contexts[r], tree.mask[r, i])
        for r in range(num_reqs)
        for i in range(n)
    ]
    out[f"tree_{budget}"] = _errors(list(_tree(qb, kv_cache, tables, tree, contexts)), want)
    shares = _tree(qb, kv_cache, tables, tree, contexts, splits=4)
    out[f"tree_{budget}_4shares"] = _errors(list(shares), want)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="64,512,2048,4096")
    parser.add_argument("--budget", type=int, default=63)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE = args.device
    DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = {}
    for seed in range(args.seeds):
        for name, (mean, peak) in measure(contexts, args.budget, seed).items():
            acc = rows.setdefault(name, [0.0, 0.0])
            acc[0] += mean / args.seeds
            acc[1] = max(acc[1], peak)
    print("| kernel | mean rel. error | max rel. error |\n|---|---:|---:|")
    for name, (mean, peak) in rows.items():
        print(f"| {name} | {mean:.2e} | {peak:.2e} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"contexts": contexts, "errors": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
