"""DDTree in vLLM 0.26's V1 model runner (CPU first): proposer, positions, tree attention,
tree verification and KV commit. Every patched vLLM symbol is applied in ``patches.py``.

Per step and request (docs/integration.md has the map):
1. ``DDTreeProposer`` runs vLLM's DFlash drafter for D = block_size - 1 positions, keeps the
   logits, builds the tree (``ddtree.build_tree``) and returns its B node tokens as the
   "draft tokens"; the tree is kept per request id.
2. After vLLM prepares the next step's inputs (slots = context + slot index), the depth
   positions are written in place (RoPE sees context + depth).
3. The target's attention for those requests uses the ancestor mask (``cpu_tree_attention``).
4. The target's token at every node (argmax or a processed sample) -> ``ddtree.walk`` ->
   ``[accepted..., bonus]`` in vLLM's sampler output layout; the accepted path's KV is moved to
   the first slots of every target layer.
5. The drafter gets the root + accepted path as context (reordered to the front, sequential
   positions), so vLLM's own prefix logic hides the rejected nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddtree.generate import Sampling
from ddtree.tree import DraftTree, build_tree, chain_tree
from ddtree.verify import walk
from ddtree.vllm_plugin import cpu_tree_attention, flash_tree_attention


@dataclass
class DDTreeOptions:
    budget: int
    chain_seed: bool = True


@dataclass
class TreeRequest:
    """One request of the current verify step."""

    index: int  # row in the input batch
    start: int  # first token row in the step's flattened tokens
    context: int  # tokens already in the KV cache (position of the root)
    tree: DraftTree  # truncated to the scheduled nodes, batch of 1
    block_tables: list[torch.Tensor]  # per KV-cache group: this request's block ids


@dataclass
class StepState:
    """What the step's stages hand each other (one engine core, one step at a time)."""

    trees: dict[str, DraftTree] = field(default_factory=dict)  # req_id -> next step's tree
    verifying: dict[str, TreeRequest] = field(default_factory=dict)  # this step's tree requests
    attention_active: bool = False  # True only during the target forward
    paths: dict[str, torch.Tensor] = field(default_factory=dict)  # req_id -> accepted slots
    accepted_per_depth: list[int] = field(default_factory=list)
    layer_groups: dict[str, int] = field(default_factory=dict)  # target layer -> KV group


STATE = StepState()
SUPPORTED_ATTENTION_IMPLS = ("CPUAttentionBackendImpl", "FlashAttentionImpl")


def truncate(tree: DraftTree, num_nodes: int) -> DraftTree:
    """The first ``1 + num_nodes`` slots: still a tree (slots are depth-ordered)."""
    n = 1 + num_nodes
    return DraftTree(
        tokens=tree.tokens[:, :n],
        parents=tree.parents[:, :n],
        depths=tree.depths[:, :n],
        mask=tree.mask[:, :n, :n],
        scores=tree.scores[:, :n],
        ancestors=tree.ancestors[:, :n],
        num_nodes=(tree.tokens[:, 1:n] >= 0).sum(1),
    )


# --- 2. positions (after GPUModelRunner._prepare_inputs) -------------------------------------


