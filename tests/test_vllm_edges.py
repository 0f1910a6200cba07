"""DDTree in vLLM at the edges: generation that runs into max_model_len (the tree must be cut
where the context ends) under a KV cache so small that requests are preempted and recomputed.
Greedy outputs must still equal no-spec's, finish reasons included."""

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from engines import MODELS, PROMPTS, counter, ddtree_spec, engine  # noqa: E402

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter

MAX_MODEL_LEN = 384
BLOCK = 32


def _run(spec):
    with engine(
        spec=spec,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        num_gpu_blocks_override=16,  # 512 slots for 4 x 384: preemption
        disable_log_stats=False,
    ) as llm:
        params = vllm.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        outs = llm.generate(PROMPTS, params)
        preempted = counter(llm, "vllm:num_preemptions")
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs], preempted


def test_context_end_and_preemption_equal_no_spec():
    want, _ = _run(None)
    got, preempted = _run(ddtree_spec(64))
    assert preempted > 0, "the KV cache was meant to be too small for all four requests"
    for (tokens, reason), prompt in zip(want, PROMPTS, strict=True):
        assert reason == "length"
        assert len(tokens) > MAX_MODEL_LEN - 64, prompt  # ran to the end of the context
    assert got == want


def _eos_model(tmp_path: Path, eos: int) -> Path:
    """The bundled target with token ``eos`` as its end-of-sequence token (weights linked)."""
    import json

    from transformers import AutoTokenizer

    model = tmp_path / "target_eos"
    model.mkdir()
    for f in (MODELS / "target").iterdir():
        (model / f.name).symlink_to(f)
    token = AutoTokenizer.from_pretrained(MODELS / "target").convert_ids_to_tokens(eos)
    for name, key, value in (
        ("config.json", "eos_token_id", eos),
        ("generation_config.json", "eos_token_id", eos),
        ("tokenizer_config.json", "eos_token", token),
    ):
        data = json.loads((MODELS / "target" / name).read_text())
        data[key] = value
        (model / name).unlink()
        (model / name).write_text(json.dumps(data))
    return model


def test_eos_inside_accepted_paths_equals_no_spec(tmp_path):
    """A token the target emits mid-answer becomes its EOS: every request must end at its first
    occurrence with finish_reason "stop", as no-spec does, although with DDTree that token is
    usually inside an accepted path (tau ~ 4 here), not the step's last token."""
    import collections

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS / "target")
    target = AutoModelForCausalLM.from_pretrained(MODELS / "target", dtype=torch.float32)
    firsts = collections.Counter()
    for prompt in PROMPTS:  # the transformers greedy answers pick the token
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        answer = target.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :]
        seen = set(answer[:6].tolist())  # first occurrences after the first few tokens
        firsts.update({t for t in answer[6:].tolist() if t not in seen})
    eos = firsts.most_common(1)[0][0]
    model = _eos_model(tmp_path, eos)

    def run(spec):
        with engine(model, spec=spec, max_model_len=512) as llm:
            outs = llm.generate(PROMPTS, vllm.SamplingParams(temperature=0, max_tokens=64))
            return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]

    want = run(None)
    stopped = [tokens for tokens, reason in want if reason == "stop"]
    assert len(stopped) >= 2 and all(t[-1] == eos and eos not in t[:-1] for t in stopped)
    assert run(ddtree_spec(64)) == want
