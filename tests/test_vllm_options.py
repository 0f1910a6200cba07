"""Request options through DDTree (CPU build, V1 runner): each tree node is processed with its
own history, so greedy output equals no-spec's token for token (float32), logprobs come back
as no-spec returns them, and T=1 samples follow no-spec's distribution.

One no-spec and one DDTree engine serve every case (module fixtures).
"""

import json
import re

import pytest

vllm = pytest.importorskip("vllm")

from engines import (  # noqa: E402
    PROMPTS,
    assert_same_distribution,
    ddtree_spec,
    engine,
    token_counts,
)
from vllm.reasoning import ReasoningParserManager  # noqa: E402
from vllm.reasoning.basic_parsers import BaseThinkingReasoningParser  # noqa: E402
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402

pytestmark = pytest.mark.slow
VOCAB = 8192
NEWLINE = 202
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["def", "class"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["kind", "n"],
    "additionalProperties": False,
}


# (prompt, options): one option per request (a few together), each strong enough to change
# the answer; penalties and bad words read the tokens on each node's path.
CASES = [
    (0, dict(presence_penalty=1.5)),
    (1, dict(frequency_penalty=1.0, repetition_penalty=1.4)),
    (2, dict(repetition_penalty=0.7)),  # < 1 favours repeats
    (3, dict(min_tokens=24, stop_token_ids=[NEWLINE])),
    (0, dict(logit_bias={297: 4.0, NEWLINE: -100.0})),
    (1, dict(allowed_token_ids=list(range(100, 4000)))),
    (1, dict(bad_words=["self._file"])),  # several tokens, in the plain answer
    (2, dict(logprobs=3, presence_penalty=0.5)),
    (3, dict(logprobs=0)),
    # Structured output: each tree node constrained by its own root path's grammar state.
    (
        0,
        dict(
            structured_outputs=StructuredOutputsParams(
                json=JSON_SCHEMA, disable_any_whitespace=True
            )
        ),
    ),
    (1, dict(structured_outputs=StructuredOutputsParams(regex=r"[a-z_]+\(\w*\)"))),
    (2, dict(structured_outputs=StructuredOutputsParams(choice=["import os", "def f(x):"]))),
]


STRUCTURED_JSON = CASES[-3]


@ReasoningParserManager.register_module("ddtree_test_paren")
class ParenReasoning(BaseThinkingReasoningParser):
    """A reasoning parser for the bundled pair: "<|im_start|>" opens reasoning, the first "("
    token closes it (frequent in code, so trees accept tokens past it in one step). A prompt
    without the opening token is not reasoning, so the other cases are not gated."""

    start_token = "<|im_start|>"
    end_token = "("

    def is_reasoning_end(self, input_ids) -> bool:
        for token in reversed(list(input_ids)):
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
        return True


# Structured output behind a reasoning parser: free text up to the first "(", then the grammar.
CODE = r"[ a-z_().,:=0-9]{1,40}"
REASONING_PROMPTS = ["x = [", "for i in range", "if x is None", "import os, sys"]
PAREN = 11  # the "(" token


def _generate(llm, cases, max_tokens: int = 32):
    params = [
        vllm.SamplingParams(temperature=0, max_tokens=max_tokens, **options) for _, options in cases
    ]
    out = []
    for o in llm.generate([PROMPTS[i] for i, _ in cases], params):
        c = o.outputs[0]
        logprobs = None
        if c.logprobs is not None:
            logprobs = [
                {t: (round(lp.logprob, 3), lp.rank) for t, lp in position.items()}
                for position in c.logprobs
            ]
        out.append((list(c.token_ids), c.finish_reason, logprobs, c.text))
    return out


def _counts(llm, **sampling) -> list[int]:
    return token_counts(llm, PROMPTS[0], 2, 240, VOCAB, temperature=1.0, **sampling)


def _prompt_logprobs(llm) -> list[list[dict[int, float]]]:
    params = vllm.SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2)
    return [
        [{t: lp.logprob for t, lp in position.items()} for position in o.prompt_logprobs[1:]]
        for o in llm.generate(PROMPTS, params)
    ]


DISTRIBUTIONS = {
    "min_p": dict(min_p=0.05),
    "presence_penalty": dict(presence_penalty=1.0, top_p=0.95),
    "top_k_top_p": dict(top_k=20, top_p=0.9),
}


@pytest.fixture(scope="module")
def runs():
    """(no-spec, DDTree B=15): greedy outputs with options, unoptioned outputs, T=1 counts.
    Without the forced argmax chain, so that the 15 slots hold siblings (with it, slots 1..15
    would be the chain and per-node histories and grammar states the chain's)."""
    results = []
    for spec in (None, ddtree_spec(15, ddtree_chain_seed=False)):
        # 16 at once: the 12 cases in one batch in both engines, the samples 16 at a time
        with engine(
            spec=spec,
            disable_log_stats=False,
            max_num_seqs=16,
            reasoning_parser="ddtree_test_paren",
        ) as llm:
            plain = _generate(llm, [(i, {}) for i, _ in CASES])
            optioned = _generate(llm, CASES)
            counts = {name: _counts(llm, **kw) for name, kw in DISTRIBUTIONS.items()}
            counts["prompt_logprobs"] = _prompt_logprobs(llm)
            counts["reasoning"] = _reasoning(llm)
            metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        results.append((plain, optioned, counts, metrics))
    return results


