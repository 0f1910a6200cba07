"""Stage 5: the drafter's context, its forward, and the next step's trees.

``DDTreeProposer`` is vLLM's DFlash proposer asked for D positions: it keeps the drafter's
logits, builds the trees (``ddtree.tree``; the tree stage graphed per request bucket) and
returns each tree's B node tokens as vLLM's "draft tokens". Before the drafter runs, each
verified request's accepted path is moved to the front of its rows at sequential positions
(``reorder_context``), so vLLM's own prefix logic hides the rejected nodes.
"""

from __future__ import annotations

import torch

from ddtree.tree import DraftTree, draft_topk, tree_from_ranked
from ddtree.vllm_plugin import config, cost_model, graphs
from ddtree.vllm_plugin.debug import sync_checked
from ddtree.vllm_plugin.state import EngineState, concat_trees, padding_tree
from ddtree.vllm_plugin.v1.commit import layer_commit


def proposal(
    logprobs: torch.Tensor, token_ids: torch.Tensor, *, budget: int, chain_seed: bool
) -> tuple[DraftTree, torch.Tensor]:
    """The step's trees ``[R + 1, 1 + budget]`` (the last row all padding, for requests that
    have no tree) and their node tokens ``[R, budget]`` for vLLM (padding as token 0)."""
    trees = tree_from_ranked(logprobs, token_ids, budget, chain_seed=chain_seed)
    padding = padding_tree(1, 1 + budget, logprobs.shape[1], logprobs.device)
    nodes = trees.tokens[:, 1:]
    return concat_trees(trees, padding), torch.where(nodes >= 0, nodes, 0)


def new_engine(options: config.DDTreeOptions, depth: int) -> EngineState:
    engine = EngineState(options=options, depth=depth, settings=config.SETTINGS)
    engine.proposal_graphs = graphs.GraphCache(
        proposal, pool=engine.graph_pool, enabled=engine.settings.cuda_graphs
    )
    return engine


def make_proposer_class(base, check_settings):
    """A subclass of vLLM's DFlash proposer ``base`` that drafts D positions and returns a
    B-node tree per request; its :class:`EngineState` is ``self.engine``.
    ``check_settings(vllm_config)`` refuses engine settings this runner's tree path lacks."""

    class DDTreeProposer(base):
        def __init__(self, vllm_config, device, runner=None):
            check_settings(vllm_config)
            spec = vllm_config.speculative_config
            options = config.options_of(spec)
            depth = config.draft_depth(spec)
            # The drafter runs 1 + D queries per request while vLLM schedules B tree nodes: its
            # query buffers are sized from num_speculative_tokens, so size them for max(B, D)
            # (B < D would overflow them) and give vLLM back B afterwards.
            spec.num_speculative_tokens = max(options.budget, depth)
            try:
                super().__init__(vllm_config, device, runner)
            finally:
                spec.num_speculative_tokens = options.budget
            self.runner = runner
            self.draft_depth = depth
            self.engine = new_engine(options, depth)
            self._draft_logits = None

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            logits = self.model.compute_logits(hidden_states)  # [R*D, V]
            self._draft_logits = logits
            return logits.argmax(-1), None

        def propose(
            self,
            num_speculative_tokens,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            token_indices_to_sample,
            common_attn_metadata,
            sampling_metadata,
            *args,
            **kwargs,
        ):
            self.engine.mark("draft")
            reorder_context(self.engine, target_token_ids, target_positions, target_hidden_states)
            super().propose(
                self.draft_depth,
                target_token_ids,
                target_positions,
                target_hidden_states,
                next_token_ids,
                token_indices_to_sample,
                common_attn_metadata,
                sampling_metadata,
                *args,
                **kwargs,
            )
            self.engine.mark("build")
            trees = self._propose_trees(next_token_ids.shape[0])
            self.engine.mark("rest")
            return trees

        @sync_checked
        def _propose_trees(self, num_reqs: int) -> torch.Tensor:
            """Trees from the kept draft logits; their node tokens ``[R, B_step]`` for vLLM.

            The requests are padded to a bucket (``graphs.bucket``) and B_step follows the
            bucket, so the tree stage is one graph replay per (bucket, B_step)."""
            engine = self.engine
            padded = graphs.bucket(num_reqs)
            budget = engine.options.step_budget(padded, self.draft_depth)
            logits = self._draft_logits.view(num_reqs, self.draft_depth, -1)
            logprobs, token_ids = draft_topk(logits, min(budget, logits.shape[-1]))
            pad = (0, 0, 0, 0, 0, padded - num_reqs)
            trees, draft_tokens = engine.proposal_graphs(
                torch.nn.functional.pad(logprobs, pad),
                torch.nn.functional.pad(token_ids, pad),
                budget=budget,
                chain_seed=engine.options.chain_seed,
            )
            engine.proposal = trees  # graph outputs: read before the next replay
            if engine.tuner is not None:
                rows = trees.scores.shape[0]  # the bucket + a padding row
                real = torch.arange(rows, device=trees.scores.device) < num_reqs
                engine.tuner.proposed(trees.scores, real)
            req_ids = self.runner.input_batch.req_ids[:num_reqs]
            engine.proposed = {req_id: i for i, req_id in enumerate(req_ids)}
            _share_tree_shapes(engine, self.runner, req_ids, trees.parents)
            return draft_tokens[:num_reqs].clone()

    return DDTreeProposer