def after_prepare_inputs(runner, scheduler_output) -> None:
    """Record this step's tree requests and write their depth positions in place."""
    STATE.verifying.clear()
    STATE.paths.clear()
    if not STATE.layer_groups:
        layers = list(target_attention_layers(runner))
        for _, name, layer in layers:
            impl = type(layer.impl).__name__
            if impl not in SUPPORTED_ATTENTION_IMPLS:
                raise NotImplementedError(
                    f"ddtree: target layer {name} uses {impl}; the tree mask is wired into "
                    f"{SUPPORTED_ATTENTION_IMPLS} only (on the GPU: attention_backend=FLASH_ATTN)"
                )
        STATE.layer_groups = {name: g for g, name, _ in layers}
    batch = runner.input_batch
    starts = runner.query_start_loc.cpu[: batch.num_reqs + 1].tolist()
    spec = scheduler_output.scheduled_spec_decode_tokens
    # Each tree serves the one step after its proposal. When vLLM skips the drafter (the
    # context would not fit it: GPUModelRunner._input_fits_in_drafter) it schedules zeros as
    # drafts; a kept tree would then be walked against tokens the target never saw.
    trees, STATE.trees = STATE.trees, {}
    for index, req_id in enumerate(batch.req_ids):
        num_drafts = len(spec.get(req_id, ()))
        if num_drafts == 0:
            continue
        tree = trees.get(req_id)
        if tree is None:  # placeholder or zeroed drafts: a chain of nodes that never match
            tree = chain_tree(torch.full((1, num_drafts), -1, dtype=torch.long,
                                         device=runner.positions.device))  # fmt: skip
        tree = truncate(tree, num_drafts)
        context = int(batch.num_computed_tokens_cpu[index])
        start = starts[index]
        runner.positions[start : start + 1 + num_drafts] = context + tree.depths[0]
        tables = [bt.get_cpu_tensor()[index] for bt in batch.block_table.block_tables]
        STATE.verifying[req_id] = TreeRequest(index, start, context, tree, tables)
    STATE.attention_active = bool(STATE.verifying)


# --- 3. attention (inside the CPU attention impl's forward) -----------------------------------


def tree_attention_override(impl, query, kv_cache, attn_metadata, output, group: int) -> None:
    """Redo the attention of the tree requests of this step with their ancestor masks."""
    backend = cpu_tree_attention if hasattr(impl, "isa") else flash_tree_attention
    for req in STATE.verifying.values():
        q = req.tree.tokens.shape[1]
        rows = slice(req.start, req.start + q)
        out = backend.tree_attention(
            query[rows], kv_cache, req.block_tables[group], req.context + q, req.tree.mask[0],
            impl.scale,
        )  # fmt: skip
        output[rows] = out.reshape(output[rows].shape)


# --- 4. verification (replaces the rejection sampler for DDTree) ------------------------------


def _request_sampling(sampling_metadata, index: int) -> tuple[Sampling, torch.Generator | None]:
    if sampling_metadata.all_greedy:
        return Sampling(), None
    temperature = float(sampling_metadata.temperature[index])
    top_k = None if sampling_metadata.top_k is None else int(sampling_metadata.top_k[index])
    top_p = None if sampling_metadata.top_p is None else float(sampling_metadata.top_p[index])
    if top_k is not None and top_k <= 0:
        top_k = None
    sampling = Sampling(max(temperature, 0.0), top_k, top_p)
    return sampling, sampling_metadata.generators.get(index)


def tree_sample(runner, logits: torch.Tensor, metadata, sampling_metadata):
    """Sampler output ``[R, max_spec_len + 1]``: each request's accepted tokens then its bonus."""
    from vllm.v1.outputs import SamplerOutput

    STATE.attention_active = False
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    width = metadata.max_spec_len + 1
    out = torch.full((num_reqs, width), -1, dtype=torch.int32, device=logits.device)
    row = 0
    for index, req_id in enumerate(batch.req_ids[:num_reqs]):
        num_drafts = metadata.num_draft_tokens[index]
        rows = logits[row : row + 1 + num_drafts]
        row += 1 + num_drafts
        sampling, generator = _request_sampling(sampling_metadata, index)
        target_tokens = sampling.pick(rows, generator).long().unsqueeze(0)  # [1, 1+n]
        req = STATE.verifying.get(req_id)
        if req is None:  # no drafts this step: the bonus only
            out[index, 0] = target_tokens[0, 0]
            continue
        acc = walk(req.tree, target_tokens)
        accepted = int(acc.num_accepted[0])
        out[index, : accepted + 1] = acc.emitted[0, : accepted + 1].to(torch.int32)
        path = acc.path[0, : accepted + 1]
        STATE.paths[req_id] = path
        while len(STATE.accepted_per_depth) < req.tree.max_depth:
            STATE.accepted_per_depth.append(0)
        for d in range(accepted):
            STATE.accepted_per_depth[d] += 1
        if accepted:
            _commit_kv(runner, req, path)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def _commit_kv(runner, req: TreeRequest, path: torch.Tensor) -> None:
    """Move the accepted path's K/V to the slots right after the context, in every target layer."""
    for group, _, layer in target_attention_layers(runner):
        kv_cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
        table = req.block_tables[group]
        if hasattr(layer.impl, "isa"):  # vLLM's CPU attention
            cpu_tree_attention.compact_paged_kv(kv_cache, table, req.context, path, layer.impl.isa)
        else:
            flash_tree_attention.compact_paged_kv(kv_cache, table, req.context, path)


