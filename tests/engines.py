"""vLLM engines for tests: in this process (seconds to start, not tens of seconds), shut down
and freed on exit; and the chi-square homogeneity check of two samples."""

from __future__ import annotations

import contextlib
import gc
import math
import os
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"
PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Foo:\n    def __init__(self", "x = [", "#"]


def ddtree_spec(budget: int, drafter: Path = MODELS / "drafter", **options) -> dict:
    return {"method": "ddtree", "model": str(drafter), "ddtree_budget": budget, **options}


@contextlib.contextmanager
def engine(model: Path = MODELS / "target", spec: dict | None = None, **kwargs):
    """A ``vllm.LLM`` whose engine core runs in this process (CPU defaults: float32, eager).

    vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` when it makes the engine core client; it is
    set for that moment only, so servers started by other tests keep vLLM's default."""
    import vllm

    settings = dict(
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        seed=0,
        # An explicit KV cache size: without it the CPU backend sizes the cache as 20% of RAM
        # minus this process's RSS, which shrinks with every in-process engine a test run
        # has loaded (a late test once got 9 MB, too little for one 1024-token request).
        kv_cache_memory_bytes=256 * 2**20,
    )
    settings.update(kwargs)
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = vllm.LLM(model=str(model), speculative_config=spec, **settings)
    finally:
        if previous is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def counter(llm, name: str) -> float:
    """The engine's counter ``name`` (e.g. ``vllm:num_preemptions``), summed over its labels."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def greedy(llm, prompts=PROMPTS) -> list[tuple[list[int], str]]:
    """Mixed greedy requests (prompt lengths, max_tokens and a stop token differ)."""
    import vllm

    params = [
        vllm.SamplingParams(temperature=0, max_tokens=64),
        vllm.SamplingParams(temperature=0, max_tokens=40),
        vllm.SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[6]),
        vllm.SamplingParams(temperature=0, max_tokens=5),
    ]
    outs = llm.generate(prompts, params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def token_counts(llm, prompt, index: int, n: int, vocab: int, **sampling) -> list[int]:
    """How often each token is generated at position ``index`` over ``n`` seeded requests."""
    import vllm

    params = [
        vllm.SamplingParams(
            max_tokens=index + 1, ignore_eos=True, seed=seed, detokenize=False, **sampling
        )
        for seed in range(n)
    ]
    counts = [0] * vocab
    for out in llm.generate([prompt] * n, params):
        counts[out.outputs[0].token_ids[index]] += 1
    return counts


def assert_same_distribution(first: list[int], second: list[int], min_cell: int = 10) -> None:
    """Chi-square homogeneity of two equal-size samples over the same cells (p = 0.0005);
    cells with fewer than ``min_cell`` observations in both together are pooled."""
    assert sum(first) == sum(second)
    cells = [(a, b) for a, b in zip(first, second, strict=True) if a + b >= min_cell]
    rare = (sum(first) - sum(a for a, _ in cells), sum(second) - sum(b for _, b in cells))
    if sum(rare) > 0:
        cells.append(rare)
    chi2 = sum((a - b) ** 2 / (a + b) for a, b in cells)
    dof = len(cells) - 1
    w = 2.0 / (9.0 * dof)
    critical = dof * (1 - w + 3.29 * math.sqrt(w)) ** 3  # Wilson-Hilferty, z = 3.29
    assert dof >= 3, cells
    assert chi2 < critical, (chi2, critical, cells)
