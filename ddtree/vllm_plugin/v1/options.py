"""Request options at every tree node (V1 runner): each node is processed as if it were the
next decode step of its own path.

vLLM's chain processes its k-th draft row with the history ``output + drafts[:k]``; a tree
node's history is ``output + the tokens on its root path`` and its output length is
``len(output) + depth``. With those two per logits row, the options are vLLM's own
operations, in vLLM's order (``Sampler.apply_logits_processors``): allowed token ids, bad
words, logit bias and min_tokens, then penalties. min_p acts after temperature
(``ddtree.sampling.process_logits``). Logprobs are gathered at the accepted path's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree import DraftTree


@dataclass
class StepOptions:
    """The step's requests' options that change the target's distribution (host-side)."""

    outputs: list[list[int]]  # per request row: its output tokens so far (the root last)
    logit_bias: dict[int, dict[int, float]]  # request row -> {token: bias}
    min_tokens: dict[int, tuple[int, list[int]]]  # request row -> (min_tokens, stop tokens)
    min_p: list[float]  # per request row (0: off)

    @property
    def any_min_p(self) -> bool:
        return any(p > 0 for p in self.min_p)


def step_options(runner, sampling_metadata, num_reqs: int) -> StepOptions | None:
    """This step's options, or None when no request uses any (the fast path)."""
    batch = runner.input_batch
    logit_bias, min_tokens, min_p = {}, {}, []
    outputs = batch.req_output_token_ids[:num_reqs]  # always kept (sampling metadata's not)
    for q in range(num_reqs):
        params = runner.requests[batch.req_ids[q]].sampling_params
        if params.logit_bias:
            logit_bias[q] = {int(t): float(b) for t, b in params.logit_bias.items()}
        out_len = len(outputs[q])
        if params.min_tokens and out_len < params.min_tokens and params.all_stop_token_ids:
            min_tokens[q] = (params.min_tokens, sorted(params.all_stop_token_ids))
        min_p.append(float(params.min_p or 0.0))
    # penalties or bad words: each row needs its own token history
    needs_history = bool(sampling_metadata.bad_words_token_ids) or not (
        sampling_metadata.no_penalties
    )
    options = StepOptions(outputs, logit_bias, min_tokens, min_p)
    mask = sampling_metadata.allowed_token_ids_mask
    if logit_bias or min_tokens or options.any_min_p or needs_history or mask is not None:
        return options
    return None


def row_paths(
    tree: DraftTree, batch_index: list[int], counts: list[int]
) -> tuple[list[int], list[list[int]]]:
    """Per logits row of the step (requests in batch order, ``counts[q]`` rows each): its
    depth and the draft tokens on its root path (root excluded, the row's own token last).
    ``batch_index[r]``: the request row of tree ``r``; requests without a tree have one row."""
    tree_of = {q: r for r, q in enumerate(batch_index)}
    tokens, ancestors, depths = (t.tolist() for t in (tree.tokens, tree.ancestors, tree.depths))
    row_depth, row_path = [], []
    for q, count in enumerate(counts):
        r = tree_of.get(q)
        for slot in range(count):
            depth = 0 if r is None else depths[r][slot]
            row_depth.append(depth)
            chain = [] if r is None else ancestors[r][slot][:depth]
            row_path.append([tokens[r][a] for a in reversed(chain)])
    return row_depth, row_path


def apply_options(
    logits: torch.Tensor,
    options: StepOptions,
    sampling_metadata,
    request_of_row: list[int],
    row_depth: list[int],
    row_path: list[list[int]],
) -> torch.Tensor:
    """float32 ``[n, V]``: the logits every row's greedy choice reads (before temperature)."""
    from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    logits = logits.float().clone()
    device = logits.device
    rows_d = torch.tensor(request_of_row, device=device)
    outputs = options.outputs
    histories = [outputs[q] + path for q, path in zip(request_of_row, row_path, strict=True)]
    if sampling_metadata.allowed_token_ids_mask is not None:
        logits.masked_fill_(sampling_metadata.allowed_token_ids_mask[rows_d], float("-inf"))
    for row, q in enumerate(request_of_row):
        for word in sampling_metadata.bad_words_token_ids.get(q, ()):
            _apply_bad_words_single_batch(logits[row], [word], histories[row])
    bias_rows, bias_tokens, bias_values = [], [], []
    ban_rows, ban_tokens = [], []
    for row, q in enumerate(request_of_row):
        for token, bias in options.logit_bias.get(q, {}).items():
            bias_rows.append(row), bias_tokens.append(token), bias_values.append(bias)
        if q in options.min_tokens:
            min_tokens, stops = options.min_tokens[q]
            if len(outputs[q]) + row_depth[row] < min_tokens:
                ban_rows += [row] * len(stops)
                ban_tokens += stops
    if bias_rows:
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_tokens, device=device))
        logits[index] += torch.tensor(bias_values, device=device)
    if ban_rows:
        index = (torch.tensor(ban_rows, device=device), torch.tensor(ban_tokens, device=device))
        logits[index] = float("-inf")
    if not sampling_metadata.no_penalties:
        logits = apply_all_penalties(
            logits,
            sampling_metadata.prompt_token_ids[rows_d],
            sampling_metadata.presence_penalties[rows_d],
            sampling_metadata.frequency_penalties[rows_d],
            sampling_metadata.repetition_penalties[rows_d],
            histories,
        )
    return logits


def path_logprobs(
    sampler,
    raw_logits: torch.Tensor,
    processed_logits: torch.Tensor,
    num_logprobs: int,
    path_rows: torch.Tensor,
    sampled: torch.Tensor,
):
    """vLLM's ``LogprobsTensors`` of the sampled tokens ``[R, W]`` (-1 padded), one row per
    output column, read at the logits row that produced it (``path_rows [R, W]``); what
    ``RejectionSampler.parse_output`` filters. Which logits: the sampler's ``logprobs_mode``
    (raw: the model's; processed: the distribution the token was drawn from)."""
    mode = sampler.logprobs_mode
    source = processed_logits if mode.startswith("processed") else raw_logits
    picked = source.index_select(0, path_rows.flatten()).float()  # [R * W, V]
    scores = picked if mode.endswith("logits") else sampler.compute_logprobs(picked)
    k = scores.shape[1] if num_logprobs == -1 else num_logprobs
    return sampler.gather_logprobs(scores, k, sampled.flatten().clamp(min=0).long())
