"""Stage 3: the target's token at every tree node, the walk, and vLLM's sampler output.

Replaces the chain's rejection sampler for DDTree steps: logits exist for every scheduled
position (one row per node), so each node gets the target's argmax or a sample of its
processed distribution (``ddtree.sampling``), and ``ddtree.walk`` keeps the longest agreeing
path. The output is vLLM's layout: ``[accepted..., bonus]`` per request, -1 padded.
"""

from __future__ import annotations

import torch

from ddtree.sampling import process_logits
from ddtree.verify import walk
from ddtree.vllm_plugin import gdn, graphs
from ddtree.vllm_plugin.debug import AcceptanceLog, sync_checked
from ddtree.vllm_plugin.state import EngineState
from ddtree.vllm_plugin.v1 import options
from ddtree.vllm_plugin.v1.commit import commit_kv
from ddtree.vllm_plugin.v1.prepare import to_device


def target_tokens(
    logits: torch.Tensor,
    sampling_metadata,
    request_of_row: torch.Tensor,
    first_row: list[int],
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token at every logits row ``[n]`` and the logits it was drawn from: argmax
    for greedy requests (the logits as given), else a sample of the temperature / min-p /
    top-k / top-p processed distribution (per request). ``request_of_row [n]`` (device),
    ``first_row`` (host, one per request + the end), ``min_p [n]`` (0: off)."""
    greedy = logits.argmax(-1)
    if sampling_metadata.all_greedy:
        return greedy, logits
    per_row = [
        None if t is None else t.index_select(0, request_of_row)
        for t in (sampling_metadata.top_k, sampling_metadata.top_p)
    ]
    temperature = sampling_metadata.temperature.index_select(0, request_of_row)  # [n]
    is_greedy = temperature < 1e-5
    processed = process_logits(
        logits, torch.where(is_greedy, 1.0, temperature), *per_row, min_p=min_p
    )
    probs = processed.softmax(-1)
    sampled = probs.div(torch.empty_like(probs).exponential_()).argmax(-1)
    for req, generator in sampling_metadata.generators.items():  # seeded requests only
        rows = slice(first_row[req], first_row[req + 1])
        sampled[rows] = torch.multinomial(probs[rows], 1, generator=generator).squeeze(1)
    drawn_from = torch.where(is_greedy[:, None], logits.float(), processed)
    return torch.where(is_greedy, greedy, sampled), drawn_from


@sync_checked
def tree_sample(engine: EngineState, runner, logits: torch.Tensor, metadata, sampling_metadata):
    """Sampler output ``[R, max_spec_len + 1]``: each request's accepted tokens then its bonus;
    the accepted paths' K/V moved into place."""
    from vllm.v1.outputs import SamplerOutput

    engine.attention_active = False
    engine.mark("sample")
    tb = engine.batch
    num_reqs = runner.input_batch.num_reqs
    device = logits.device
    counts = torch.tensor(metadata.num_draft_tokens[:num_reqs]) + 1  # logits rows per request
    first_row = torch.nn.functional.pad(counts.cumsum(0), (1, 0))  # [num_reqs + 1]
    request_of_row = torch.repeat_interleave(torch.arange(num_reqs), counts)
    num_slots = tb.rows.shape[1]
    request_of_row_d, first_row_d = to_device([request_of_row, first_row[:num_reqs]], device)
    step = options.step_options(runner, sampling_metadata, num_reqs)
    processed, min_p = logits, None
    if step is not None:
        with graphs.sync_allowed():  # host reads of the trees: requests with options only
            trees = tb.tree, tb.batch_index.tolist(), counts.tolist()
            row_depth, row_path = options.row_paths(*trees)
            processed = options.apply_options(
                logits, step, sampling_metadata, request_of_row.tolist(), row_depth, row_path
            )
        if step.any_min_p:
            min_p = torch.tensor(step.min_p, device=device).index_select(0, request_of_row_d)
    tokens, drawn_from = target_tokens(
        processed, sampling_metadata, request_of_row_d, first_row.tolist(), min_p
    )

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
    logprobs = None
    if sampling_metadata.max_num_logprobs is not None:
        path_slots = torch.zeros(num_reqs, width, dtype=torch.long, device=device)
        path_slots[tb.batch_index, :cols] = acceptance.path[:, :cols].clamp(min=0)
        logprobs = options.path_logprobs(
            runner.sampler,
            logits,
            drawn_from,
            sampling_metadata.max_num_logprobs,
            first_row_d[:, None] + path_slots,
            out,
        )
    engine.path = acceptance.path
    verified = (tb.tree.tokens[:, 1:] >= 0).sum(1)  # [R]: tree nodes each request verified
    if engine.settings.acceptance_every:
        if engine.acceptance is None:
            engine.acceptance = AcceptanceLog(
                engine.settings.acceptance_every, engine.options.budget, device
            )
        engine.acceptance.update(acceptance.path, verified)
        engine.acceptance.step()
    if engine.tuner is not None:
        engine.tuner.walked(acceptance.path, verified)
        engine.tuner.step()
    engine.mark("commit")
    commit_kv(engine, runner, tb, acceptance.path)
    if engine.gdn_pending:
        gdn.commit(engine, acceptance.path)
    engine.mark("vllm")
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)
