"""Tree GDN kernel (``ddtree.kernels.gdn_tree``) vs vLLM's chain kernel at Qwen3.6-27B GDN shapes
(GPU): time per layer call, and bf16 error against a float64 reference.

Shapes: 16 key heads, 48 value heads, head size 128 (Qwen3.6-27B's linear-attention layers),
bf16 q/k/v, float32 state. For T tokens per request (T = 1 + B tree slots, or a T-token chain):

- ``tree_ms``: ``tree_gdn_fused`` on a DDTree tree of budget T - 1 (depth 15, random drafts,
  the forced chain as engines build it), its default work split; ``variants``: the same with
  other runs / value tiles / warps (``run_nodes`` nodes per program, ``block_v``, ``warps``);
- ``chain_ms``: vLLM's ``fused_recurrent_gated_delta_rule`` on a chain of T tokens as a DFlash
  chain's verify calls it per GDN layer (varlen, every token's state written to its own slot);
- ``tree_err`` / ``chain_err``: max |out - float64 reference| / RMS(reference) (the tree's
  reference: ``ddtree.gdn.tree_gdn``; the chain's: ``ddtree.gdn.chain_gdn``), at batch 1.

- ``layer_tree_ms`` / ``layer_chain_ms``: a whole GDN layer core per step, as the engines run
  it (:func:`measure_layer`): DDTree's V2 verify + commit vs vLLM's chain verify;
  ``layout_ms``: DDTree's tree layout, made once per forward for all GDN layers.

    python benchmarks/gdn_tree.py --out gdn_tree.json
"""

from __future__ import annotations

