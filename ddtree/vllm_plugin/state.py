"""DDTree's state for one engine, and the step context its stages hand each other.

One :class:`EngineState` per model runner, made with the engine's proposer: nothing of one
engine is visible to another in the same process (module globals held the first engine's
KV-cache tensors once, and a second engine in one process gave wrong tokens). The step
context (this step's trees, accepted paths) is set by the stages in order and cleared at the
start of every step (:meth:`EngineState.begin_step`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree.tree import DraftTree
from ddtree.vllm_plugin import graphs
from ddtree.vllm_plugin.config import DDTreeOptions, Settings
from ddtree.vllm_plugin.debug import AcceptanceLog, StepProfile


@dataclass
class TreeBatch:
    """This step's tree requests as fixed-shape tensors: R requests of ``Q = 1 + B`` slots.

    A request may have fewer than B drafts scheduled (vLLM trims them near the end of the
    context); its unscheduled slots carry token -1 (never accepted) and the root's token row.
    """

    batch_index: torch.Tensor  # long [R]: row of each request in the input batch
    tree: DraftTree  # [R, Q] trees, unscheduled slots' tokens set to -1
    rows: torch.Tensor  # long [R, Q]: token row of each slot in the step (root's row if unused)
    flat_slots: torch.Tensor  # long [N]: r * Q + j of every scheduled slot, N = tree tokens
    flat_rows: torch.Tensor  # long [N]: their token rows (rows.flatten()[flat_slots])
    context: torch.Tensor  # long [R]: tokens already in the KV cache (the root's position)
    context_i32: torch.Tensor  # int32 [R]: the same (FlashAttention's seqused_k)
    cu_queries: torch.Tensor  # int32 [R + 1]: offsets of each request's slots in flat_rows
    counts: torch.Tensor  # int32 [R]: scheduled slots per request (1 + drafts)
    block_tables: list[torch.Tensor]  # per KV group: int32 [R, max_blocks]
    context_cpu: list[int]
    max_context: int
    counts_cpu: list[int]  # scheduled slots per request (1 + drafts)
    covers_step: bool  # every token row of the step is a tree slot


@dataclass
class LayerBinding:
    """What the attention hook of one target layer needs: its engine and its KV group."""

    engine: EngineState
    group: int


@dataclass
class EngineState:
    """DDTree's per-engine state: options, the drafter's depth D, DDTree's graphs, the step."""

    options: DDTreeOptions
    depth: int
    settings: Settings
    profile: StepProfile | None = None
    # Set once, at the first step: target attention layer name -> KV group.
    layer_groups: dict[str, int] = field(default_factory=dict)
    # DDTree's own CUDA graphs (tree stage, KV commit over every layer), one memory pool.
    graph_pool: graphs.Pool = field(default_factory=graphs.Pool)
    proposal_graphs: graphs.GraphCache | None = None
    commit: graphs.GraphCache | None = None
    # Carried from one step's proposal to the next step's verify.
    proposal: DraftTree | None = None  # trees, one row per request + a padding row
    proposed: dict[str, int] = field(default_factory=dict)  # req_id -> row of proposal
    # The step context, cleared by begin_step.
    batch: TreeBatch | None = None  # this step's tree requests
    path: torch.Tensor | None = None  # long [R, D+1]: this step's accepted slots, -1 pad
    gdn_pending: list = field(default_factory=list)  # gdn.PendingCommit per linear layer
    attention_active: bool = False  # True only during the target forward
    acceptance: AcceptanceLog | None = None  # DDTREE_ACCEPTANCE: made at the first walk
    tuner: Any = None  # tuner.BudgetTuner of an "auto" budget schedule, made at start-up

    def __post_init__(self) -> None:
        if self.profile is None and self.settings.profile_every > 0:
            self.profile = StepProfile(self.settings.profile_every, self.settings.profile_ops)

    def begin_step(self) -> tuple[DraftTree | None, dict[str, int]]:
        """Clear the step context; hand over the last proposal (it serves this step only:
        when vLLM skips the drafter it schedules zeros as drafts, and a kept tree would be
        walked against tokens the target never saw)."""
        proposal, proposed = self.proposal, self.proposed
        self.proposal, self.proposed = None, {}
        self.batch, self.path, self.attention_active = None, None, False
        return proposal, proposed

    def attend(self, impl, original, query, key, value, kv_cache, attn_metadata, output, group):
        """The attention hook of a bound target layer: the backend's own causal pass only when
        other requests share the step, then the tree requests' rows."""
        from ddtree.vllm_plugin import attention

        if not self.attention_active or attn_metadata is None:
            return original()
        if not self.batch.covers_step:
            original()
        attention.tree_attention(self, impl, query, key, value, kv_cache, output, group)
        return output

    def mark(self, stage: str) -> None:
        if self.profile is not None:
            self.profile.mark(stage)

    def attention_span(self):
        if self.profile is None:
            return contextlib.nullcontext()
        return self.profile.attention_span()


def padding_tree(batch: int, num_slots: int, depth: int, device) -> DraftTree:
    """Trees whose non-root slots are all padding (token -1: nothing is ever accepted)."""
    slot = torch.arange(num_slots, device=device).expand(batch, num_slots)
    minus = torch.full((batch, num_slots), -1, dtype=torch.long, device=device)
    return DraftTree(
        tokens=minus,
        parents=minus.clone(),
        depths=torch.zeros_like(minus),
        mask=torch.eye(num_slots, dtype=torch.bool, device=device).expand(batch, -1, -1),
        scores=torch.zeros(batch, num_slots, device=device),
        ancestors=slot.unsqueeze(2).expand(batch, num_slots, depth + 1),
        num_nodes=torch.zeros(batch, dtype=torch.long, device=device),
    )


def pad_tree(tree: DraftTree, num_slots: int) -> DraftTree:
    """``tree`` with padding slots appended up to ``num_slots``."""
    batch, old = tree.tokens.shape
    pad = padding_tree(batch, num_slots, tree.max_depth, tree.tokens.device)
    mask = pad.mask.clone()
    mask[:, :old, :old] = tree.mask
    ancestors = pad.ancestors.clone()
    ancestors[:, :old] = tree.ancestors
    scores = torch.full((batch, num_slots), float("-inf"), device=tree.tokens.device)
    scores[:, :old] = tree.scores
    return DraftTree(
        tokens=torch.cat([tree.tokens, pad.tokens[:, old:]], 1),
        parents=torch.cat([tree.parents, pad.parents[:, old:]], 1),
        depths=torch.cat([tree.depths, pad.depths[:, old:]], 1),
        mask=mask,
        scores=scores,
        ancestors=ancestors,
        num_nodes=tree.num_nodes,
    )


def _fields(tree: DraftTree) -> list[str]:
    """The fields a tree has (``ancestor_bits`` is None unless the fused kernels built it)."""
    return [k for k in tree.__dataclass_fields__ if getattr(tree, k) is not None]


def gather_tree(tree: DraftTree, index: torch.Tensor) -> DraftTree:
    """The trees of rows ``index [R]``."""
    return DraftTree(**{k: getattr(tree, k).index_select(0, index) for k in _fields(tree)})


def concat_trees(first: DraftTree, second: DraftTree) -> DraftTree:
    fields = _fields(first)
    return DraftTree(**{k: torch.cat([getattr(first, k), getattr(second, k)]) for k in fields})
