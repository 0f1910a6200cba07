"""Gated DeltaNet (linear-attention) layers of hybrid targets (Qwen3.5 / 3.6) on vLLM's CPU build.

vLLM's CPU GDN op (``vllm::cpu_gdn_attention_core``) runs bf16 only and verifies chains: its
spec path gives token t the state after token t-1, which inside a tree is a sibling's. This
module replaces the op's body where it cannot serve:

* every step of a DDTree engine: prefill and decode rows as chains, tree rows with
  :func:`ddtree.gdn.tree_conv1d` / :func:`ddtree.gdn.tree_gdn` (each node continues its
  parent), nothing written during the verify; after the walk, :func:`commit` replays each
  accepted path (:func:`ddtree.gdn.replay_path`) into the request's state;
* float32 in any other engine (vLLM refuses it: "CPU GDN attention requires BF16"), its
  chain verify as vLLM's CPU kernels do it, so that the CPU tests compare DDTree with
  no-spec and with vLLM's DFlash chain at float32.

Where a request's state lives, in a DDTree engine: its first state block
(``block_table[:, 0]``, the slot vLLM's prefill writes) and the first ``W-1`` columns of that
block's conv buffer, whatever vLLM's ``num_accepted_tokens`` says; the per-draft state blocks
and conv columns of vLLM's chain rollback are not allocated for DDTree engines. The ssm cache
is read as vLLM's CPU kernels read it, ``[slots, HV, K, V]`` (``ops/cpu/gdn_attention.py:
_ssm_state_view``), the transpose of :mod:`ddtree.gdn`'s ``[HV, V, K]``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ddtree import gdn


@dataclass
class PendingCommit:
    """One layer's tree rows of this step, kept for the commit after the walk."""

    layer: object  # vLLM's GatedDeltaNet layer
    members: list[int]  # member index (row of engine.batch) of each tree request
    slots: list[int]  # its state block
    stashes: list[gdn.GDNStash]  # its nodes' recurrence and conv inputs [1, N, ...]
    states: list[torch.Tensor]  # [1, HV, V, K] before its root
    conv_states: list[torch.Tensor]  # [1, C, W-1] before its root


def install() -> None:
    """Route vLLM's CPU GDN op through :func:`gdn_core` (before any model registers the op)."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    from ddtree.vllm_plugin.hooks import replace

    if gdn_attention._CPU_GDN_ATTENTION_OPS_REGISTERED:
        raise RuntimeError(
            "ddtree: vLLM's CPU GDN op was registered before the ddtree plugin loaded"
        )
    vllm_core = gdn_attention.cpu_gdn_attention_core

    def cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name) -> None:
        from vllm.forward_context import get_forward_context
        from vllm.utils.torch_utils import _resolve_layer_name

        context = get_forward_context()
        layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
        engine = getattr(layer, "ddtree_engine", None)
        metadata = context.attn_metadata
        if metadata is None or (engine is None and mixed_qkv.dtype != torch.float32):
            return vllm_core(mixed_qkv, b, a, core_attn_out, layer_name)
        gdn_core(layer, metadata[layer.prefix], mixed_qkv, b, a, core_attn_out, engine)

    _keep_float32_conv_weights()

    # torch infers the custom op's schema from the signature: vLLM's, annotations resolved.
    cpu_gdn_attention_core.__signature__ = inspect.signature(vllm_core, eval_str=True)
    replace(gdn_attention, "cpu_gdn_attention_core", cpu_gdn_attention_core)


def patch_state_allocation() -> None:
    """A DDTree engine keeps one state per request: vLLM's chain rollback would allocate
    ``1 + B`` state blocks and ``W - 1 + B`` conv columns per request and layer (at Qwen3.6-27B
    shapes about 144 MiB per block), none of which the tree path reads."""
    import dataclasses

    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from ddtree.vllm_plugin.config import options_of
    from ddtree.vllm_plugin.hooks import wrap

    @wrap(QwenGatedDeltaNetAttention, "__init__")
    def __init__(original, self, config, vllm_config, *args, **kwargs):
        original(self, config, vllm_config, *args, **kwargs)
        if options_of(vllm_config.speculative_config) is not None:
            self.num_spec = 0  # the conv state keeps W - 1 columns (get_state_shape)

    @wrap(QwenGatedDeltaNetAttention, "get_kv_cache_spec")
    def get_kv_cache_spec(original, self, vllm_config):
        spec = original(self, vllm_config)
        if options_of(vllm_config.speculative_config) is None:
            return spec
        return dataclasses.replace(spec, num_speculative_blocks=0)


def _keep_float32_conv_weights() -> None:
    """On CPUs with AMX tiles vLLM prepacks every conv weight at load with a bf16-only kernel
    (``causal_conv1d_weight_pack``: "not implemented for 'Float'"); a float32 GDN conv weight
    is left as it is, since :func:`gdn_core` serves float32 GDN layers and reads it directly."""
    from vllm.model_executor.layers import utils

    from ddtree.vllm_plugin.hooks import wrap

    @wrap(utils, "dispatch_cpu_unquantized_gemm")
    def dispatch_cpu_unquantized_gemm(original, layer, remove_weight):
        weight = layer.weight
        if weight.ndim != 2 and not weight.is_meta and weight.dtype == torch.float32:
            return None  # a conv weight (GDN's [C, 1, W]), float32
        return original(layer, remove_weight)


def check_layer(name: str, layer) -> None:
    """Refuse a linear-attention layer the tree verify is not wired for."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.platforms import current_platform

    if not isinstance(layer, QwenGatedDeltaNetAttention):
        raise NotImplementedError(
            f"ddtree: target layer {name} is a {type(layer).__name__}; of the linear-attention "
            "layers only Qwen3.5 / Qwen3.6 Gated DeltaNet (QwenGatedDeltaNetAttention) is supported"
        )
    if not current_platform.is_cpu():
        raise NotImplementedError(
            f"ddtree: on CUDA the tree verify of Gated DeltaNet layers ({name}) runs on the V2 "
            "model runner only (unset VLLM_USE_V2_MODEL_RUNNER=0)"
        )


