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

import contextlib
import functools
import json
import os
import time
from dataclasses import dataclass, field

import torch

from ddtree.tree import DraftTree, draft_topk, tree_from_ranked
from ddtree.verify import walk
from ddtree.vllm_plugin import cost_model, cpu_tree_attention, flash_tree_attention, graphs
from ddtree.vllm_plugin.tree_attention import merge, suffix_attention


@dataclass
class DDTreeOptions:
    budget: int  # B: tree nodes per request and step (at most)
    chain_seed: bool = True
    max_verify_tokens: int | None = None  # cap on the step's tree tokens, all requests together
    max_verify_cost: float | None = None  # verify forward time / the chain's, at most
    bucket_budgets: dict[int, int] | None = None  # {request bucket: B_step}, from the cost model

    def step_budget(self, num_reqs: int, depth: int) -> int:
        """This step's B for ``num_reqs`` requests (a bucket): the budget, shrunk so that
        ``num_reqs * (1 + B)`` stays within ``max_verify_tokens`` and to the start-up cost
        model's choice for the bucket, but never below the chain (``min(budget, D)`` nodes)."""
        steps = self.budget
        if self.max_verify_tokens is not None:
            steps = min(steps, self.max_verify_tokens // max(num_reqs, 1) - 1)
        if self.bucket_budgets:
            steps = min(steps, self.bucket_budgets.get(num_reqs, steps))
        return max(min(self.budget, depth), steps)


def sync_checked(fn):
    """With ``DDTREE_SYNC_DEBUG=warn|error`` in the environment, torch's CUDA sync debug mode
    is on while ``fn`` runs: any host-device sync in DDTree's per-step code warns or raises."""
    mode = os.environ.get("DDTREE_SYNC_DEBUG")
    if not mode:
        return fn

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if not torch.cuda.is_available():
            return fn(*args, **kwargs)
        torch.cuda.set_sync_debug_mode(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    return checked


class StepProfile:
    """``DDTREE_PROFILE=N``: the step's time split, logged every N steps (mean ms per step).

    Profiling only: at every stage boundary the device is synchronized and the host clock
    read, so each stage's time is its full cost (host + device) on the critical path. Stages:
    prepare (positions, tree batch), forward (the target's verify forward; ``attention`` is its
    tree-attention share), sample (target tokens + walk), commit (KV moves), vllm (vLLM's
    bookkeeping before the drafter), draft (context reorder + DFlash forward), build
    (``build_tree``), rest (until the next step: vLLM's scheduling and outputs).
    """

    ORDER = ("prepare", "forward", "sample", "commit", "vllm", "draft", "build", "rest")

    def __init__(self, every: int):
        self.every = every
        self.marks: list[tuple[str, float]] = []
        self.sums: dict[str, float] = {}
        self.steps = 0
        self.total_steps = 0
        self.ops = None  # DDTREE_PROFILE_OPS=1: torch.profiler over steps 2N..3N, op table logged

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self, name: str) -> None:
        now = self._now()
        if name == "prepare" and self.marks:
            self._close_step(now)
            self._op_profile()
        self.marks.append((name, now))

    def _op_profile(self) -> None:
        import logging

        if os.environ.get("DDTREE_PROFILE_OPS") != "1":
            return
        self.total_steps += 1
        if self.total_steps == 2 * self.every:
            self.ops = torch.profiler.profile(record_shapes=False)
            self.ops.__enter__()
        elif self.total_steps == 3 * self.every and self.ops is not None:
            self.ops.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            for key in (sort, "self_cpu_time_total"):
                table = self.ops.key_averages().table(sort_by=key, row_limit=25)
                logging.getLogger("ddtree").warning("ddtree-ops by %s\n%s", key, table)
            self.ops = None

    @contextlib.contextmanager
    def attention_span(self):
        start = self._now()
        yield
        self.sums["attention"] = self.sums.get("attention", 0.0) + self._now() - start

    def _close_step(self, now: float) -> None:
        import logging

        ends = [t for _, t in self.marks[1:]] + [now]
        for (name, start), end in zip(self.marks, ends, strict=True):
            self.sums[name] = self.sums.get(name, 0.0) + end - start
        first = self.marks[0][0]
        self.marks = []
        self.steps += first == "prepare"
        if self.steps == self.every:
            report = {k: round(1000 * self.sums[k] / self.steps, 3)
                      for k in (*self.ORDER, "attention") if k in self.sums}  # fmt: skip
            logging.getLogger("ddtree").warning(
                "ddtree-profile %s", json.dumps({"steps": self.steps, "ms_per_step": report})
            )
            self.sums, self.steps = {}, 0


_every = int(os.environ.get("DDTREE_PROFILE", "0") or 0)
PROFILE = StepProfile(_every) if _every > 0 else None


def _mark(name: str) -> None:
    if PROFILE is not None:
        PROFILE.mark(name)


def _to_device(host: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host index tensors to the device in one copy (pinned, asynchronous on CUDA)."""
    packed = torch.cat([h.long().flatten() for h in host])
    if device.type == "cuda":
        packed = packed.pin_memory()
    return list(packed.to(device, non_blocking=True).split([h.numel() for h in host]))


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
class StepState:
    """What the step's stages hand each other (one engine core, one step at a time)."""

    proposal: DraftTree | None = None  # last proposal's trees, one row per request + padding
    proposed: dict[str, int] = field(default_factory=dict)  # req_id -> row of proposal
    batch: TreeBatch | None = None  # this step's tree requests
    path: torch.Tensor | None = None  # long [R, D+1]: this step's accepted slots, -1 pad
    attention_active: bool = False  # True only during the target forward
    layer_groups: dict[str, int] = field(default_factory=dict)  # target layer -> KV group
    depth: int = 0  # D: the drafter's positions per proposal
    commit: graphs.GraphCache | None = None  # the KV commit over every target layer


STATE = StepState()
# The GPU tree attention (``DDTREE_TREE_ATTENTION``): "triton" (the default on the GPU: one
# kernel per layer, ``triton_tree_attention``) or "merge" (FlashAttention over the context + a
# dense tree part, merged by log-sum-exp; ~50 small ops per layer). vLLM's CPU attention has
# the merged path only (SDPA over the paged cache); "triton" there is an error.
TREE_ATTENTION = os.environ.get("DDTREE_TREE_ATTENTION", "auto")
if TREE_ATTENTION not in ("auto", "merge", "triton"):
    raise ValueError(f"DDTREE_TREE_ATTENTION must be auto, merge or triton, got {TREE_ATTENTION!r}")
SUPPORTED_ATTENTION_IMPLS = ("CPUAttentionBackendImpl", "FlashAttentionImpl")


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


def _gather_tree(tree: DraftTree, index: torch.Tensor) -> DraftTree:
    fields = [k for k in tree.__dataclass_fields__ if getattr(tree, k) is not None]
    return DraftTree(**{k: getattr(tree, k).index_select(0, index) for k in fields})


# --- 2. positions (after GPUModelRunner._prepare_inputs) -------------------------------------


@sync_checked
def after_prepare_inputs(runner, scheduler_output) -> None:
    """Collect this step's tree requests into a TreeBatch; write their depth positions."""
    _mark("prepare")
    STATE.batch, STATE.path = None, None
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
    # Each proposal serves the one step after it. When vLLM skips the drafter (the context
    # would not fit it: GPUModelRunner._input_fits_in_drafter) it schedules zeros as drafts;
    # a kept tree would then be walked against tokens the target never saw.
    proposal, proposed = STATE.proposal, STATE.proposed
    STATE.proposal, STATE.proposed = None, {}
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    spec = scheduler_output.scheduled_spec_decode_tokens
    members = [(i, req_id, len(spec[req_id])) for i, req_id in enumerate(batch.req_ids[:num_reqs])
               if spec.get(req_id)]  # fmt: skip
    STATE.attention_active = bool(members)
    if not members:
        _mark("forward")
        return
    device = runner.positions.device
    widest = 1 + max(n for _, _, n in members)
    if proposal is None:
        proposal = padding_tree(1, widest, STATE.depth, device)
    if widest > proposal.tokens.shape[1]:
        # Wider than the proposal: a request vLLM scheduled with B placeholder drafts (a new
        # 1-token request padded to the uniform decode width) while the step budget was lower.
        proposal = pad_tree(proposal, widest)
    num_slots = proposal.tokens.shape[1]
    padding_row = proposal.tokens.shape[0] - 1

    # Host-side index arithmetic, then one copy to the device.
    starts_all = runner.query_start_loc.cpu[: num_reqs + 1]
    index = torch.tensor([i for i, _, _ in members])
    counts = torch.tensor([1 + n for _, _, n in members])
    context = batch.num_computed_tokens_cpu_tensor[index].long()  # host
    source = torch.tensor([proposed.get(req_id, padding_row) for _, req_id, _ in members])
    slot = torch.arange(num_slots)
    scheduled = slot < counts[:, None]  # [R, Q]
    rows = starts_all[index].long()[:, None] + torch.where(scheduled, slot, 0)
    flat_slots = scheduled.flatten().nonzero().squeeze(1)
    cu_queries = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    parts = [index, rows, flat_slots, context, cu_queries, source, scheduled]
    index_d, rows_d, flat_d, context_d, cu_d, source_d, scheduled_d = _to_device(parts, device)
    rows_d = rows_d.view(rows.shape)
    tree = _gather_tree(proposal, source_d)
    tree.tokens = torch.where(scheduled_d.view(rows.shape).bool(), tree.tokens, -1)
    flat_rows = rows_d.flatten().index_select(0, flat_d)
    depth_positions = (context_d[:, None] + tree.depths).flatten().index_select(0, flat_d)
    runner.positions.index_copy_(0, flat_rows, depth_positions.to(runner.positions.dtype))
    tables = [bt.get_device_tensor(num_reqs).index_select(0, index_d)
              for bt in batch.block_table.block_tables]  # fmt: skip
    STATE.batch = TreeBatch(
        batch_index=index_d,
        tree=tree,
        rows=rows_d,
        flat_slots=flat_d,
        flat_rows=flat_rows,
        context=context_d,
        context_i32=context_d.int(),
        cu_queries=cu_d.int(),
        counts=(cu_d[1:] - cu_d[:-1]).int(),
        block_tables=tables,
        context_cpu=context.tolist(),
        max_context=int(context.max()),
        counts_cpu=counts.tolist(),
        covers_step=int(counts.sum()) == int(starts_all[num_reqs]),
    )
    _mark("forward")


# --- 3. attention (inside the attention impl's forward) ---------------------------------------


@sync_checked
def tree_attention(impl, query, key, value, kv_cache, output, group: int) -> None:
    """The tree requests' rows of ``output``: context part + tree part, merged."""
    span = PROFILE.attention_span() if PROFILE is not None else contextlib.nullcontext()
    with span:
        _tree_attention(impl, query, key, value, kv_cache, output, group)


def _tree_attention(impl, query, key, value, kv_cache, output, group: int) -> None:
    tb = STATE.batch
    if TREE_ATTENTION != "merge" and not hasattr(impl, "isa"):
        from ddtree.vllm_plugin import triton_tree_attention

        triton_tree_attention.tree_attention(
            query, key, value, kv_cache, output.view(query.shape), tb.rows, tb.counts,
            tb.tree.mask, tb.context_i32, tb.block_tables[group], impl.scale,
        )  # fmt: skip
        return
    query_flat = query.index_select(0, tb.flat_rows)  # [N, H, hd]
    if hasattr(impl, "isa"):  # vLLM's CPU attention
        out_p, lse_p = cpu_tree_attention.prefix_attention(
            query_flat, kv_cache, tb.block_tables[group], tb.context_cpu, tb.counts_cpu,
            impl.scale,
        )  # fmt: skip
    else:
        out_p, lse_p = flash_tree_attention.prefix_attention(
            impl, query_flat, kv_cache, tb.block_tables[group], tb.cu_queries,
            tb.context_i32, tb.rows.shape[1], tb.max_context,
        )  # fmt: skip
    out_s, lse_s = suffix_attention(query, key, value, tb.rows, tb.tree.mask, impl.scale)
    out_s, lse_s = out_s.index_select(0, tb.flat_slots), lse_s.index_select(0, tb.flat_slots)
    merged = merge(out_p, lse_p, out_s, lse_s)
    output.index_copy_(0, tb.flat_rows, merged.view((-1,) + output.shape[1:]).to(output.dtype))


# --- 4. verification (replaces the rejection sampler for DDTree) ------------------------------


def target_tokens(
    logits: torch.Tensor, sampling_metadata, request_of_row: torch.Tensor, first_row: list[int]
) -> torch.Tensor:
    """The target's token at every logits row ``[n]``: argmax for greedy requests, else a
    sample of the temperature / top-k / top-p processed distribution (per request).
    ``request_of_row [n]`` (device) and ``first_row`` (host, one per request + the end)."""
    greedy = logits.argmax(-1)
    if sampling_metadata.all_greedy:
        return greedy
    temperature = sampling_metadata.temperature.index_select(0, request_of_row)  # [n]
    is_greedy = temperature < 1e-5
    scaled = logits.float() / torch.where(is_greedy, 1.0, temperature)[:, None]
    vocab = logits.shape[-1]
    top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
    if top_k is not None or top_p is not None:
        ordered, order = scaled.sort(-1, descending=True)
        if top_k is not None:
            k = top_k.index_select(0, request_of_row).long()
            k = torch.where((k <= 0) | (k > vocab), vocab, k)
            kth = ordered.gather(1, (k - 1)[:, None])
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        if top_p is not None:
            p = top_p.index_select(0, request_of_row).float()[:, None]
            probs = ordered.softmax(-1)
            drop = (probs.cumsum(-1) - probs >= p) & (p < 1)  # keeps the token crossing p
            ordered = ordered.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
    probs = scaled.softmax(-1)
    sampled = probs.div(torch.empty_like(probs).exponential_()).argmax(-1)
    for req, generator in sampling_metadata.generators.items():  # seeded requests only
        rows = slice(first_row[req], first_row[req + 1])
        sampled[rows] = torch.multinomial(probs[rows], 1, generator=generator).squeeze(1)
    return torch.where(is_greedy, greedy, sampled)


@sync_checked
def tree_sample(runner, logits: torch.Tensor, metadata, sampling_metadata):
    """Sampler output ``[R, max_spec_len + 1]``: each request's accepted tokens then its bonus."""
    from vllm.v1.outputs import SamplerOutput

    STATE.attention_active = False
    _mark("sample")
    tb = STATE.batch
    num_reqs = runner.input_batch.num_reqs
    device = logits.device
    counts = torch.tensor(metadata.num_draft_tokens[:num_reqs]) + 1  # logits rows per request
    first_row = torch.nn.functional.pad(counts.cumsum(0), (1, 0))  # [num_reqs + 1]
    request_of_row = torch.repeat_interleave(torch.arange(num_reqs), counts)
    num_slots = tb.rows.shape[1]
    request_of_row_d, first_row_d = _to_device([request_of_row, first_row[:num_reqs]], device)
    tokens = target_tokens(logits, sampling_metadata, request_of_row_d, first_row.tolist())

    width = metadata.max_spec_len + 1
    out = tokens.index_select(0, first_row_d).to(torch.int32)[:, None]  # bonus-only default
    out = torch.nn.functional.pad(out, (0, width - 1), value=-1)  # [num_reqs, width]
    slot = torch.arange(num_slots, device=device)
    slot_rows = first_row_d.index_select(0, tb.batch_index)[:, None] + slot  # [R, Q]
    scheduled = tb.tree.tokens >= 0
    scheduled[:, 0] = True
    slot_rows = torch.where(scheduled, slot_rows, slot_rows[:, :1])
    acceptance = walk(tb.tree, tokens[slot_rows])
    cols = min(width, acceptance.emitted.shape[1])
    out[tb.batch_index, :cols] = acceptance.emitted[:, :cols].to(torch.int32)
    STATE.path = acceptance.path
    _mark("commit")
    _commit_kv(runner, tb, acceptance.path)
    _mark("vllm")
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def _commit_kv(runner, tb: TreeBatch, path: torch.Tensor) -> None:
    """Move the accepted path's K/V to the slots right after the context, in every target
    layer: slot ``context + path[k]`` -> ``context + k`` (k >= 1; the others copy onto
    themselves). The moves of all requests, padded to a bucket of requests with copies of
    slot 0 (vLLM's null block) onto itself, are one graph replay (``_layer_commit``)."""
    width = min(path.shape[1], tb.rows.shape[1])
    path = path[:, 1:width]  # [R, P]
    dst_rows = tb.rows[:, 1:width]
    src_rows = torch.where(path >= 0, tb.rows.gather(1, path.clamp(min=0)), dst_rows)
    num_reqs, num_moves = path.shape
    padding = (graphs.bucket(num_reqs) - num_reqs) * num_moves
    tables = runner.input_batch.block_table.block_tables
    moves = []
    for group in range(len(tables)):
        slots = tables[group].slot_mapping.gpu
        for rows in (src_rows, dst_rows):
            moves.append(torch.nn.functional.pad(slots[rows.flatten()], (0, padding)))
    _layer_commit(runner)(*moves)


def _layer_commit(runner) -> graphs.GraphCache:
    """``commit(src_0, dst_0, src_1, dst_1, ...)``: per KV group, cache slots ``src [M]`` ->
    ``dst [M]`` in every target layer of the group (made once, kept in ``STATE.commit``)."""
    if STATE.commit is not None:
        return STATE.commit
    layers = []
    for group, _, layer in target_attention_layers(runner):
        kv_cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
        layers.append((group, kv_cache, getattr(layer.impl, "isa", None)))

    def commit(*moves: torch.Tensor) -> None:
        for group, kv_cache, isa in layers:
            src, dst = moves[2 * group], moves[2 * group + 1]
            if isa is not None:  # vLLM's CPU attention
                cpu_tree_attention.copy_slots(kv_cache, src, dst, isa)
            else:
                flash_tree_attention.copy_slots(kv_cache, src, dst)

    # Warm-up before capture: dst onto itself (moving twice would not be harmless).
    STATE.commit = graphs.GraphCache(commit, warmup=lambda *m: [m[i | 1] for i in range(len(m))])
    return STATE.commit


def target_attention_layers(runner):
    """(kv-cache group, name, layer) of every attention layer of the target (not the drafter)."""
    drafter_layers = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
    context = runner.compilation_config.static_forward_context
    for group, spec in enumerate(runner.kv_cache_config.kv_cache_groups):
        for name in spec.layer_names:
            if name not in drafter_layers:
                yield group, name, context[name]


# --- 1 and 5. the proposer ----------------------------------------------------------------------


def draft_depth(spec) -> int:
    """D: the positions the DFlash drafter of speculative config ``spec`` proposes per step
    (its block size - 1; block size 16 when the checkpoint does not say)."""
    return (getattr(spec.draft_model_config.hf_config, "block_size", None) or 16) - 1


def make_proposer_class(base):
    """A DFlashProposer subclass that drafts D positions and returns a B-node tree."""

    class DDTreeProposer(base):
        def __init__(self, vllm_config, device, runner=None):
            spec = vllm_config.speculative_config
            options: DDTreeOptions = spec.ddtree
            depth = draft_depth(spec)
            # The drafter runs 1 + D queries per request while vLLM schedules B tree nodes: its
            # query buffers are sized from num_speculative_tokens, so size them for max(B, D)
            # (B < D would overflow them) and give vLLM back B afterwards.
            spec.num_speculative_tokens = max(options.budget, depth)
            try:
                super().__init__(vllm_config, device, runner)
            finally:
                spec.num_speculative_tokens = options.budget
            self.ddtree = options
            self.draft_depth = depth
            STATE.depth = self.draft_depth
            self._draft_logits = None

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            logits = self.model.compute_logits(hidden_states)  # [R*D, V]
            self._draft_logits = logits
            return logits.argmax(-1), None

        def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                    target_hidden_states, next_token_ids, token_indices_to_sample,
                    common_attn_metadata, sampling_metadata, *args, **kwargs):  # fmt: skip
            _mark("draft")
            _reorder_context(target_token_ids, target_positions, target_hidden_states)
            super().propose(
                self.draft_depth, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata,
                sampling_metadata, *args, **kwargs,
            )  # fmt: skip
            _mark("build")
            trees = self._propose_trees(next_token_ids.shape[0])
            _mark("rest")
            return trees

        @sync_checked
        def _propose_trees(self, num_reqs: int) -> torch.Tensor:
            """Trees from the kept draft logits; their node tokens ``[R, B_step]`` for vLLM.

            The requests are padded to a bucket (``graphs.bucket``) and B_step follows the
            bucket, so the tree stage is one graph replay per (bucket, B_step)."""
            padded = graphs.bucket(num_reqs)
            budget = self.ddtree.step_budget(padded, self.draft_depth)
            logits = self._draft_logits.view(num_reqs, self.draft_depth, -1)
            logprobs, token_ids = draft_topk(logits, min(budget, logits.shape[-1]))
            pad = (0, 0, 0, 0, 0, padded - num_reqs)
            proposal, draft_tokens = PROPOSAL(
                torch.nn.functional.pad(logprobs, pad), torch.nn.functional.pad(token_ids, pad),
                budget=budget, chain_seed=self.ddtree.chain_seed,
            )  # fmt: skip
            STATE.proposal = proposal  # graph outputs: read before the next replay
            req_ids = self.runner.input_batch.req_ids[:num_reqs]
            STATE.proposed = {req_id: i for i, req_id in enumerate(req_ids)}
            return draft_tokens[:num_reqs].clone()

    return DDTreeProposer


def fit_step_budgets(runner) -> None:
    """Start-up, once, before DDTree's graphs: the cost model's step budget per request
    bucket (``ddtree_max_verify_cost``; ``cost_model``)."""
    options: DDTreeOptions = runner.speculative_config.ddtree
    if options.max_verify_cost is None or options.bucket_budgets is not None:
        return
    depth = runner.drafter.draft_depth
    options.bucket_budgets = cost_model.fit_step_budgets(
        runner, options.budget, depth, options.max_verify_cost
    )


def capture_step_graphs(runner) -> None:
    """At start-up, after vLLM's own graphs: DDTree's tree-stage and KV-commit graphs for
    every request bucket up to max_num_seqs, so that no request pays a capture. (A shape not
    seen here is captured at its first use.)"""
    if not (graphs.ENABLED and runner.device.type == "cuda"):
        return
    options: DDTreeOptions = runner.speculative_config.ddtree
    depth = runner.drafter.draft_depth
    vocab = runner.model_config.get_vocab_size()
    device = runner.device
    commit = _layer_commit(runner)
    num_groups = len(runner.input_batch.block_table.block_tables)
    for reqs in graphs.buckets(runner.scheduler_config.max_num_seqs):
        budget = options.step_budget(reqs, depth)
        k = min(budget, vocab)
        PROPOSAL(
            torch.zeros(reqs, depth, k, device=device),
            torch.zeros(reqs, depth, k, dtype=torch.long, device=device),
            budget=budget, chain_seed=options.chain_seed,
        )  # fmt: skip
        # Moves of slot 0 (vLLM's null block) onto itself: harmless.
        moves = torch.zeros(reqs * min(depth, budget), dtype=torch.long, device=device)
        commit(*[moves] * (2 * num_groups))
    STATE.proposal = None


def _proposal(
    logprobs: torch.Tensor, token_ids: torch.Tensor, *, budget: int, chain_seed: bool
) -> tuple[DraftTree, torch.Tensor]:
    """The step's trees ``[R + 1, 1 + budget]`` (the last row all padding, for requests that
    have no tree) and their node tokens ``[R, budget]`` for vLLM (padding as token 0)."""
    trees = tree_from_ranked(logprobs, token_ids, budget, chain_seed=chain_seed)
    padding = padding_tree(1, 1 + budget, logprobs.shape[1], logprobs.device)
    fields = [k for k in trees.__dataclass_fields__ if getattr(trees, k) is not None]
    proposal = DraftTree(**{
        k: torch.cat([getattr(trees, k), getattr(padding, k)]) for k in fields
    })  # fmt: skip
    nodes = trees.tokens[:, 1:]
    return proposal, torch.where(nodes >= 0, nodes, 0)


PROPOSAL = graphs.GraphCache(_proposal)


@sync_checked
def _reorder_context(token_ids, positions, hidden_states) -> None:
    """Put each verified request's accepted path first, at sequential positions, in place."""
    tb, path = STATE.batch, STATE.path
    if tb is None or path is None:
        return
    num_reqs, num_slots = tb.rows.shape
    device = tb.rows.device
    slot = torch.arange(num_slots, device=device)
    step = torch.arange(path.shape[1], device=device).expand_as(path)
    rank = torch.full((num_reqs, num_slots + 1), 2 * num_slots, dtype=torch.long, device=device)
    rank.scatter_(1, torch.where(path >= 0, path, num_slots), step)  # pads land in column Q
    rank = rank[:, :num_slots]
    key = torch.where(rank < 2 * num_slots, rank, num_slots + slot)
    order = key.argsort(1)  # [R, Q]: the path's slots, then the others in slot order
    source = tb.rows.gather(1, order).flatten().index_select(0, tb.flat_slots)  # [N]
    token_ids.index_copy_(0, tb.flat_rows, token_ids.index_select(0, source))
    hidden_states.index_copy_(0, tb.flat_rows, hidden_states.index_select(0, source))
    sequential = (tb.context[:, None] + slot).flatten().index_select(0, tb.flat_slots)
    positions.index_copy_(0, tb.flat_rows, sequential.to(positions.dtype))