def target_attention_layers(runner):
    """(kv-cache group, name, layer) of every attention layer of the target (not the drafter)."""
    drafter_layers = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
    context = runner.compilation_config.static_forward_context
    for group, spec in enumerate(runner.kv_cache_config.kv_cache_groups):
        for name in spec.layer_names:
            if name not in drafter_layers:
                yield group, name, context[name]


# --- 1 and 5. the proposer ----------------------------------------------------------------------


def make_proposer_class(base):
    """A DFlashProposer subclass that drafts D positions and returns a B-node tree."""

    class DDTreeProposer(base):
        def __init__(self, vllm_config, device, runner=None):
            spec = vllm_config.speculative_config
            options: DDTreeOptions = spec.ddtree
            block = getattr(spec.draft_model_config.hf_config, "block_size", None) or 16
            # The drafter runs 1 + D queries per request while vLLM schedules B tree nodes: its
            # query buffers are sized from num_speculative_tokens, so size them for max(B, D)
            # (B < D would overflow them) and give vLLM back B afterwards.
            spec.num_speculative_tokens = max(options.budget, block - 1)
            try:
                super().__init__(vllm_config, device, runner)
            finally:
                spec.num_speculative_tokens = options.budget
            self.ddtree = options
            self.draft_depth = block - 1
            self._draft_logits = None

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            logits = self.model.compute_logits(hidden_states)  # [R*D, V]
            self._draft_logits = logits
            return logits.argmax(-1), None

        def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                    target_hidden_states, next_token_ids, token_indices_to_sample,
                    common_attn_metadata, sampling_metadata, *args, **kwargs):  # fmt: skip
            _reorder_context(self.runner, target_token_ids, target_positions, target_hidden_states)
            super().propose(
                self.draft_depth, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata,
                sampling_metadata, *args, **kwargs,
            )  # fmt: skip
            num_reqs = next_token_ids.shape[0]
            logits = self._draft_logits.view(num_reqs, self.draft_depth, -1)
            trees = build_tree(
                logits.float(), self.ddtree.budget, chain_seed=self.ddtree.chain_seed,
                check_values=False,
            )  # fmt: skip
            req_ids = self.runner.input_batch.req_ids[:num_reqs]
            STATE.trees = {req_id: _row(trees, i) for i, req_id in enumerate(req_ids)}
            return torch.where(trees.tokens[:, 1:] >= 0, trees.tokens[:, 1:], 0)

    return DDTreeProposer


def _row(tree: DraftTree, i: int) -> DraftTree:
    return DraftTree(**{k: getattr(tree, k)[i : i + 1] for k in tree.__dataclass_fields__})


def _reorder_context(runner, token_ids, positions, hidden_states) -> None:
    """Put each verified request's accepted path first, at sequential positions, in place."""
    for req_id, path in STATE.paths.items():
        req = STATE.verifying[req_id]
        q = req.tree.tokens.shape[1]
        device = token_ids.device
        path = path.to(device)
        rows = torch.arange(req.start, req.start + q, device=device)
        rest = torch.ones(q, dtype=torch.bool, device=device)
        rest[path] = False
        order = req.start + torch.cat([path, torch.arange(q, device=device)[rest]])
        token_ids[rows] = token_ids[order].clone()
        hidden_states[rows] = hidden_states[order].clone()
        positions[rows] = req.context + torch.arange(q, device=positions.device)