def _share_tree_shapes(engine: EngineState, runner, req_ids: list[str], parents) -> None:
    """The parent slot of every draft of the structured-output requests, for the scheduler's
    grammar bitmask (``v1/grammar.py``). A host copy: only when such a request is running."""
    shapes = engine.options.tree_parents
    shapes.clear()
    structured = [
        i
        for i, req_id in enumerate(req_ids)
        if runner.requests[req_id].sampling_params.structured_outputs is not None
    ]
    if structured:
        with graphs.sync_allowed():
            rows = parents[: len(req_ids)].tolist()
        for i in structured:
            shapes[req_ids[i]] = rows[i][1:]


@sync_checked
def reorder_context(engine: EngineState, token_ids, positions, hidden_states) -> None:
    """Put each verified request's accepted path first, at sequential positions, in place."""
    tb, path = engine.batch, engine.path
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
    # [T] positions, or [3, T] M-RoPE ones (Qwen3.5): each slot at its root's + slot.
    offset = slot.expand(num_reqs, -1).flatten().index_select(0, tb.flat_slots)  # [N]
    roots = tb.rows[:, :1].expand(-1, num_slots).flatten().index_select(0, tb.flat_slots)
    sequential = positions.index_select(-1, roots) + offset.to(positions.dtype)
    positions.index_copy_(-1, tb.flat_rows, sequential)


def fit_step_budgets(engine: EngineState, runner) -> None:
    """Start-up, once, before DDTree's graphs: the cost model's step budget per request
    bucket (``ddtree_max_verify_cost``; ``cost_model``)."""
    options = engine.options
    if options.max_verify_cost is None or options.bucket_budgets is not None:
        return
    options.bucket_budgets = cost_model.fit_step_budgets(
        runner, options.budget, engine.depth, options.max_verify_cost
    )


def capture_step_graphs(engine: EngineState, runner) -> None:
    """At start-up, after vLLM's own graphs: DDTree's tree-stage and KV-commit graphs for
    every request bucket up to max_num_seqs, so that no request pays a capture. (A shape not
    seen here is captured at its first use.)"""
    if not (engine.settings.cuda_graphs and runner.device.type == "cuda"):
        return
    options, depth = engine.options, engine.depth
    vocab = runner.model_config.get_vocab_size()
    device = runner.device
    commit = layer_commit(engine, runner)
    num_groups = len(runner.input_batch.block_table.block_tables)
    for reqs in graphs.buckets(runner.scheduler_config.max_num_seqs):
        budget = options.step_budget(reqs, depth)
        k = min(budget, vocab)
        engine.proposal_graphs(
            torch.zeros(reqs, depth, k, device=device),
            torch.zeros(reqs, depth, k, dtype=torch.long, device=device),
            budget=budget,
            chain_seed=options.chain_seed,
        )
        # Moves of slot 0 (vLLM's null block) onto itself: harmless.
        moves = torch.zeros(reqs * min(depth, budget), dtype=torch.long, device=device)
        commit(*[moves] * (2 * num_groups))
