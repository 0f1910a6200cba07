"""The tree sampler of the V2 model runner (it takes the rejection sampler's place).

vLLM's own sampler draws the target's token at every logits row (one per tree node): argmax
for greedy requests, else a Gumbel-max sample of the processed distribution keyed by the
request's seed and the row's position. A node at depth d sits at position ``context + d``, the
position at which a plain decode would draw that token, so seeded requests draw what no-spec
draws. ``ddtree.walk`` keeps the longest agreeing path; the output is vLLM's layout
(``[accepted..., bonus]`` per request with device-side counts), and the accepted paths' K/V
are moved into place.

A step whose every tree is its forced chain (``TreeEngine.chain_trees``: K <= D drafts per
request) is the chain's verify: it goes to vLLM's own rejection sampler (one-hot drafts,
lossless, greedy identical to the walk), whose accepted tokens need no K/V move, without the
tail's launches. Hybrid targets keep the walk: their Gated DeltaNet commit replays the path.
"""

from __future__ import annotations

import functools

import torch

from ddtree.verify import walk
from ddtree.vllm_plugin import graphs
from ddtree.vllm_plugin.debug import AcceptanceLog, sync_checked
from ddtree.vllm_plugin.v2 import kernels
from ddtree.vllm_plugin.v2.bad_words import apply_tree_bad_words
from ddtree.vllm_plugin.v2.engine import TreeEngine
from ddtree.vllm_plugin.v2.penalties import apply_tree_penalties


