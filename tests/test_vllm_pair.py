"""The bundled pair in vLLM 0.26 (CPU build): target + DFlash drafter + tokenizer load, and
greedy DFlash output equals no-spec output."""

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

MODELS = Path(__file__).resolve().parent.parent / "models"
PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Foo:\n    def __init__(self", "x = ["]


def _generate(spec):
    llm = vllm.LLM(
        model=str(MODELS / "target"),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        speculative_config=spec,
        seed=0,
        gpu_memory_utilization=0.2,  # on the CPU: the share of memory for the KV cache
    )
    params = [vllm.SamplingParams(temperature=0, max_tokens=n) for n in (64, 40, 17)]
    outs = llm.generate(PROMPTS, params)
    llm.llm_engine.engine_core.shutdown()  # free the engine process and its KV cache
    return [list(o.outputs[0].token_ids) for o in outs]


def test_bundled_pair_dflash_greedy_equals_no_spec():
    assert vllm.__version__ == "0.26.0"
    plain = _generate(None)
    spec = {"method": "dflash", "model": str(MODELS / "drafter"), "num_speculative_tokens": 15}
    assert _generate(spec) == plain
    assert [len(t) for t in plain] == [64, 40, 17]