import argparse
import functools
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
    from ddtree.kernels.gdn_tree import default_run_nodes, tree_gdn_fused, tree_runs

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

    # the engine's split, made once per step for all layers: not part of a layer's time
    default = tree_runs(ancestors, depths, default_run_nodes(batch, tokens, HEADS_V * DIM // 32))

    def tree(**variant):
        variant.setdefault("runs", default)
        tree_gdn_fused(
            q, k, v, g, beta, state, ancestors, depths, use_qk_l2norm=True, out=out, **variant
        )

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

    row = {"batch": batch, "tokens": tokens, "run_nodes": default.run_nodes}
    row["tree_ms"] = timed(tree, "cuda", 20) * 1e3
    row["variants"] = {}
    for run_nodes in (1, 4, 8):
        runs = tree_runs(ancestors, depths, run_nodes)
        for block_v, warps in ((32, 4), (16, 4), (32, 8)):
            name = f"run{run_nodes}_bv{block_v}_w{warps}"
            variant = dict(runs=runs, block_v=block_v, num_warps=warps)
            run = functools.partial(tree, **variant)
            row["variants"][name] = timed(run, "cuda", 20) * 1e3
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


def measure_layer(batch: int, tokens: int, seed: int = 0) -> dict:
    """One GDN layer's core per step, each side as one CUDA graph replay at 27B shapes:
    ``layer_tree_ms`` = DDTree's V2 verify (``TreeGDN._tree_rows``: gathers, gating, tree conv,
    tree recurrence, rows back) + its commit after the walk (a 16-deep path replayed);
    ``layer_chain_ms`` = vLLM's chain verify core (``causal_conv1d_update`` with one conv
    column per draft, then ``fused_sigmoid_gating_delta_rule_update`` writing every token's
    state to its own block), as ``QwenGatedDeltaNetAttention._forward_core`` runs it."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )

    import ddtree
    from ddtree.vllm_plugin.v2.engine import TreeTables
    from ddtree.vllm_plugin.v2.gdn import TreeGDN

    gen = torch.Generator(device="cuda").manual_seed(seed)
    cuda = torch.device("cuda")

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device=cuda, generator=gen) * scale).to(dtype)

    width, key, value = 4, HEADS * DIM, HEADS_V * DIM
    channels, num_tokens = 2 * key + value, batch * tokens
    depth = 15
    tables = TreeTables(batch, tokens - 1, depth, cuda)
    logits = rand(batch, depth, 5000, dtype=torch.float32, scale=3)
    trees = ddtree.build_tree(logits, tokens - 1, chain_seed=True)  # as engines build them
    tables.store(torch.arange(batch, device=cuda), trees)
    tables.tree_rows[:batch] = torch.arange(batch, device=cuda, dtype=torch.int32)
    blocks = 1 + batch * tokens  # the chain's per-token blocks; DDTree reads blocks 1..batch
    layer = SimpleNamespace(
        prefix="layer", conv1d=SimpleNamespace(weight=rand(channels, 1, width, scale=0.3),
                                               bias=None),
        activation="silu", A_log=rand(HEADS_V, dtype=torch.float32, scale=0.3),
        dt_bias=rand(HEADS_V, dtype=torch.float32, scale=0.3), num_v_heads=HEADS_V, tp_size=1,
        key_dim=key, value_dim=value, head_k_dim=DIM, head_v_dim=DIM,
        kv_cache=[rand(blocks, width - 1, channels),
                  rand(blocks, HEADS_V, DIM, DIM, dtype=torch.float32, scale=0.1)],
    )  # fmt: skip
    trees_gdn = TreeGDN(tables, [layer])
    qsl = torch.arange(0, num_tokens + 1, tokens, device=cuda, dtype=torch.int32)
    trees_gdn.query_start_loc = qsl
    trees_gdn.layers["layer"].block_table = torch.arange(
        1, batch + 1, device=cuda, dtype=torch.int32
    )[:, None]
    mixed_qkv = rand(num_tokens, channels)
    a, b = rand(num_tokens, HEADS_V), rand(num_tokens, HEADS_V)
    out = torch.zeros(num_tokens, HEADS_V, DIM, device=cuda, dtype=torch.bfloat16)
    node = trees.depths.argmax(1)  # a deepest node per request, its root path accepted
    rows = torch.arange(batch, device=cuda)
    up, deep = trees.ancestors[rows, node], trees.depths[rows, node][:, None]
    step = torch.arange(up.shape[1], device=cuda)
    path = torch.where(step <= deep, up.gather(1, (deep - step).clamp(min=0)), -1)
    active = torch.ones(batch, dtype=torch.bool, device=cuda)

    # The step's tree layout is made once per forward by the first GDN layer and read by the
    # other 47 (27B): made here once, timed apart (layout_ms); the layer reads it.
    trees_gdn._layout(layer, num_tokens, batch)
    trees_gdn.first_layer = None

    def layout():
        trees_gdn.first_layer = "layer"
        trees_gdn._layout(layer, num_tokens, batch)
        trees_gdn.first_layer = None

    def tree():
        trees_gdn._tree_rows(layer, num_tokens, batch, mixed_qkv, b, a, out)
        trees_gdn.commit(path, active)

    # vLLM's chain: conv state of W - 1 + drafts columns, a state block per token.
    conv_chain = rand(blocks, width - 1 + tokens - 1, channels).transpose(1, 2)
    ssm_chain = layer.kv_cache[1]
    spec_blocks = torch.arange(1, blocks, device=cuda, dtype=torch.int32).view(batch, tokens)
    accepted = torch.ones(batch, dtype=torch.int32, device=cuda)
    weight = layer.conv1d.weight.view(channels, width)

    def chain():
        x = causal_conv1d_update(
            mixed_qkv, conv_chain, weight, None, "silu", conv_state_indices=spec_blocks[:, 0],
            num_accepted_tokens=accepted, query_start_loc=qsl, max_query_len=tokens,
        )  # fmt: skip
        q, k, v = (t.reshape(1, num_tokens, -1, DIM) for t in x.split([key, key, value], -1))
        fused_sigmoid_gating_delta_rule_update(
            A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias, q=q, k=k, v=v,
            initial_state=ssm_chain, inplace_final_state=True, cu_seqlens=qsl,
            ssm_state_indices=spec_blocks, num_accepted_tokens=accepted,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    row = {"batch": batch, "tokens": tokens}
    for name, fn in (("layer_tree_ms", tree), ("layer_chain_ms", chain), ("layout_ms", layout)):
        try:
            fn()  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            row[name] = timed(graph.replay, "cuda", 20) * 1e3
        except Exception as err:  # noqa: BLE001 - one failed side must not hide the other
            row[name] = None
            row[name.replace("_ms", "_error")] = f"{type(err).__name__}: {err}"[:300]
    return row


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _ms(x: float | None) -> str:
    return "failed" if x is None else f"{x:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,65,129,256")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows, skipped = [], []
    for b in (int(x) for x in args.batches.split(",")):
        for t in (int(x) for x in args.tokens.split(",")):
            try:  # the chain's per-token state pool outgrows an 80 GB card at batch 32, T=256
                rows.append({**measure(b, t), **measure_layer(b, t)})
            except torch.OutOfMemoryError:
                skipped.append(f"batch {b} T {t}")
                torch.cuda.empty_cache()
    print(
        "| batch | T | tree ms | chain ms | tree err | chain err | layer: DDTree verify+commit "
        "ms | layer: chain verify ms | DDTree layout ms (once per forward) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['batch']} | {r['tokens']} | {r['tree_ms']:.3f} | {r['chain_ms']:.3f} | "
            f"{_fmt(r['tree_err'])} | {_fmt(r['chain_err'])} | {_ms(r['layer_tree_ms'])} | "
            f"{_ms(r['layer_chain_ms'])} | {_ms(r['layout_ms'])} |"
        )
    if skipped:
        print("skipped (out of GPU memory): " + ", ".join(skipped))
    names = list(rows[0]["variants"])
    print(f"\nTree kernel variants, ms\n| batch | T | {' | '.join(names)} |")
    print("|---:|---:|" + "---:|" * len(names))
    for r in rows:
        cells = " | ".join(f"{r['variants'][n]:.3f}" for n in names)
        print(f"| {r['batch']} | {r['tokens']} | {cells} |")
    for r in rows:
        for key in ("layer_tree_error", "layer_chain_error"):
            if key in r:
                print(f"batch {r['batch']} T {r['tokens']} {key}: {r[key]}")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