class TreeSampler:
    def __init__(self, engine: TreeEngine, sampler, num_speculative_steps: int, chain_sampler=None):
        self.engine = engine
        self.sampler = sampler  # vLLM's V2 Sampler: sampling states, processing, Gumbel-max
        self.chain_sampler = chain_sampler  # vLLM's RejectionSampler: chain-sized steps
        engine.chain_verify = chain_sampler is not None
        self.width = num_speculative_steps + 1  # B + 1 columns of sampled tokens
        # walk + output + KV commit: one graph per request bucket (fixed shapes, ~80 launches)
        self.tail = graphs.GraphCache(
            self._tail, warmup=_harmless, pool=engine.graph_pool,
            enabled=engine.settings.cuda_graphs, inputs_in_place=True,
        )  # fmt: skip
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}  # bucket -> the tail's inputs
        # Each node's history is its root path, not the rows before it: vLLM's sampler calls
        # these in place of its own penalty and bad-word steps.
        penalties = getattr(sampler, "penalties_state", None)
        if penalties is not None:
            penalties.apply_penalties = functools.partial(
                apply_tree_penalties, penalties, engine.tables
            )
        bad_words = getattr(sampler, "bad_words_state", None)
        if bad_words is not None:
            bad_words.apply_bad_words = functools.partial(
                apply_tree_bad_words, bad_words, engine.tables
            )
        if engine.settings.acceptance_every:
            engine.acceptance = AcceptanceLog(
                engine.settings.acceptance_every, engine.options.budget, engine.tables.path.device
            )

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None):
        self.engine.mark("sample")
        output = self._sample(logits, input_batch)
        self.engine.mark("vllm")
        return output

    def _sample(self, logits: torch.Tensor, input_batch):
        if self.engine.chain_step():
            return self._chain_step(logits, input_batch)
        rows = input_batch.logits_indices
        return_logprobs = self.sampler.returns_logprobs(input_batch.idx_mapping_np)
        target, processed = self.sampler.sample(
            logits,
            input_batch.expanded_idx_mapping,
            input_batch.idx_mapping_np,
            input_batch.positions[rows],
            input_batch.input_ids[rows],
            input_batch.expanded_local_pos,
            return_logprobs=return_logprobs,
        )
        return self._walk(target, processed, logits, input_batch, return_logprobs)

    @sync_checked
    def _walk(self, target, processed, logits, input_batch, return_logprobs: bool):
        """After vLLM's sampler drew ``target`` (a token per tree node): the walk, the KV
        commit and vLLM's output layout."""
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        num_reqs = input_batch.num_reqs
        # The tail's inputs, requests padded to a bucket (shapes repeat), in one launch into
        # the bucket's own buffers, which its graph reads in place. A chunk of a prefill that
        # is not its last emits nothing (vLLM's rule).
        inputs = self._tail_buffers(graphs.bucket(num_reqs), logits.device)
        kernels.tail_inputs(
            target, input_batch.cu_num_logits, input_batch.seq_lens,
            self.sampler.req_states.prefill_len.gpu, input_batch.idx_mapping,
            input_batch.query_start_loc, self.engine.tables.tree_rows, num_reqs, inputs,
        )  # fmt: skip
        sampled, num_sampled, num_rejected = self.tail(*inputs)
        self.engine.walked = True
        if self.engine.acceptance is not None:
            self.engine.acceptance.step()
        if self.engine.tuner is not None:
            self.engine.tuner.step()
        logprobs = None
        if return_logprobs:
            mode = self.sampler.logprobs_mode
            source = processed if mode.startswith("processed") else logits
            logprobs = self._path_logprobs(source, input_batch, sampled[:num_reqs])
        return SamplerOutput(  # copies: the graph's outputs are rewritten by its next replay
            sampled_token_ids=sampled[:num_reqs].clone(),
            logprobs_tensors=logprobs,
            num_nans=None,
            num_sampled=num_sampled[:num_reqs].clone(),
            num_rejected=num_rejected[:num_reqs].clone(),
        )

    def _chain_step(self, logits: torch.Tensor, input_batch):
        """The chain's verify by vLLM's rejection sampler (the drafts are the forced chain,
        one-hot: ``draft_logits`` None); the tuner and acceptance sums fed as a walk would."""
        output = self.chain_sampler(logits, input_batch, None)
        self._chain_stats(output, input_batch)
        return output

    @sync_checked
    def _chain_stats(self, output, input_batch) -> None:
        """The tuner's and DDTREE_ACCEPTANCE's sums after a chain-sized step."""
        engine = self.engine
        engine.walked = False  # the accepted rows are in place: nothing to reorder
        for stats in (engine.acceptance, engine.tuner):
            if stats is not None:  # what the walk's path would add, in one launch
                curve = stats.curve
                kernels.chain_acceptance(
                    output.num_sampled, input_batch.cu_num_logits, curve.rows, curve.accepted
                )
                stats.step()

    def capture_tails(self, max_num_reqs: int, device: torch.device) -> None:
        """The tail's graph of every request bucket, at start-up: otherwise the first step of
        each bucket pays its eager run (first-use compiles) and capture while serving."""
        for rows in graphs.buckets(max_num_reqs):
            self.tail.prepare(*self._tail_buffers(rows, device))

    @torch.inference_mode()
    def warm_chain_step(self, runner) -> None:
        """The chain-sized step's kernels — vLLM's rejection sampler at this engine's B, the
        chain sums — run once at start-up on vLLM's dummy batch of one request: their first
        use compiles Triton kernels (seconds), which an "auto" engine would otherwise pay in
        the served step where its tuner first picks a chain-sized tree. The sums go to
        scratch tensors, not to the tuner's curve."""
        if self.chain_sampler is None:
            return
        from vllm.v1.worker.gpu.input_batch import InputBatch

        hidden = torch.zeros(
            1, runner.model_config.get_hidden_size(), dtype=runner.dtype, device=runner.device
        )
        batch = InputBatch.make_dummy(1, 1, runner.input_buffers)
        output = self.chain_sampler(runner.model.compute_logits(hidden), batch, None)
        stats = self.engine.tuner or self.engine.acceptance  # one launch compiles it
        if stats is not None:
            curve = stats.curve
            kernels.chain_acceptance(
                output.num_sampled, batch.cu_num_logits,
                torch.zeros_like(curve.rows), torch.zeros_like(curve.accepted),
            )  # fmt: skip

    def _tail_buffers(self, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The tail's inputs for a bucket of ``rows`` requests (made once per bucket):
        node targets ``[rows, Q]``, num_logits, chunk, start ``[rows]`` long, active bool."""
        buffers = self._inputs.get(rows)
        if buffers is None:
            width = self.engine.tables.tokens.shape[1]
            longs = [torch.zeros(rows, dtype=torch.long, device=device) for _ in range(3)]
            buffers = (
                torch.zeros(rows, width, dtype=torch.long, device=device),
                *longs,
                torch.zeros(rows, dtype=torch.bool, device=device),
            )
            self._inputs[rows] = buffers
        return buffers

    def _path_logprobs(self, source: torch.Tensor, input_batch, sampled: torch.Tensor):
        """vLLM's logprobs of the sampled tokens (``sampled [R, B + 1]``, -1 padded), laid out
        as its rejection sampler lays them out. Runs only when a request asks for logprobs."""
        from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

        rows, tokens, cu = self.path_rows(input_batch, sampled)
        max_num_logprobs = self.sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
        return compute_topk_scores(
            source.index_select(0, rows),
            max(max_num_logprobs, 0),
            tokens,
            cu,
            logits_mode=self.sampler.logprobs_mode in ("raw_logits", "processed_logits"),
        )

    def path_rows(self, input_batch, sampled: torch.Tensor):
        """Request r's j-th output goes to row ``cu_num_logits[r] + j``; read there the
        logits row of the j-th node of its accepted path, and the token sampled there.
        Returns (logits rows ``[num_logits]``, tokens ``[num_logits]``, the offsets as a list
        when requests have several rows, else None). Host index arithmetic: this path runs
        only for logprobs requests."""
        import numpy as np

        cu_np = input_batch.cu_num_logits_np[: input_batch.num_reqs + 1]
        counts = np.diff(cu_np)
        request = np.repeat(np.arange(len(counts)), counts)  # [num_logits]
        local = np.arange(int(cu_np[-1])) - cu_np[request]
        request_d, local_d, first_d = (
            torch.from_numpy(np.asarray(a, dtype=np.int64)).to(sampled.device, non_blocking=True)
            for a in (request, local, cu_np[request])
        )
        path = self.engine.tables.path[: len(counts)]  # [R, D + 1] slots, -1 past the path
        slot = path[request_d, local_d.clamp(max=path.shape[1] - 1)]
        slot = torch.where((local_d < path.shape[1]) & (slot >= 0), slot, local_d)
        tokens = sampled[request_d, local_d.clamp(max=sampled.shape[1] - 1)].clamp(min=0)
        expanded = len(request) != len(counts)
        return first_d + slot, tokens, cu_np.tolist() if expanded else None

    def _tail(self, target, num_logits, chunk, start, active):
        """``target [R, Q]`` (the target's token per tree slot), ``num_logits [R]``, ``chunk
        [R]`` (1: a non-final prefill chunk), ``start [R]`` (first row), ``active [R]`` (bool:
        verifies a tree) -> sampled ``[R, B + 1]``, num_sampled, num_rejected; the walked paths
        stored and their K/V committed."""
        engine = self.engine
        trees = engine.tables.batch_trees(active, num_logits)
        if engine.settings.fused_tree_kernels:
            from ddtree.kernels import walk_fused

            acceptance = walk_fused(trees, target)
        else:
            acceptance = walk(trees, target)
        sampled = torch.full(
            (target.shape[0], self.width), -1, dtype=torch.long, device=target.device
        )
        cols = min(self.width, acceptance.emitted.shape[1])
        sampled[:, :cols] = acceptance.emitted[:, :cols]
        num_sampled = torch.where(chunk > 0, 0, acceptance.num_accepted + 1)
        num_rejected = torch.where(chunk > 0, 0, num_logits - num_sampled)
        engine.tables.path[: target.shape[0]].copy_(acceptance.path)
        verified = torch.where(active, num_logits - 1, 0)  # [R]: tree nodes verified
        if engine.acceptance is not None:  # persistent sums: recorded in the graph
            engine.acceptance.update(acceptance.path, verified)
        if engine.tuner is not None:  # likewise
            engine.tuner.walked(acceptance.path, verified)
        engine.commit(acceptance.path, active, start)
        if engine.gdn is not None:
            engine.gdn.commit(acceptance.path, active)
        return sampled, num_sampled.int(), num_rejected.int()


def _harmless(target, num_logits, chunk, start, active):
    """The warm-up before a capture runs the tail for real: with no request active it moves no
    K/V (a move run twice would not be harmless)."""
    return [target, num_logits, chunk, start, torch.zeros_like(active)]
