"""Per-request options DDTree cannot serve on a runner: one table, one wording.

The V1 runner's tree sampler applies every option of the sampling distribution at each tree
node with that node's own history (``v1/options.py``), returns logprobs, and constrains each
node by its own grammar state (``v1/grammar.py``). The V2 runner serves temperature, top-k,
top-p, min_p, logit_bias, allowed_token_ids and min_tokens (vLLM's V2 sampler per row at the
node's depth position) and logprobs (read at the accepted path's rows,
``TreeSampler.path_rows``); the H200 equality case ``pairopts`` checks them against no-spec.
``REFUSED_V2`` lists the rest. What a runner cannot serve is refused, never silently ignored:
in the front end (``InputProcessor._validate_params``: ``LLM.generate`` raises ValueError, the
OpenAI server answers 400 and keeps serving) and, on the V1 runner, again in the runner.
"""

from __future__ import annotations

_V1_HINT = " (the V1 model runner serves it: VLLM_USE_V2_MODEL_RUNNER=0)"

# option -> why it is refused on every runner (the message a client sees)
REFUSED = {
    "logprob_token_ids": "logprob_token_ids (generative scoring) is not supported with ddtree",
    "thinking_token_budget": "thinking_token_budget is not supported with ddtree yet",
}
# option -> why the V2 runner refuses it (the V1 runner serves these)
_V2 = "with ddtree on the V2 model runner yet"
REFUSED_V2 = {
    # Need each node's own history (its root path); vLLM's V2 sampler counts the drafts
    # before a row in chain order. v2/penalties.py and v2/bad_words.py apply them per node
    # (CPU-tested); they leave this table once the GPU equality case pairpen holds.
    "presence_penalty": f"presence_penalty is not supported {_V2}",
    "frequency_penalty": f"frequency_penalty is not supported {_V2}",
    "repetition_penalty": f"repetition_penalty is not supported {_V2}",
    "bad_words": f"bad_words is not supported {_V2}",
    # Built (the scheduler's per-node grammar, shared with V1; the drafts' parents from the V2
    # runner, v2/grammar.py); leaves this table once the GPU equality case pairjson holds.
    "structured_outputs": (
        f"structured output (guided decoding, JSON schema, tool calls with a schema) is not "
        f"supported {_V2}: each tree node needs its own grammar state"
    ),
}
# Values that leave the distribution as it is (absent from the table: None / empty / 0).
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_SET_EVEN_IF_ZERO = ("logprobs", "structured_outputs", "thinking_token_budget")


def _is_set(params, name: str) -> bool:
    value = getattr(params, name, None)
    if name in _NEUTRAL:
        return value is not None and value != _NEUTRAL[name]
    if name in _SET_EVEN_IF_ZERO:  # 0 logprobs is still a request
        return value is not None
    return bool(value)


def unsupported_request(params, v2_runner: bool) -> str | None:
    """Why a request's ``SamplingParams`` cannot be served by the tree sampler of the given
    runner (None: they can)."""
    tables = [(REFUSED, "")]
    if v2_runner:
        tables.append((REFUSED_V2, _V1_HINT))
    for table, hint in tables:
        for name, reason in table.items():
            if _is_set(params, name):
                value = getattr(params, name)
                shown = f" (got {name}={value})" if name in _NEUTRAL else ""
                return reason + shown + hint
    return None


def structured_output_refusal(vllm_config) -> str | None:
    """Why the V1 runner cannot serve structured output in this engine (None: it can): its
    per-node grammar bitmask (``v1/grammar.py``) does not follow a reasoning parser's grammar
    gate yet."""
    reasoning = getattr(vllm_config.structured_outputs_config, "reasoning_parser", "")
    if reasoning:
        return (
            "structured output with ddtree is not supported with a reasoning parser yet "
            f"(reasoning_parser={reasoning})"
        )
    return None


def refuse_unsupported_batch(sampling_metadata) -> None:
    """The V1 runner's guard over its batched sampling metadata (the front end refused these
    already; reaching here means a path around it)."""
    if sampling_metadata.logprob_token_ids:
        raise NotImplementedError(REFUSED["logprob_token_ids"])
    holder = sampling_metadata.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        raise NotImplementedError(REFUSED["thinking_token_budget"])
