"""DDTree in vLLM at the edges: generation that runs into max_model_len (the tree must be cut
where the context ends) under a KV cache so small that requests are preempted and recomputed.
Greedy outputs must still equal no-spec's, finish reasons included."""

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

MODELS = Path(__file__).resolve().parent.parent / "models"
PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Foo:\n    def __init__(self", "x = [", "#"]
MAX_MODEL_LEN = 384
BLOCK = 32


def _run(spec):
    llm = vllm.LLM(
        model=str(MODELS / "target"), dtype="float32", enforce_eager=True,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=2048,
        block_size=BLOCK, num_gpu_blocks_override=16,  # 512 slots for 4 x 384: preemption
        speculative_config=spec, seed=0, gpu_memory_utilization=0.2, disable_log_stats=False,
    )  # fmt: skip
    try:
        params = vllm.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        outs = llm.generate(PROMPTS, params)
        preempted = sum(
            m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"
        )  # fmt: skip
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs], preempted
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_context_end_and_preemption_equal_no_spec():
    want, _ = _run(None)
    spec = {"method": "ddtree", "model": str(MODELS / "drafter"), "ddtree_budget": 64}
    got, preempted = _run(spec)
    assert preempted > 0, "the KV cache was meant to be too small for all four requests"
    for (tokens, reason), prompt in zip(want, PROMPTS, strict=True):
        assert reason == "length"
        assert len(tokens) > MAX_MODEL_LEN - 64, prompt  # ran to the end of the context
    assert got == want
