"""Gated DeltaNet layers of hybrid targets (Qwen3.5 / Qwen3.6) on the V2 model runner.

vLLM's chain verify gives draft token t the state after token t-1 and keeps one state block
per draft token; inside a tree that state is a sibling's, and at B nodes the blocks would cost
``1 + B`` states per request and layer. A DDTree engine keeps each request's one state block
(``block_table[:, 0]``; ``ddtree.vllm_plugin.gdn.patch_state_allocation`` drops the others)
and, per GDN layer and step:

* verify: each tree node's conv window over its ancestors (``ddtree.kernels.gdn_tree.
  tree_conv_fused``) and its root path's recurrence read from the block (``tree_gdn_fused``);
  nothing is written to the caches. Rows of requests without a tree (prefill chunks in a mixed
  step) go through vLLM's own path with the tree rows taken out of its metadata;
* stash: the nodes' conv inputs, ``g`` and ``beta`` in persistent ``[R, 1 + B, ...]`` buffers
  (allocated with the model, before vLLM sizes the KV cache), one launch (``stash_nodes``);
  the tree kernel writes each node's output into its token row of vLLM's output: three
  launches per layer in all;
* commit, after the walk: the accepted path's conv and the conv columns after it
  (``path_conv_fused``) and its recurrence (``replay_path_fused``) into the block.

Verify and commit use fixed shapes and device values only: the verify graphs and the tree
sampler's tail graph capture them. Tree layout: batch row r verifies ``tables.tree_rows[r]``'s
tree (-1: none) over rows ``query_start_loc[r] ..`` of the step, as the attention hook reads it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree.vllm_plugin.gdn import conv_cache, conv_weight
from ddtree.vllm_plugin.v2.engine import TreeTables

GDN_BLOCK_V = 32  # value rows per program of the tree recurrence kernel

log = logging.getLogger("vllm.ddtree")


@dataclass
class GDNLayer:
    """One GDN layer's stash and where its request states live."""

    layer: Any  # vLLM's QwenGatedDeltaNetAttention
    conv_input: torch.Tensor  # [R, Q, C] the step's tree nodes' conv inputs (model dtype)
    g: torch.Tensor  # [R, Q, HV] float32 log-decay
    beta: torch.Tensor  # [R, Q, HV] float32
    block_table: torch.Tensor | None = None  # [max_reqs, blocks] batch order; col 0: state


def gdn_layers(model) -> list:
    """The target's Gated DeltaNet layers (vLLM's ``QwenGatedDeltaNetAttention``)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    return [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]


def stash_bytes(layers: list, rows: int, slots: int) -> int:
    """What the stashes of ``layers`` take for ``rows`` requests of ``slots`` tree slots."""
    total = 0
    for layer in layers:
        channels = layer.conv1d.weight.shape[0]
        heads_v = layer.num_v_heads // layer.tp_size
        total += rows * slots * (channels * layer.conv1d.weight.element_size() + 8 * heads_v)
    return total


@dataclass
class TreeLayout:
    """Where a verify step's tree nodes are (the same for every GDN layer of the step)."""

    num_tokens: int
    num_reqs: int
    has_tree: torch.Tensor  # [R] bool: the batch row verifies a tree
    rows: torch.Tensor  # [R, Q] token row of each slot (clamped for padding)
    depths: torch.Tensor  # [R, Q] node depth, 0 for padding
    ancestors: torch.Tensor  # [R, Q, D+1] ancestor slots (padding: itself)
    token_rows: torch.Tensor  # [R, Q] token row of each tree node, -1 for padding slots
    runs: Any  # ddtree.kernels.gdn_tree.TreeRuns: the recurrence kernel's work split
    cells: dict = field(default_factory=dict)  # id(block table) -> [R] state blocks


