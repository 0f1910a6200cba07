"""`ddtree serve`: vLLM's OpenAI server with DDTree answers like the no-spec server."""

import json
import urllib.request

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")


pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def _client(server):
    """An OpenAI client of a ``ddtree.bench.soak.Server`` and its served model name."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    return client, client.models.list().data[0].id


def _chats(server):
    """A streamed chat completion with a stop string, and a plain one; text, reason, usage."""
    client, model = _client(server)
    out = []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "def quicksort(items):"}],
        max_tokens=60,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        stop=["return"],
    )
    text, reason, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    out.append((text, reason, usage))
    done = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "class Stack:"}],
        max_tokens=40,
        temperature=0,
    )
    c = done.choices[0]
    out.append(
        (
            c.message.content,
            c.finish_reason,
            (done.usage.prompt_tokens, done.usage.completion_tokens),
        )
    )
    return out


def test_server_ddtree_answers_like_no_spec(servers):
    tree, plain = servers
    want = _chats(plain)
    got = _chats(tree)
    metrics = urllib.request.urlopen(tree.url + "/metrics").read().decode()
    assert got == want
    assert want[1][2][1] > 0  # tokens were generated
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    ):
        assert name in metrics, name
    accepted = [
        line
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
    ]
    assert float(accepted[0].split()[-1]) > 0  # the tree got tokens accepted


TOOL = {
    "type": "function",
    "function": {
        "name": "count",
        "description": "Count the lines of a file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"enum": ["a.py", "b.py"]}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["def", "class"]}, "n": {"type": "integer", "maximum": 9}},
    "required": ["kind", "n"],
    "additionalProperties": False,
}


def _structured(server) -> list[tuple[str, str]]:
    """JSON-schema and JSON-mode answers (both run on structured output)."""
    client, model = _client(server)
    out = []
    for response_format in (
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        {"type": "json_object"},
    ):
        c = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "import os"}],
            max_tokens=40,
            temperature=0,
            response_format=response_format,
        ).choices[0]
        out.append((c.message.content, c.finish_reason))
    return out


def _tool_calls(server) -> list[tuple[str, str]]:
    client, model = _client(server)
    c = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "import os"}],
        max_tokens=60,
        temperature=0,
        tools=[TOOL],
        tool_choice="required",
    ).choices[0]
    return [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]


def test_server_tool_call_like_no_spec(servers):
    """tool_choice "required" (structured output over the tools' schemas): DDTree's call
    equals no-spec's and its arguments parse."""
    tree, plain = servers
    want, got = _tool_calls(plain), _tool_calls(tree)
    assert got == want and got
    name, arguments = got[0]
    assert name == "count" and json.loads(arguments)["path"] in ("a.py", "b.py")


def test_server_structured_output_like_no_spec(servers):
    """JSON schema and JSON mode through the OpenAI API: DDTree's answers equal no-spec's
    (each tree node constrained by its own grammar state). The tiny target pads its JSON with
    the whitespace the grammar allows until max_tokens; complete, parsed JSON is checked in
    tests/test_vllm_options.py."""
    tree, plain = servers
    want, got = _structured(plain), _structured(tree)
    assert got == want
    for content, _ in got:
        assert content.lstrip().startswith("{"), content


def _logprob_chat(server, **options):
    client, model = _client(server)
    c = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "import numpy as np"}],
        max_tokens=24,
        temperature=0,
        **options,
    ).choices[0]
    shape = [
        (t.token, [alt.token for alt in t.top_logprobs], t.logprob) for t in c.logprobs.content
    ]
    return c.message.content, shape


def test_server_options_and_logprobs_like_no_spec(servers):
    """Penalties, logit bias and logprobs through the OpenAI API: DDTree's answer, tokens and
    top-2 alternatives equal no-spec's, logprob values within float32 noise."""
    tree, plain = servers
    options = dict(
        logprobs=True, top_logprobs=2, presence_penalty=0.8, frequency_penalty=0.3,
        logit_bias={"198": -5},
    )  # fmt: skip
    want_text, want = _logprob_chat(plain, **options)
    got_text, got = _logprob_chat(tree, **options)
    assert got_text == want_text and len(got) == len(want) == 24
    for (token_a, top_a, value_a), (token_b, top_b, value_b) in zip(want, got, strict=True):
        assert (token_b, top_b) == (token_a, top_a)
        assert abs(value_b - value_a) <= 2e-3
