"""`ddtree serve`: vLLM's OpenAI server with DDTree answers like the no-spec server."""

import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from ddtree.bench.soak import _free_port, stop_process_tree  # noqa: E402


class Server:
    def __init__(self, budget: int):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--budget", str(budget),
               "--port", str(self.port), "--max-num-seqs", "4", "--", "--seed", "0",
               "--enforce-eager"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read().decode()[-3000:])
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        else:
            self.stop()
            raise TimeoutError("server did not start in 300 s")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none")
        self.model = self.client.models.list().data[0].id

    def stop(self):
        stop_process_tree(self.proc)  # by PID, engine processes included


def _chats(server):
    """A streamed chat completion with a stop string, and a plain one; text, reason, usage."""
    out = []
    stream = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "def quicksort(items):"}],
        max_tokens=60, temperature=0, stream=True, stream_options={"include_usage": True},
        stop=["return"],
    )  # fmt: skip
    text, reason, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    out.append((text, reason, usage))
    done = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "class Stack:"}],
        max_tokens=40, temperature=0,
    )  # fmt: skip
    c = done.choices[0]
    out.append((c.message.content, c.finish_reason,
                (done.usage.prompt_tokens, done.usage.completion_tokens)))  # fmt: skip
    return out


def test_server_ddtree_answers_like_no_spec():
    plain = Server(budget=0)
    try:
        want = _chats(plain)
    finally:
        plain.stop()
    tree = Server(budget=64)
    try:
        got = _chats(tree)
        metrics = urllib.request.urlopen(tree.url + "/metrics").read().decode()
        refused = _unsupported_requests(tree)
        again = _chats(tree)  # the server lives on after the refusals
    finally:
        tree.stop()
    assert got == want and again == want
    for kwargs, message in refused:
        assert message is not None, f"{kwargs} was not refused"
        assert "ddtree" in message or "speculative decoding" in message, message  # vLLM's own
    assert want[1][2][1] > 0  # tokens were generated
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total"):  # fmt: skip
        assert name in metrics, name
    accepted = [line for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]  # fmt: skip
    assert float(accepted[0].split()[-1]) > 0  # the tree got tokens accepted


UNSUPPORTED = [
    {"logprobs": True, "top_logprobs": 2},
    {"presence_penalty": 0.5},
    {"frequency_penalty": 0.5},
    {"logit_bias": {"5": 10}},
    {"extra_body": {"repetition_penalty": 1.2}},
    {"extra_body": {"min_tokens": 3}},
    {"extra_body": {"min_p": 0.1}},
    {"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}},
]


def _unsupported_requests(server):
    """Each unsupported per-request option: (kwargs, the 400's message or None if served)."""
    out = []
    for kwargs in UNSUPPORTED:
        try:
            server.client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "x = "}],
                max_tokens=4, temperature=1.0, **kwargs,  # T=0 would reset min_p
            )  # fmt: skip
            out.append((kwargs, None))
        except openai.BadRequestError as err:
            out.append((kwargs, str(err)))
    return out
