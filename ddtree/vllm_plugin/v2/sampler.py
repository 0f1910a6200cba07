"""The tree sampler of the V2 model runner (it takes the rejection sampler's place).

vLLM's own sampler draws the target's token at every logits row (one per tree node): argmax
for greedy requests, else a Gumbel-max sample of the processed distribution keyed by the
request's seed and the row's position. A node at depth d sits at position ``context + d``, the
position at which a plain decode would draw that token, so seeded requests draw what no-spec
draws. ``ddtree.walk`` keeps the longest agreeing path; the output is vLLM's layout
(``[accepted..., bonus]`` per request with device-side counts), and the accepted paths' K/V
are moved into place.
"""

from __future__ import annotations

import torch

from ddtree.verify import walk
from ddtree.vllm_plugin.v2.engine import TreeEngine


class TreeSampler:
    def __init__(self, engine: TreeEngine, sampler, num_speculative_steps: int):
        self.engine = engine
        self.sampler = sampler  # vLLM's V2 Sampler: sampling states, processing, Gumbel-max
        self.width = num_speculative_steps + 1  # B + 1 columns of sampled tokens

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None):
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        engine = self.engine
        rows = input_batch.logits_indices
        target, _ = self.sampler.sample(
            logits,
            input_batch.expanded_idx_mapping,
            input_batch.idx_mapping_np,
            input_batch.positions[rows],
            input_batch.input_ids[rows],
            input_batch.expanded_local_pos,
        )
        num_reqs = input_batch.num_reqs
        cu_logits = input_batch.cu_num_logits
        first = cu_logits[:num_reqs].long()[:, None]  # [R, 1]
        num_logits = (cu_logits[1 : num_reqs + 1] - cu_logits[:num_reqs]).long()  # [R]
        slots = engine.tables.tokens.shape[1]
        slot = torch.arange(slots, device=logits.device)
        logit_rows = torch.where(slot < num_logits[:, None], first + slot, first)  # [R, Q]
        trees = engine.tables.batch_trees(num_reqs, num_logits)
        if engine.settings.tree_kernels == "fused":
            from ddtree.kernels import walk_fused

            acceptance = walk_fused(trees, target.long()[logit_rows])
        else:
            acceptance = walk(trees, target.long()[logit_rows])

        sampled = torch.full((num_reqs, self.width), -1, dtype=torch.long, device=logits.device)
        cols = min(self.width, acceptance.emitted.shape[1])
        sampled[:, :cols] = acceptance.emitted[:, :cols]
        # A chunk of a prefill that is not its last emits nothing (vLLM's rule).
        prefill_len = self.sampler.req_states.prefill_len.gpu[input_batch.idx_mapping.long()]
        chunk = input_batch.seq_lens[:num_reqs] < prefill_len
        num_sampled = torch.where(chunk, 0, acceptance.num_accepted + 1)
        num_rejected = torch.where(chunk, 0, num_logits - num_sampled).int()
        num_sampled = num_sampled.int()
        engine.tables.path[:num_reqs].copy_(acceptance.path)
        engine.walked = True
        engine.commit_kv(input_batch.query_start_loc, num_reqs)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs_tensors=None,
            num_nans=None,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )
