"""Per-request options DDTree cannot serve: one table, one wording, both runners.

The V1 runner's tree sampler applies every option of the sampling distribution at each tree
node with that node's own history (``v1/options.py``), returns logprobs, and constrains each
node by its own grammar state (``v1/grammar.py``). The V2 runner serves the same: temperature,
top-k, top-p, min_p, logit_bias, allowed_token_ids and min_tokens through vLLM's V2 sampler per
row at the node's depth position, penalties and bad words with each node's own history
(``v2/penalties.py``, ``v2/bad_words.py``), logprobs at the accepted path's rows
(``TreeSampler.path_rows``) and structured output through the scheduler's per-node grammar
(``v2/grammar.py``; with a reasoning parser, gated per path as vLLM gates a chain); the GPU
equality cases ``pairopts``, ``pairpen`` and ``pairjson`` check them against no-spec. What
cannot be served is refused, never silently ignored: in the front end
(``InputProcessor._validate_params``: ``LLM.generate`` raises ValueError, the OpenAI server
answers 400 and keeps serving) and, on the V1 runner, again in the runner.
"""

from __future__ import annotations

# option -> why it is refused (the message a client sees)
REFUSED = {
    "logprob_token_ids": "logprob_token_ids (generative scoring) is not supported with ddtree",
    "thinking_token_budget": "thinking_token_budget is not supported with ddtree yet",
}


def _is_set(params, name: str) -> bool:
    value = getattr(params, name, None)
    if name == "thinking_token_budget":  # a budget of 0 is still a request
        return value is not None
    return bool(value)


def unsupported_request(params) -> str | None:
    """Why a request's ``SamplingParams`` cannot be served by the tree sampler (None: it can)."""
    for name, reason in REFUSED.items():
        if _is_set(params, name):
            return reason
    return None


def refuse_unsupported_batch(sampling_metadata) -> None:
    """The V1 runner's guard over its batched sampling metadata (the front end refused these
    already; reaching here means a path around it)."""
    if sampling_metadata.logprob_token_ids:
        raise NotImplementedError(REFUSED["logprob_token_ids"])
    holder = sampling_metadata.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        raise NotImplementedError(REFUSED["thinking_token_budget"])