def conv_weight(layer) -> torch.Tensor:
    """``[C, W]`` (vLLM stores ``[C, 1, W]``; AMX builds keep an unpacked copy)."""
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if weight is None:
        weight = layer.conv1d.weight
    return weight.reshape(weight.shape[0], weight.shape[-1])


def conv_cache(layer) -> torch.Tensor:
    """``[slots, C, state_len]`` view of the layer's conv cache (either of vLLM's layouts)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv = layer.kv_cache[0]
    return conv if is_conv_state_dim_first() else conv.transpose(-1, -2)


def caches(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(conv [slots, C, state_len], ssm [slots, HV, K, V])`` views of the layer's caches as
    vLLM's CPU kernels read them."""
    ssm = layer.kv_cache[1]
    slots, heads, dim_v, dim_k = ssm.shape
    return conv_cache(layer), ssm.view(slots, heads, dim_k, dim_v)


def gdn_core(layer, md, mixed_qkv, b, a, core_attn_out, engine) -> None:
    """The GDN core over the step's token rows: non-spec requests as chains from their state
    (prefill / decode), DDTree tree requests as trees; outputs into ``core_attn_out [T, HV, V]``."""
    if md.num_actual_tokens == 0:
        return
    conv, ssm = caches(layer)
    weight = conv_weight(layer)
    width = weight.shape[1]
    device = mixed_qkv.device

    def rows_of(index, start, end):
        span = torch.arange(start, end, device=device)
        return span if index is None else index.long().index_select(0, span)

    def features(rows):
        x = mixed_qkv.index_select(0, rows)  # [n, C]
        return x, a.index_select(0, rows), b.index_select(0, rows)

    # Requests without drafts: a chain over their rows from their state block.
    if md.non_spec_query_start_loc is not None:
        starts = md.non_spec_query_start_loc.tolist()
        slots = md.non_spec_state_indices_tensor.tolist()
        initial = None if md.has_initial_state is None else md.has_initial_state.tolist()
        index = md.non_spec_token_indx if md.spec_sequence_masks is not None else None
        for r in range(len(starts) - 1):
            if starts[r + 1] == starts[r]:
                continue
            rows = rows_of(index, starts[r], starts[r + 1])
            has_state = True if initial is None else bool(initial[r])
            out = _chain(layer, conv, ssm, weight, slots[r], has_state, *features(rows))
            core_attn_out.index_copy_(0, rows, out.to(core_attn_out.dtype))

    if md.spec_sequence_masks is None:
        return
    if engine is None:  # vLLM's own chain (e.g. DFlash) at float32
        _chain_verify(layer, md, conv, ssm, weight, rows_of, features, core_attn_out)
        return
    tb = engine.batch
    member_of_root = {} if tb is None else {r: m for m, r in enumerate(tb.rows[:, 0].tolist())}
    starts = md.spec_query_start_loc.tolist()
    slot0 = md.spec_state_indices_tensor[:, 0].tolist()
    index = md.spec_token_indx if (md.num_prefills or md.num_decodes) else None
    pending = PendingCommit(layer, [], [], [], [], [])
    for i in range(md.num_spec_decodes):
        rows = rows_of(index, starts[i], starts[i + 1])
        member = member_of_root.get(int(rows[0]))
        if member is None:  # a decode without drafts in a speculative step: a plain step
            out = _chain(layer, conv, ssm, weight, slot0[i], True, *features(rows))
            core_attn_out.index_copy_(0, rows, out.to(core_attn_out.dtype))
            continue
        parents = tb.tree.parents[member, : rows.numel()][None]  # [1, N]
        x, a_rows, b_rows = features(rows)
        conv_state = conv[slot0[i], :, : width - 1][None].clone()  # [1, C, W-1]
        state = ssm[slot0[i]].transpose(-1, -2)[None].clone()  # [1, HV, V, K]
        q, k, v, g, beta = _inputs(layer, weight, x, a_rows, b_rows, conv_state, parents)
        out, _ = gdn.tree_gdn(q, k, v, g, beta, state, parents)
        core_attn_out.index_copy_(0, rows, out[0].to(core_attn_out.dtype))
        pending.members.append(member)
        pending.slots.append(slot0[i])
        pending.stashes.append(gdn.GDNStash(k, v, g, beta, x[None], parents))
        pending.states.append(state)
        pending.conv_states.append(conv_state)
    engine.gdn_pending.append(pending)