class TreeGDN:
    """The GDN half of a V2 DDTree engine: verify hook, stash and commit of every GDN layer."""

    def __init__(self, tables: TreeTables, layers: list):
        self.tables = tables
        rows, slots = tables.tree_rows.shape[0], tables.tokens.shape[1]
        self.layers: dict[str, GDNLayer] = {}
        for layer in layers:
            weight = layer.conv1d.weight
            channels, heads_v = weight.shape[0], layer.num_v_heads // layer.tp_size
            device = weight.device
            self.layers[layer.prefix] = GDNLayer(
                layer,
                torch.zeros(rows, slots, channels, dtype=weight.dtype, device=device),
                torch.zeros(rows, slots, heads_v, dtype=torch.float32, device=device),
                torch.zeros(rows, slots, heads_v, dtype=torch.float32, device=device),
            )
            layer.ddtree_gdn = self
        self.first_layer = next(iter(self.layers), None)  # the model's first GDN layer
        self.layout: TreeLayout | None = None  # the current forward's, from the first layer
        self.query_start_loc: torch.Tensor | None = None  # the runner's persistent buffer
        self.num_reqs = 0  # the step's requests (read in mixed steps, which run eagerly)
        log.info(
            "ddtree: %d GDN layers, tree stashes of %.1f MiB (%d requests x %d slots)",
            len(layers), stash_bytes(layers, rows, slots) / 2**20, rows, slots,
        )  # fmt: skip

    def bind(self, runner) -> None:
        """After the KV cache exists: each layer's block table (batch order, the runner's
        persistent one) and the runner's ``query_start_loc`` buffer."""
        from vllm.v1.kv_cache_interface import MambaSpec

        self.query_start_loc = runner.input_buffers.query_start_loc
        tables = runner.block_tables.input_block_tables
        for group, spec in enumerate(runner.kv_cache_config.kv_cache_groups):
            if not isinstance(spec.kv_cache_spec, MambaSpec):
                continue
            for name in spec.layer_names:
                if name in self.layers:
                    self.layers[name].block_table = tables[group]
        unbound = [name for name, entry in self.layers.items() if entry.block_table is None]
        if unbound:
            raise RuntimeError(f"ddtree: GDN layers without a state cache group: {unbound}")

    # --- verify --------------------------------------------------------------------------

    def forward(self, layer, original, mixed_qkv, b, a, core_attn_out) -> None:
        """vLLM's ``_forward_core`` of a bound layer: tree rows here, other rows by vLLM."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if context.attn_metadata is None:  # vLLM's warm-up of its prefill kernels
            return original(mixed_qkv, b, a, core_attn_out)
        md = context.attn_metadata[layer.prefix]
        if md.spec_sequence_masks is None:  # no request verifies a tree
            return original(mixed_qkv, b, a, core_attn_out)
        mixed = md.num_prefills > 0 or md.num_decodes > 0
        if mixed:
            self._other_rows(context, layer, original, md, mixed_qkv, b, a, core_attn_out)
            num_reqs = self.num_reqs
        else:  # every (padded) request verifies: vLLM's batch size
            num_reqs = md.spec_state_indices_tensor.shape[0]
        self._tree_rows(layer, md.num_actual_tokens, num_reqs, mixed_qkv, b, a, core_attn_out)

    def _other_rows(self, context, layer, original, md, mixed_qkv, b, a, core_attn_out) -> None:
        """Rows of requests without a tree through vLLM's own path: its metadata with the
        spec part taken out (its non-spec fields already describe exactly these rows)."""
        rows = md.non_spec_token_indx.long()
        count = md.num_prefill_tokens + md.num_decode_tokens
        plain = dataclasses.replace(
            md,
            num_spec_decodes=0,
            num_spec_decode_tokens=0,
            num_actual_tokens=count,
            spec_query_start_loc=None,
            spec_state_indices_tensor=None,
            spec_sequence_masks=None,
            spec_token_indx=None,
            non_spec_token_indx=None,
            num_accepted_tokens=None,
        )
        out = torch.zeros(
            (count, *core_attn_out.shape[1:]), dtype=core_attn_out.dtype, device=rows.device
        )
        context.attn_metadata[layer.prefix] = plain
        try:
            original(mixed_qkv[rows], b[rows], a[rows], out)
        finally:
            context.attn_metadata[layer.prefix] = md
        core_attn_out.index_copy_(0, rows, out)

    def _layout(self, layer, num_tokens: int, num_reqs: int) -> TreeLayout:
        """The step's tree layout, computed in its first GDN layer and read by the others (the
        same for every layer of a forward; 48 layers at 27B). The first layer recomputes it in
        every forward, so a captured graph records it and a replay never reads a layout from
        another run."""
        if layer.prefix != self.first_layer:
            cached = self.layout
            if cached is None or (cached.num_tokens, cached.num_reqs) != (num_tokens, num_reqs):
                raise RuntimeError(
                    f"ddtree: GDN layer {layer.prefix} ran before the first GDN layer "
                    f"{self.first_layer} of its forward"
                )
            return cached
        from ddtree.kernels.gdn_tree import default_run_nodes, tree_runs

        tables = self.tables
        width = tables.tokens.shape[1]  # Q = 1 + B slots per request
        device = tables.tokens.device
        qsl = self.query_start_loc[: num_reqs + 1].long()
        start, count = qsl[:-1], qsl[1:] - qsl[:-1]  # [R]
        tree = tables.tree_rows[:num_reqs].long()  # [R]: tree-table row, -1: none
        slot = torch.arange(width, device=device)
        valid = (tree[:, None] >= 0) & (slot < count[:, None])  # [R, Q]
        table = tree.clamp(min=0)
        # Slots past what vLLM scheduled are padding: depth 0, their own ancestor.
        depths = torch.where(valid, tables.depths[table], 0)
        ancestors = torch.where(valid[..., None], tables.ancestors[table], slot[:, None])
        heads_v = layer.num_v_heads // layer.tp_size
        programs = heads_v * -(-layer.head_v_dim // GDN_BLOCK_V)  # per node and run
        self.layout = TreeLayout(
            num_tokens,
            num_reqs,
            has_tree=tree >= 0,
            rows=(start[:, None] + slot).clamp(max=num_tokens - 1),
            depths=depths,
            ancestors=ancestors,
            token_rows=torch.where(valid, start[:, None] + slot, -1),
            runs=tree_runs(ancestors, depths, default_run_nodes(num_reqs, width, programs)),
        )
        return self.layout

    def _tree_rows(self, layer, num_tokens, num_reqs, mixed_qkv, b, a, core_attn_out) -> None:
        from ddtree.kernels.gdn_tree import stash_nodes, tree_conv_fused, tree_gdn_fused

        entry = self.layers[layer.prefix]
        step = self._layout(layer, num_tokens, num_reqs)
        # The nodes' conv inputs and gating, kept for the commit: [R, Q, C], [R, Q, HV].
        x, g, beta = (t[:num_reqs] for t in (entry.conv_input, entry.g, entry.beta))
        mixed_qkv, a, b = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (mixed_qkv, a, b)
        )  # the stash kernel reads rows with a unit last stride
        stash_nodes(mixed_qkv, a, b, layer.A_log, layer.dt_bias, step.rows, x, g, beta)
        conv, ssm = caches(layer)
        if id(entry.block_table) not in step.cells:  # once per KV-cache group and forward
            step.cells[id(entry.block_table)] = state_blocks(entry.block_table, step.has_tree)
        cache_slots = step.cells[id(entry.block_table)]  # [R]
        x_conv = tree_conv_fused(
            x, conv, cache_slots, step.ancestors, step.depths, conv_weight(layer),
            layer.conv1d.bias, layer.activation,
        )  # fmt: skip
        q, k, v = split_qkv(layer, x_conv)
        tree_gdn_fused(  # each node's output straight into its token row
            q, k, v, g, beta, ssm, step.ancestors, step.depths, state_slots=cache_slots,
            runs=step.runs, block_v=GDN_BLOCK_V, out=core_attn_out, token_rows=step.token_rows,
        )  # fmt: skip

    # --- commit --------------------------------------------------------------------------

    def commit(self, path: torch.Tensor, active: torch.Tensor) -> None:
        """After the walk: each tree request's state block and conv columns after its accepted
        path (``path [R, D+1]`` slots from the root, -1 padded; ``active [R]``), per GDN layer
        the path's conv and new conv columns in one launch (``path_conv_fused``), then the
        replay (``replay_path_fused``). Other requests' blocks are rewritten with what they
        hold (the replay) or left alone (the conv)."""
        from ddtree.kernels.gdn_tree import path_conv_fused, replay_path_fused

        num_reqs, steps = path.shape
        lengths = torch.where(active, (path >= 0).sum(1), 0)  # [R]
        step = torch.arange(steps, device=path.device)
        local = torch.where(step < lengths[:, None], step, -1)  # [R, L]: the path, in order
        nodes = path.clamp(min=0)  # [R, L]
        cells = {}  # one state-block lookup per block table (per KV-cache group)
        for entry in self.layers.values():
            layer = entry.layer
            if id(entry.block_table) not in cells:
                cells[id(entry.block_table)] = state_blocks(entry.block_table, active)
            cache_slots = cells[id(entry.block_table)]
            conv, ssm = caches(layer)
            x_conv = path_conv_fused(
                entry.conv_input[:num_reqs], conv, cache_slots, path, lengths,
                conv_weight(layer), layer.conv1d.bias, layer.activation,
            )  # fmt: skip  # [R, L, C]
            _, k, v = split_qkv(layer, x_conv)
            # k, v at path positions (x_conv), g, beta at the path's nodes (the stash)
            replay_path_fused(
                k,
                v,
                entry.g[:num_reqs],
                entry.beta[:num_reqs],
                ssm,
                cache_slots,
                local,
                gate_at=nodes,
            )


def state_blocks(block_table: torch.Tensor, has_tree: torch.Tensor) -> torch.Tensor:
    """Each batch row's state block (``block_table [max_reqs, blocks]`` column 0) where it
    verifies a tree (``has_tree [R]``; R may exceed max_reqs: the sampler pads to a power of
    two), else vLLM's null block 0, rewritten with its own values: a stale row may still name
    a live request's block, which two writers would race on."""
    rows = torch.arange(has_tree.shape[0], device=has_tree.device)
    return torch.where(has_tree, block_table[rows.clamp(max=block_table.shape[0] - 1), 0], 0).long()


def caches(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(conv [S, C, state_len], ssm [S, HV, V, K])`` views of a layer's CUDA caches (the ssm
    cache as vLLM's CUDA kernels read it)."""
    return conv_cache(layer), layer.kv_cache[1]


def split_qkv(layer, x_conv: torch.Tensor):
    """``x_conv [R, Q, C]`` -> views ``q, k [R, Q, H, K]``, ``v [R, Q, HV, V]``."""
    key = layer.key_dim // layer.tp_size
    q, k, v = x_conv.split([key, key, layer.value_dim // layer.tp_size], dim=-1)
    return (
        q.unflatten(-1, (-1, layer.head_k_dim)),
        k.unflatten(-1, (-1, layer.head_k_dim)),
        v.unflatten(-1, (-1, layer.head_v_dim)),
    )
