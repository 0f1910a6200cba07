"""DDTree's per-engine state on the V2 model runner: the tree tables and the step's flags.

The tables are persistent device buffers indexed by vLLM's request-state row (the row a
request keeps for its lifetime), so a tree proposed in one step is found in the next whatever
the batch order; ``tree_rows`` maps this step's batch rows to them (-1: no tree). The verify
graphs read them in place: nothing here is reallocated after start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree.tree import DraftTree
from ddtree.vllm_plugin import attention, graphs
from ddtree.vllm_plugin.attention.paged_tree_kernel import (
    paged_tree_attention,
    shares_for_grid,
    split_scratch,
)
from ddtree.vllm_plugin.config import DDTreeOptions, Settings
from ddtree.vllm_plugin.debug import AcceptanceLog, StepProfile, sync_checked
from ddtree.vllm_plugin.state import LayerBinding

# DDTREE_CONTEXT_SPLITS=auto: at most this many shares, in steps of at most this many tokens
# (``shares_for_grid`` splits only grids under one wave: a few requests at moderate budgets)
AUTO_MAX_SHARES = 4
AUTO_SPLIT_TOKENS = 256

# Attention implementations whose cache layout (logical [blocks, kv heads, block, 2 x head])
# the paged tree kernel and the KV commit read.
V2_IMPLS = ("FlashAttentionImpl", "TritonAttentionImpl")


class TreeTables:
    """Per request-state row: its tree (``Q = 1 + B`` slots), and per batch row this step's
    tree-table row and accepted path."""

    def __init__(self, max_reqs: int, budget: int, depth: int, device: torch.device):
        slots = 1 + budget
        batch_rows = graphs.bucket(max_reqs)  # a step's requests, padded to a bucket
        self.spare_row = max_reqs  # written by padded rows of the drafter's graph, never read
        max_reqs += 1
        self.tokens = torch.full((max_reqs, slots), -1, dtype=torch.long, device=device)
        self.parents = torch.full((max_reqs, slots), -1, dtype=torch.long, device=device)
        self.depths = torch.zeros(max_reqs, slots, dtype=torch.int32, device=device)
        slot = torch.arange(slots, dtype=torch.int32, device=device)
        # k-th ancestors; a padding tree (every slot its own ancestor) until a proposal lands
        self.ancestors = slot[None, :, None].repeat(max_reqs, 1, depth + 1).contiguous()
        self.tree_rows = torch.full((batch_rows,), -1, dtype=torch.int32, device=device)
        self.path = torch.full((batch_rows, depth + 1), -1, dtype=torch.long, device=device)

    def widen(self, trees: DraftTree) -> DraftTree:
        """``trees`` of fewer slots than the tables (a bucket's narrower "auto" trees) with
        padding slots after theirs: children of the root whose token (-1) no target token
        matches, so the grammar, the verify and the walk take them as rejected nodes."""
        rows, slots = trees.tokens.shape
        extra = self.tokens.shape[1] - slots
        if extra == 0:
            return trees
        new = torch.arange(slots, slots + extra, device=trees.tokens.device)  # [extra]
        ancestors = torch.zeros(extra, self.ancestors.shape[2], dtype=torch.long, device=new.device)
        ancestors[:, 0] = new  # itself, then the root

        def pad(part: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            return torch.cat([part, value.to(part.dtype).expand(rows, *value.shape)], 1)

        return DraftTree(
            tokens=pad(trees.tokens, torch.full_like(new, -1)),
            parents=pad(trees.parents, torch.zeros_like(new)),
            depths=pad(trees.depths, torch.ones_like(new)),
            mask=None,
            scores=None,
            ancestors=pad(trees.ancestors, ancestors),
            num_nodes=None,
        )

    def store(self, state_rows: torch.Tensor, trees: DraftTree) -> None:
        """Trees in batch order (``[R, Q]``) into the rows ``state_rows [R]`` of their
        requests (fixed shapes: it runs inside the drafter's graph)."""
        self.tokens.index_copy_(0, state_rows, trees.tokens)
        self.parents.index_copy_(0, state_rows, trees.parents)
        self.depths.index_copy_(0, state_rows, trees.depths.int())
        self.ancestors.index_copy_(0, state_rows, trees.ancestors.int())

    def batch_trees(self, active: torch.Tensor, scheduled: torch.Tensor) -> DraftTree:
        """This step's trees in batch order ``[R, Q]``: a request not ``active [R]`` gets a
        padding tree; slots past ``scheduled [R]`` (slots vLLM scheduled) are padding too."""
        rows = self.tree_rows[: active.shape[0]].long().clamp(min=0)
        slot = torch.arange(self.tokens.shape[1], device=rows.device)
        live = active[:, None] & (slot < scheduled[:, None])
        return DraftTree(
            tokens=torch.where(live, self.tokens[rows], -1),
            parents=self.parents[rows],
            depths=self.depths[rows].long(),
            mask=None,  # the walk reads parents, depths and ancestors only
            scores=None,
            ancestors=self.ancestors[rows].long(),
            num_nodes=None,
        )


def _check_plain_attention(name: str, impl) -> None:
    """The tree kernel computes plain softmax attention: refuse what it would drop."""
    window = getattr(impl, "sliding_window", None)
    features = {
        "sliding window": window not in (None, (-1, -1), -1),
        "logits soft cap": bool(getattr(impl, "logits_soft_cap", None)),
        "ALiBi": getattr(impl, "alibi_slopes", None) is not None,
        "attention sinks": getattr(impl, "sinks", None) is not None,
    }
    for feature, used in features.items():
        if used:
            raise NotImplementedError(
                f"ddtree: target layer {name} uses {feature}, which the "
                "tree attention does not implement yet"
            )


@dataclass
class TreeEngine:
    """One V2 engine's DDTree state (owned by its speculator)."""

    options: DDTreeOptions
    depth: int
    settings: Settings
    tables: TreeTables
    graph_pool: graphs.Pool = field(default_factory=graphs.Pool)
    layers: list = field(default_factory=list)  # (group, kv_cache, impl) of target layers
    slot_mappings: torch.Tensor | None = None  # [groups, max_tokens]: the step's KV slots
    # Step flags (host), set before the forward.
    tree_step: bool = False  # some request of the step verifies a tree
    all_tree: bool = False  # every request does (the backend's own pass is not needed)
    capturing: bool = False  # the runner is capturing its graphs (decode graphs: all tree)
    walked: bool = False  # the sampler walked trees this step (the drafter reorders)
    chain_trees: bool = False  # every tree of the step is its forced chain: nothing to reorder
    uniform_trees: bool = True  # every request of the step has drafts: verify graphs may run
    chain_verify: bool = False  # vLLM's rejection sampler is at hand for chain-sized steps
    acceptance: AcceptanceLog | None = None  # DDTREE_ACCEPTANCE (made by the TreeSampler)
    tuner: Any = None  # tuner.BudgetTuner of an "auto" budget schedule (made with the engine)
    gdn: Any = None  # v2.gdn.TreeGDN of a hybrid target's Gated DeltaNet layers
    marked_rows: int = 0  # batch rows prepare_step marked in tables.tree_rows this step
    profile: StepProfile | None = None  # DDTREE_PROFILE: the step's time split
    live_step: bool = False  # this step serves requests (not a dummy run): it may be profiled
    # DDTREE_TREE_ATTENTION=flash: each request's cached length [bucket + 1] and the context
    # part's output [max_tokens, H, hd] (one FlashAttention call per layer writes them)
    flash_context: torch.Tensor | None = None
    flash_out: torch.Tensor | None = None
    # The tree kernel's context shares (DDTREE_CONTEXT_SPLITS): float32 scratch [tokens, H,
    # shares, hd] and [tokens, H, shares] for steps of up to that many tokens, and the GPU's
    # multiprocessors (auto: shares by the launch grid)
    context_partials: tuple[torch.Tensor, torch.Tensor] | None = None
    num_sms: int = 0
    _fused_layers: dict | None = None

    def __post_init__(self) -> None:
        if self.profile is None and self.settings.profile_every > 0:
            self.profile = StepProfile(self.settings.profile_every, self.settings.profile_ops)

    def mark(self, stage: str) -> None:
        """``DDTREE_PROFILE``: ``stage`` starts now (a device sync: profiling only). Served
        steps only, never inside a graph capture. Stages on this runner: prepare (vLLM's
        inputs and DDTree's rows and positions), forward (the verify forward, its graph
        replayed: the tree attention has no share of its own), sample (vLLM's sampler + the
        walk, output and KV commit), vllm (vLLM between sampler and drafter), draft (the
        drafter's forward and the tree build: one graph), rest (to the next step)."""
        if self.profile is None or not self.live_step or self.capturing:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        self.profile.mark(stage)

    def bind(self, runner, draft_layers: set[str]) -> None:
        """Once, after the KV cache exists: the target's attention layers get this engine."""
        from vllm.v1.kv_cache_interface import MambaSpec

        context = runner.compilation_config.static_forward_context
        for group, spec in enumerate(runner.kv_cache_config.kv_cache_groups):
            if isinstance(spec.kv_cache_spec, MambaSpec):  # GDN layers: self.gdn
                continue
            for name in spec.layer_names:
                if name in draft_layers:
                    continue
                layer = context[name]
                impl = type(layer.impl).__name__
                if impl not in V2_IMPLS:
                    raise NotImplementedError(
                        f"ddtree: target layer {name} uses {impl}; on the V2 model runner the "
                        f"tree attention supports {V2_IMPLS} (attention_backend FLASH_ATTN or "
                        "TRITON_ATTN)"
                    )
                _check_plain_attention(name, layer.impl)
                kv_cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
                if kv_cache.element_size() == 1:
                    raise NotImplementedError(
                        f"ddtree: layer {name} has a quantized ({kv_cache.dtype}) KV cache; the "
                        "tree attention reads bf16/fp16/fp32 caches only (drop kv_cache_dtype)"
                    )
                layer.impl.ddtree_binding = LayerBinding(self, group)
                self.layers.append((group, kv_cache, layer.impl))
        self.slot_mappings = runner.block_tables.slot_mappings
        if self.settings.tree_attention == "flash":
            self._bind_flash_context(runner)
        self._bind_context_shares(runner)
        if self.gdn is not None:
            self.gdn.bind(runner)

    def _bind_context_shares(self, runner) -> None:
        """Scratch for the tree kernel's context shares: ``DDTREE_CONTEXT_SPLITS=N``, N shares
        in steps up to the largest CUDA graph (eager engines: every step); auto, up to
        ``AUTO_MAX_SHARES`` in steps of up to ``AUTO_SPLIT_TOKENS`` tokens (the grids small
        enough to split: a few requests, moderate budgets). None with the flash context."""
        splits = self.settings.context_splits
        if not self.layers or splits == 1 or self.settings.tree_attention == "flash":
            return
        impl = self.layers[0][2]
        # steps up to the largest CUDA graph (eager engines: every step)
        tokens = runner.compilation_config.max_cudagraph_capture_size or runner.max_num_tokens
        if splits == 0:
            tokens, splits = min(tokens, AUTO_SPLIT_TOKENS), AUTO_MAX_SHARES
            self.num_sms = torch.cuda.get_device_properties(runner.device).multi_processor_count
        self.context_partials = split_scratch(
            tokens, impl.num_heads, splits, impl.head_size, runner.device
        )

    def context_shares(self, query, kv_cache, metadata, first_slot: int) -> dict:
        """The tree kernel's share arguments for this launch (none: one share). The choice
        depends on the step's shapes only (requests, longest query), which a CUDA graph fixes."""
        partials = self.context_partials
        if partials is None or query.shape[0] > partials[0].shape[0]:
            return {}  # steps past the scratch (eager, mixed) take the unsplit kernel
        shares = self.settings.context_splits
        if shares == 0:
            num_kv_heads = kv_cache.shape[1]
            shares = shares_for_grid(
                metadata.query_start_loc.shape[0] - 1, metadata.max_query_len, first_slot,
                num_kv_heads, query.shape[1] // num_kv_heads, self.num_sms, partials[0].shape[2],
            )  # fmt: skip
        if shares <= 1:
            return {}
        return dict(
            context_splits=shares,
            partials=(partials[0][:, :, :shares], partials[1][:, :, :shares]),
        )

    def _bind_flash_context(self, runner) -> None:
        """``DDTREE_TREE_ATTENTION=flash``: buffers for the context part's FlashAttention
        call (one set for all layers: each layer's call is consumed before the next)."""
        impls = sorted({type(impl).__name__ for _, _, impl in self.layers})
        if impls != ["FlashAttentionImpl"]:
            raise NotImplementedError(
                f"ddtree: DDTREE_TREE_ATTENTION=flash needs attention_backend FLASH_ATTN on "
                f"every target layer (got {impls}); unset it for the Triton tree kernel alone"
            )
        impl = self.layers[0][2]
        self.flash_context = torch.zeros(
            graphs.bucket(runner.max_num_reqs) + 1, dtype=torch.int32, device=runner.device
        )
        self.flash_out = torch.empty(
            runner.max_num_tokens, impl.num_heads, impl.head_size, dtype=runner.dtype,
            device=runner.device,
        )  # fmt: skip

    def chain_step(self) -> bool:
        """This step is the chain's verify, left to vLLM's rejection sampler: every tree is
        its forced chain (positions sequential, the accepted K/V in place) and no Gated
        DeltaNet commit needs the walked path."""
        return self.chain_verify and self.chain_trees and self.gdn is None

    def chain_slots(self, max_query_len: int) -> int:
        """Leading slots of every tree that a causal pass computes exactly: the root and the
        forced chain (``chain_seed``: slots 1..min(D, K) at depths 1..min(D, K), each the
        child of the one before), 0 without a forced chain."""
        if not self.options.chain_seed:
            return 0
        return 1 + min(self.depth, max_query_len - 1)

    @sync_checked
    def attend(self, impl, original, query, key, value, kv_cache, attn_metadata, output, group):
        """The attention hook of a bound target layer: the backend's pass where it is needed,
        then the tree rows (in a capture: the decode graphs, every request a tree).

        The forced chain's rows take the backend's causal pass, as vLLM's chain verify does:
        bit for bit the chain's (and no-spec's) numerics while the walk stays on the chain,
        and no tree kernel at all when the step's budget is the chain (K <= D)."""
        # Outside a capture, a step whose every tree is its forced chain (K <= D drafts) is
        # all causal rows: decode graphs then never launch the kernel (first slot = query
        # length), and an eager step (a prefill among the requests) need not either.
        plain = not self.tree_step or self.chain_trees
        if attn_metadata is None or (plain and not self.capturing):
            return original()
        first = self.chain_slots(attn_metadata.max_query_len)
        if first > 0 or not (self.all_tree or self.capturing):
            original()  # the chain's rows; in a mixed step also the prefill rows
        num_reqs = attn_metadata.query_start_loc.shape[0] - 1
        if self.settings.tree_attention == "flash":
            context = attention.flash.context_attention(
                impl, query, kv_cache, attn_metadata, self.flash_context, self.flash_out
            )
        else:
            context = self.context_shares(query, kv_cache, attn_metadata, first)
        paged_tree_attention(
            query,
            kv_cache,
            output.view(query.shape),
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            self.tables.tree_rows[:num_reqs],
            self.tables.depths,
            self.tables.ancestors,
            impl.scale,
            attn_metadata.max_query_len,
            first_slot=first,
            **context,
        )
        return output

    def fused_layers(self) -> dict:
        """KV group -> its target layers for ``ddtree.kernels.compact_kv`` (made once, at the
        first commit: it copies a small offset table to the device)."""
        if self._fused_layers is None:
            from ddtree.kernels import KVLayers

            groups = sorted({group for group, _, _ in self.layers})
            self._fused_layers = {
                group: KVLayers([cache for g, cache, _ in self.layers if g == group])
                for group in groups
            }
        return self._fused_layers

    def commit(self, path: torch.Tensor, active: torch.Tensor, start: torch.Tensor) -> None:
        """Every accepted path's K/V to the slots right after its context, all target layers:
        slot of row ``start + path[k]`` -> slot of row ``start + k`` (k = 1..accepted), for
        ``path [R, D+1]``, ``active [R]`` (requests that verified a tree), ``start [R]`` (their
        first row). Other moves are slot 0 (vLLM's null block) onto itself. Fixed shapes, no
        host sync: it runs inside the tree sampler's graph."""
        moved = path[:, 1:]  # [R, D]
        step = torch.arange(1, moved.shape[1] + 1, device=path.device)
        live = (moved >= 0) & active[:, None]
        src_rows = torch.where(live, start[:, None] + moved.clamp(min=0), 0).flatten()
        dst_rows = torch.where(live, start[:, None] + step, 0).flatten()
        for group in sorted({g for g, _, _ in self.layers}):
            slots = self.slot_mappings[group]
            src = torch.where(live.flatten(), slots[src_rows], 0)
            dst = torch.where(live.flatten(), slots[dst_rows], 0)
            if self.settings.fused_tree_kernels:  # one launch for the group's layers
                from ddtree.kernels import compact_kv

                compact_kv(self.fused_layers()[group], src.view(live.shape), dst.view(live.shape))
                continue
            for layer_group, kv_cache, impl in self.layers:
                if layer_group == group:
                    attention.copy_slots(impl, kv_cache, src, dst)