def commit(engine, path: torch.Tensor) -> None:
    """After the walk: each tree request's state and conv columns after its accepted path
    (``path`` long ``[R, L]``, accepted slots from the root, -1 padded)."""
    for pending in engine.gdn_pending:
        conv, ssm = caches(pending.layer)
        for member, slot, stash, state, conv_state in zip(
            pending.members,
            pending.slots,
            pending.stashes,
            pending.states,
            pending.conv_states,
            strict=True,
        ):
            accepted = path[member : member + 1, : stash.parents.shape[1]]
            new_state, new_conv = gdn.replay_path(stash, accepted, state, conv_state)
            ssm[slot].copy_(new_state[0].transpose(-1, -2))
            conv[slot, :, : new_conv.shape[-1]].copy_(new_conv[0])
    engine.gdn_pending.clear()


def _chain_verify(layer, md, conv, ssm, weight, rows_of, features, core_attn_out) -> None:
    """vLLM's chain verify, as its CPU kernels do it (``_spec_forward``): request i resumes
    from state block ``num_accepted - 1`` and conv columns ``num_accepted - 1 ..``, keeps the
    state after its t-th token in block t, and rolls its conv buffer by the accepted count."""
    width = weight.shape[1]
    state_len = conv.shape[-1]
    starts = md.spec_query_start_loc.tolist()
    blocks = md.spec_state_indices_tensor.tolist()
    accepted = md.num_accepted_tokens.tolist()
    index = md.spec_token_indx if (md.num_prefills or md.num_decodes) else None
    for i in range(md.num_spec_decodes):
        rows = rows_of(index, starts[i], starts[i + 1])
        x, a_rows, b_rows = features(rows)
        n, offset = x.shape[0], accepted[i] - 1
        buffer = conv[blocks[i][0]]  # [C, state_len]
        conv_state = buffer[:, offset : offset + width - 1][None]
        chain = torch.arange(-1, n - 1, device=x.device)[None]
        q, k, v, g, beta = _inputs(layer, weight, x, a_rows, b_rows, conv_state, chain)
        state = ssm[blocks[i][offset]].transpose(-1, -2)[None]
        out, states = gdn.chain_gdn(q, k, v, g, beta, state)
        for t in range(n):
            ssm[blocks[i][t]].copy_(states[0, t].transpose(-1, -2))
        kept = buffer[:, offset + 1 : offset + 1 + state_len - n]
        buffer.copy_(torch.cat([kept, x.t().to(buffer.dtype)], -1))
        core_attn_out.index_copy_(0, rows, out[0].to(core_attn_out.dtype))


def _chain(layer, conv, ssm, weight, slot, has_state, x, a_rows, b_rows) -> torch.Tensor:
    """One request's rows as a chain from its state block; the block updated in place."""
    width = weight.shape[1]
    n = x.shape[0]
    conv_state = conv[slot, :, : width - 1]  # [C, W-1]
    if not has_state:
        conv_state = torch.zeros_like(conv_state)
    parents = torch.arange(-1, n - 1, device=x.device)[None]  # a chain is a tree
    q, k, v, g, beta = _inputs(layer, weight, x, a_rows, b_rows, conv_state[None], parents)
    state = ssm[slot].transpose(-1, -2)[None] if has_state else None
    out, states = gdn.chain_gdn(q, k, v, g, beta, state)
    history = torch.cat([conv_state, x.t().to(conv_state.dtype)], -1)  # [C, W-1+n]
    conv[slot, :, : width - 1].copy_(history[:, -(width - 1) :])
    ssm[slot].copy_(states[0, -1].transpose(-1, -2))
    return out[0]


def _inputs(layer, weight, x, a_rows, b_rows, conv_state, parents):
    """The recurrence's inputs of rows ``x [n, C]`` with parents ``parents [1, n]``: the conv
    over each row's ancestors (``conv_state [1, C, W-1]`` above the root), then
    ``(q, k, v, g [1, n, HV], beta [1, n, HV])``."""
    x_conv = gdn.tree_conv1d(
        x[None], conv_state, parents, weight, layer.conv1d.bias, layer.activation
    )
    q, k, v = layer.rearrange_mixed_qkv(x_conv[0].to(x.dtype))
    g, beta = gdn.gdn_gating(layer.A_log, a_rows, b_rows, layer.dt_bias)
    return q, k, v, g[None], beta[None]