def _reasoning(llm) -> list[tuple[list[int], str, str]]:
    """Per request: tokens, and the text up to and after the first "(" token (the text after
    it empty when there is none)."""
    params = vllm.SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(regex=CODE)
    )
    tokenizer = llm.get_tokenizer()
    out = []
    for o in llm.generate(["<|im_start|>" + p for p in REASONING_PROMPTS], params):
        tokens = list(o.outputs[0].token_ids)
        end = tokens.index(PAREN) + 1 if PAREN in tokens else len(tokens)
        text = [tokenizer.decode(t, skip_special_tokens=True) for t in (tokens[:end], tokens[end:])]
        out.append((tokens, *text))
    return out


def test_options_change_the_answer(runs):
    """The control: every option bites in no-spec (so equality below says something)."""
    (plain, optioned, _, _), _ = runs
    for (_, case), a, b in zip(CASES, plain, optioned, strict=True):
        if list(case) != ["logprobs"]:
            assert a[0] != b[0], case


def test_greedy_with_options_equals_no_spec(runs):
    (_, want, _, _), (_, got, _, metrics) = runs
    for (_, case), a, b in zip(CASES, want, got, strict=True):
        assert b[:2] == a[:2], case
    tokens, reason, _, text = got[CASES.index(STRUCTURED_JSON)]
    answer = json.loads(text)  # complete and valid
    assert reason == "stop" and answer["kind"] in ("def", "class") and 0 <= answer["n"] <= 9
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    assert accepted > 0  # trees were verified and accepted, not only root steps


def test_logprobs_like_no_spec(runs):
    """Same tokens, ranks and top-k sets at every position; values within float32 noise (the
    tree's attention sums in another order than a decode step's)."""
    (_, want, _, _), (_, got, _, _) = runs
    for (_, case), a, b in zip(CASES, want, got, strict=True):
        if "logprobs" not in case:
            assert a[2] is None and b[2] is None
            continue
        assert len(a[2]) == len(b[2]) == len(a[0])
        for position_a, position_b in zip(a[2], b[2], strict=True):
            assert position_a.keys() == position_b.keys()
            assert len(position_a) == 1 + case["logprobs"] or len(position_a) == case["logprobs"]
            for token, (value, rank) in position_a.items():
                assert position_b[token][1] == rank
                assert abs(position_b[token][0] - value) <= 2e-3


def test_prompt_logprobs_like_no_spec(runs):
    """prompt_logprobs come from the prefill (no tree in it): same tokens, same values."""
    (_, _, want, _), (_, _, got, _) = runs
    assert sum(len(a) for a in got["prompt_logprobs"]) > 10
    for a, b in zip(want["prompt_logprobs"], got["prompt_logprobs"], strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) <= 1e-4 for t in x)


def test_structured_output_after_reasoning_equals_no_spec(runs):
    """With a reasoning parser, the grammar applies from the end-of-reasoning token on, also
    where a tree step accepts that token and tokens after it at once (vLLM's scheduler looks
    for the end of reasoning in a step's last token only; DDTree in every token it appends)."""
    (_, _, want, _), (_, _, got, _) = runs
    assert [t for t, _, _ in got["reasoning"]] == [t for t, _, _ in want["reasoning"]]
    ended = [(reasoning, content) for t, reasoning, content in got["reasoning"] if PAREN in t]
    assert len(ended) >= 2
    for _, content in ended:  # the grammar's alphabet and length from the "(" on
        assert re.fullmatch(CODE.replace("{1,40}", "{0,40}"), content), content
    # the control: the free text before it leaves that alphabet
    assert any(not re.fullmatch(CODE.replace("{1,40}", "*"), r) for r, _ in ended)


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_sampling_with_options_follows_no_spec(runs, name):
    """Generated token 2 over 240 seeded requests, chi-square homogeneity with no-spec."""
    (_, _, want, _), (_, _, got, _) = runs
    assert_same_distribution(got[name], want[name])


def test_first_token_options_and_refusals():
    """A DDTree engine samples a prefill's first token with vLLM's own sampler: logit_bias and
    min_p must reach it too (vLLM builds neither processor under speculative decoding).
    What DDTree does not serve is refused by name, and the engine serves on after it."""
    with engine(spec=ddtree_spec(15)) as llm:
        params = vllm.SamplingParams(
            temperature=1.0, min_p=0.5, logit_bias={297: 100.0}, max_tokens=1, seed=0
        )
        outs = llm.generate(PROMPTS, params)
        refused = vllm.SamplingParams(max_tokens=4, logprob_token_ids=[1, 2])
        with pytest.raises(ValueError, match="logprob_token_ids"):
            llm.generate(PROMPTS[:1], refused)
        again = llm.generate(PROMPTS, params)
    assert [list(o.outputs[0].token_ids) for o in outs + again] == [[297]] * 2 * len(PROMPTS)
