"""DDTree's speculator for the V2 model runner: vLLM's DFlash speculator, asked for D
positions, whose drafts become a B-node tree per request.

- Before the drafter runs, each verified request's accepted path is moved to the front of its
  rows (the drafter's hidden states) at sequential positions, so vLLM's DFlash input kernel,
  which takes the rows before the rejected suffix as context, reads exactly the accepted path.
- The drafter's forward, its logits, the per-depth top-k, the tree build and the store of each
  tree under its request's state row (:class:`TreeTables`) run inside the drafter's full CUDA
  graph (one per request bucket); padded rows of the graph write the tables' spare row.
"""

from __future__ import annotations

import torch

from ddtree.tree import chain_tree, draft_topk, tree_from_ranked
from ddtree.vllm_plugin import config, graphs
from ddtree.vllm_plugin.debug import sync_checked
from ddtree.vllm_plugin.v2 import kernels
from ddtree.vllm_plugin.v2.engine import TreeEngine, TreeTables


def make_speculator_class(base):
    """A subclass of vLLM's V2 ``DFlashSpeculator`` ``base`` that proposes trees."""

    class DDTreeSpeculator(base):
        _speculator_name = "DDTree"

        def __init__(self, vllm_config, device):
            spec = vllm_config.speculative_config
            options = config.options_of(spec)
            depth = config.draft_depth(spec)
            # The drafter: 1 + D queries per request; vLLM schedules the B tree nodes.
            spec.num_speculative_tokens = depth
            try:
                super().__init__(vllm_config, device)
            finally:
                spec.num_speculative_tokens = options.budget
            self.draft_logits = None  # the tree sampler needs no draft distribution
            tables = TreeTables(self.max_num_reqs, options.budget, depth, device)
            self.engine = TreeEngine(options, depth, config.SETTINGS, tables)
            # The widest tree a step of n requests may verify, by n's bucket (fixed per
            # drafter graph): "auto" schedules stay within full verify graphs.
            self.tree_budgets: dict[int, int] = {}
            self._graph_tokens = None
            if options.auto_budget:  # its sums are fed inside graphs: made before any capture
                from ddtree.vllm_plugin.tuner import BudgetTuner, full_graph_tokens

                self.engine.tuner = BudgetTuner(options, device, config.SETTINGS.tune_every)
                self._graph_tokens = full_graph_tokens(vllm_config)
            # The last proposal's node tokens [R, B] in batch order, for vLLM's draft tokens.
            self.draft_nodes = torch.zeros(
                self.max_num_reqs, options.budget, dtype=torch.long, device=device
            )
            self._fused_buffers = {}  # batch size -> ddtree.kernels.TreeBuffers

        def init_cudagraph_manager(self, cudagraph_mode):
            # The drafter always runs 1 + D queries per request: its graphs must not follow
            # the verify's budget per batch size (vLLM derives query lengths from it).
            spec = self.vllm_config.speculative_config
            saved = spec.num_speculative_tokens, spec.num_speculative_tokens_per_batch_size
            spec.num_speculative_tokens = self.num_speculative_steps
            spec.num_speculative_tokens_per_batch_size = None
            try:
                super().init_cudagraph_manager(cudagraph_mode)
            finally:
                spec.num_speculative_tokens, spec.num_speculative_tokens_per_batch_size = saved

        def _copy_request_inputs(self, num_reqs, idx_mapping, temperature, seeds):
            super()._copy_request_inputs(num_reqs, idx_mapping, temperature, seeds)
            # Padded rows of the drafter's graph store their trees in the tables' spare row.
            self.idx_mapping[num_reqs:].fill_(self.engine.tables.spare_row)

        def _generate_draft(
            self,
            num_reqs,
            num_tokens_padded,
            attn_metadata,
            slot_mappings,
            num_tokens_across_dp,
            cudagraph_runtime_mode=None,
        ):
            from vllm.config.compilation import CUDAGraphMode

            hidden = self._run_model(
                num_tokens_padded,
                attn_metadata,
                slot_mappings,
                num_tokens_across_dp,
                cudagraph_runtime_mode or CUDAGraphMode.NONE,
            )
            depth = self.num_speculative_steps
            rows = self.sample_indices[: num_reqs * depth]
            logits = self.model.compute_logits(hidden[rows]).view(num_reqs, depth, -1)
            self._store_trees(logits)

        def _store_trees(self, logits: torch.Tensor) -> None:
            """Trees of ``logits [R, D, V]`` (graph-recordable): each under its request's row
            of the tables, their node tokens into ``draft_nodes`` for vLLM."""
            num_reqs, depth, _ = logits.shape
            budget = self.tree_budget(num_reqs)
            if budget <= depth and self.engine.options.chain_seed:
                # A chain-sized bucket (large batches): the tree is the argmax chain, so it is
                # drafted as vLLM's chain drafts, without the vocabulary stage and tree build.
                # The tuner's predictions come from the buckets that build wider trees.
                trees = chain_tree(logits[:, :budget].argmax(-1), max_depth=depth)
            else:
                trees = self._build_trees(logits)
                if self.engine.tuner is not None:
                    real = self.idx_mapping[:num_reqs] != self.engine.tables.spare_row
                    self.engine.tuner.proposed(trees.scores, real)
            trees = self.engine.tables.widen(trees)
            self.engine.tables.store(self.idx_mapping[:num_reqs].long(), trees)
            nodes = trees.tokens[:, 1:]
            self.draft_nodes[:num_reqs].copy_(torch.where(nodes >= 0, nodes, 0))

        def tree_budget(self, num_reqs: int) -> int:
            """The budget of the trees built for ``num_reqs`` requests (a drafter graph's
            padded batch): for "auto" the widest its bucket may verify
            (``tuner.widest_budget``), with a schedule the largest it gives a batch size of
            the bucket, else ``ddtree_budget``. A smaller batch may schedule more drafts than
            a tree built for a larger one holds: ``TreeTables.widen`` pads such trees."""
            budget = self.tree_budgets.get(num_reqs)
            if budget is None:
                options = self.engine.options
                size = graphs.bucket(num_reqs)
                budget = options.budget
                if options.auto_budget:
                    from ddtree.vllm_plugin.tuner import widest_budget

                    budget = widest_budget(budget, self.engine.depth, size, self._graph_tokens)
                elif options.budget_schedule:  # the bucket's largest, as the V1 runner's
                    budget = options.step_budget(size, self.engine.depth)
                self.tree_budgets[num_reqs] = budget
            return budget

        def _build_trees(self, logits: torch.Tensor):
            """Trees of ``logits [R, D, V]``: torch ops, or ``ddtree.kernels`` (six launches)
            with outputs preallocated per batch size (before the graph that replays them)."""
            options = self.engine.options
            num_reqs, depth, vocab = logits.shape
            budget = self.tree_budget(num_reqs)
            if self.engine.settings.fused_tree_kernels:
                from ddtree.kernels import build_tree_fused, tree_buffers

                buffers = self._fused_buffers.get(num_reqs)
                if buffers is None:
                    buffers = tree_buffers(  # the tables keep ancestors, not the mask
                        num_reqs, depth, vocab, budget, logits.device, with_mask=False
                    )
                    self._fused_buffers[num_reqs] = buffers
                return build_tree_fused(
                    logits, budget, chain_seed=options.chain_seed, buffers=buffers
                )
            logprobs, token_ids = draft_topk(logits, min(budget, vocab))
            return tree_from_ranked(logprobs, token_ids, budget, chain_seed=options.chain_seed)

        @torch.inference_mode()
        def propose(
            self,
            input_batch,
            attn_metadata,
            slot_mappings,
            last_hidden_states,
            aux_hidden_states,
            num_sampled,
            num_rejected,
            *args,
            dummy_run=False,
            **kwargs,
        ):
            engine = self.engine
            if not dummy_run:
                engine.mark("draft")
            if engine.walked and not engine.chain_trees and not dummy_run:
                self._accepted_path_first(input_batch, aux_hidden_states or [last_hidden_states])
            engine.walked = False
            super().propose(
                input_batch,
                attn_metadata,
                slot_mappings,
                last_hidden_states,
                aux_hidden_states,
                num_sampled,
                num_rejected,
                *args,
                dummy_run=dummy_run,
                **kwargs,
            )
            if not dummy_run:
                engine.mark("rest")
            return self.draft_nodes[: input_batch.num_reqs]

        @sync_checked
        def _accepted_path_first(self, input_batch, hidden_states: list[torch.Tensor]) -> None:
            """Rows ``start + k`` of each verified request := rows ``start + path[k]`` (k <=
            accepted) in the drafter's inputs; its positions back to sequential."""
            tables = self.engine.tables
            num_reqs = input_batch.num_reqs
            start = input_batch.query_start_loc[:num_reqs].long()[:, None]
            path = tables.path[:num_reqs]  # [R, D + 1]
            live = (path >= 0) & (tables.tree_rows[:num_reqs, None] >= 0)
            step = torch.arange(path.shape[1], device=path.device)
            src = torch.where(live, start + path.clamp(min=0), start).flatten()
            dst = torch.where(live, start + step, start).flatten()
            for states in hidden_states:  # duplicates of dst copy a row onto itself
                states.index_copy_(0, dst, states.index_select(0, src))
            kernels.sequential_positions(
                tables.tree_rows[:num_reqs], input_batch.positions, input_batch.query_start_loc
            )

    return DDTreeSpeculator
