"""Per-request options the tree sampler does not apply yet: one table, one wording.

The tree sampler applies temperature, top-k and top-p at every tree node. Anything else that
changes the target's distribution or asks for more output is refused, never silently ignored:
in the front end (``InputProcessor._validate_params``: ``LLM.generate`` raises ValueError, the
OpenAI server answers 400 and keeps serving) and, as a guard, again in the runner.
"""

from __future__ import annotations

# option -> why it is refused (the message a client sees)
REFUSED = {
    "logprobs": "logprobs are not returned with ddtree yet: drop 'logprobs'",
    "presence_penalty": "presence_penalty is not supported with ddtree yet",
    "frequency_penalty": "frequency_penalty is not supported with ddtree yet",
    "repetition_penalty": "repetition_penalty is not supported with ddtree yet",
    "min_p": "min_p is not supported with ddtree yet",
    "min_tokens": "min_tokens is not supported with ddtree yet",
    "logit_bias": "logit_bias is not supported with ddtree yet",
    "allowed_token_ids": "allowed_token_ids is not supported with ddtree yet",
    "bad_words": "bad_words is not supported with ddtree yet",
    "structured_outputs": "structured output (guided decoding) is not supported with ddtree yet",
}
# Values that leave the distribution as it is (absent from the table: None / empty / 0).
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def unsupported_request(params) -> str | None:
    """Why a request's ``SamplingParams`` cannot be served by the tree sampler (None: they
    can)."""
    for name, reason in REFUSED.items():
        value = getattr(params, name, None)
        if name in _NEUTRAL:
            if value is not None and value != _NEUTRAL[name]:
                return f"{reason} (got {name}={value})"
        elif name in ("logprobs", "structured_outputs"):  # 0 logprobs is still a request
            if value is not None:
                return reason
        elif value:
            return reason
    return None


def refuse_unsupported_batch(sampling_metadata) -> None:
    """The runner's guard over V1's batched sampling metadata (the front end refused these
    already; reaching here means a path around it)."""
    if sampling_metadata.max_num_logprobs is not None:
        raise NotImplementedError(REFUSED["logprobs"])
    if not sampling_metadata.no_penalties:
        raise NotImplementedError(REFUSED["presence_penalty"] + " (nor other penalties)")
    if sampling_metadata.bad_words_token_ids:
        raise NotImplementedError(REFUSED["bad_words"])
