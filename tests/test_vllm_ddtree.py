"""DDTree inside vLLM 0.26 (CPU build, V1 runner): lossless greedy, sampling runs, config errors.

Each engine start takes ~30 s on two cores, so the cases share engines where they can.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

MODELS = Path(__file__).resolve().parent.parent / "models"
PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Foo:\n    def __init__(self", "x = [", "#"]


def _engine(spec, **kw):
    return vllm.LLM(
        model=str(MODELS / "target"),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        speculative_config=spec,
        seed=0,
        gpu_memory_utilization=0.2,  # on the CPU: the share of memory for the KV cache
        **kw,
    )


def _greedy(llm):
    # Mixed requests: prompt lengths, max_tokens and a stop token differ.
    params = [
        vllm.SamplingParams(temperature=0, max_tokens=64),
        vllm.SamplingParams(temperature=0, max_tokens=40),
        vllm.SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[6]),
        vllm.SamplingParams(temperature=0, max_tokens=5),
    ]
    outs = llm.generate(PROMPTS, params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def _close(llm):
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def no_spec():
    llm = _engine(None)
    try:
        return _greedy(llm)
    finally:
        _close(llm)  # one engine at a time: each holds a share of the memory


def _sampled(llm):
    params = vllm.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=1,
                                 ignore_eos=True)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def ddtree_64():
    """DDTree B=64 at TP=1: (greedy outputs, seeded T=1 samples)."""
    llm = _engine({"method": "ddtree", "model": str(MODELS / "drafter"), "ddtree_budget": 64})
    try:
        return _greedy(llm), _sampled(llm)
    finally:
        _close(llm)


def test_vllm_dflash_chain_equals_no_spec(no_spec):
    """The control: the bundled pair under vLLM's own DFlash chain (loads target, drafter and
    tokenizer; greedy output equals no-spec, as it must for DDTree below)."""
    assert vllm.__version__ == "0.26.0"
    assert [len(t) for t, _ in no_spec[:2]] == [64, 40]
    spec = {"method": "dflash", "model": str(MODELS / "drafter"), "num_speculative_tokens": 15}
    llm = _engine(spec)
    try:
        assert _greedy(llm) == no_spec
    finally:
        _close(llm)


@pytest.mark.parametrize("budget, cap", [(1, None), (15, None), (64, None), (255, None),
                                         (255, 100)])  # fmt: skip
def test_greedy_ddtree_equals_no_spec(no_spec, budget, cap, capfd, request):
    """``cap``: ddtree_max_verify_tokens; with 100 the step budget follows the batch: 4
    requests -> 24 nodes each, 2 -> 49, 1 -> 99 (trees of changing width between steps).
    That case also fits the start-up cost model (with a ratio that never binds)."""
    if budget == 64:  # the engine is shared with the tensor-parallel test
        greedy, sampled = request.getfixturevalue("ddtree_64")
        assert greedy == no_spec
        assert all(len(tokens) == 30 for tokens in sampled)  # T=1 runs, requested lengths
        return
    spec = {"method": "ddtree", "model": str(MODELS / "drafter"), "ddtree_budget": budget,
            "ddtree_max_verify_tokens": cap}  # fmt: skip
    if cap is not None:
        spec["ddtree_max_verify_cost"] = 100.0
    llm = _engine(spec)
    try:
        if cap is not None:
            log = "".join(capfd.readouterr())  # vLLM logs to stdout
            assert "ddtree step budgets (max verify cost 100.00x" in log, log[-3000:]
            assert "1 req -> B 255, 2 req -> B 255, 4 req -> B 255;" in log
        assert _greedy(llm) == no_spec
    finally:
        _close(llm)


def _spec_counts(llm) -> dict[str, float]:
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}  # fmt: skip


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 needs two CPU cores")
def test_tensor_parallel_ddtree_equals_no_spec(no_spec, ddtree_64, monkeypatch):
    """Issue 8 on the CPU build: DDTree at tensor_parallel_size=2 (two worker processes, the
    target's heads and MLP split between them, vocabulary-parallel head gathered) gives
    no-spec's TP=1 greedy tokens, and with seeded sampling TP=1's DDTree tokens. Every rank
    builds and walks its own tree from the gathered logits and its own seeded draws; a rank
    that built another tree or drew otherwise would verify other tokens and part."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    # vLLM's CPU workers bind one NUMA node each unless told which cores to take.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    spec = {"method": "ddtree", "model": str(MODELS / "drafter"), "ddtree_budget": 64}
    llm = _engine(spec, tensor_parallel_size=2, distributed_executor_backend="mp",
                  disable_log_stats=False)  # fmt: skip
    try:
        assert _greedy(llm) == no_spec
        assert _sampled(llm) == ddtree_64[1]
        counts = _spec_counts(llm)
        assert counts["num_drafts"] > 0 and counts["num_accepted_tokens"] > counts["num_drafts"]
    finally:
        _close(llm)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"ddtree_budget": 0}, r"ddtree_budget must be an int in \[1, 1024\]"),
        ({"ddtree_budget": 2000}, r"ddtree_budget must be an int in \[1, 1024\]"),
        ({"ddtree_budget": "64"}, r"ddtree_budget must be an int"),
        ({"ddtree_budget": 64, "ddtree_chain_seed": "yes"}, "ddtree_chain_seed must be"),
        ({"ddtree_budget": 64, "model": None}, "must name the DFlash drafter"),
        ({"ddtree_budget": 64, "ddtree_max_verify_tokens": 0}, "ddtree_max_verify_tokens must"),
        ({"ddtree_budget": 64, "ddtree_max_verify_tokens": 9.5}, "ddtree_max_verify_tokens must"),
        ({"ddtree_budget": 64, "ddtree_max_verify_cost": 0.9}, "ddtree_max_verify_cost must"),
        ({"ddtree_budget": 64, "ddtree_max_verify_cost": "1.1"}, "ddtree_max_verify_cost must"),
        ({"ddtree_budget": 64, "ddtree_max_verify_cost": float("nan")}, "ddtree_max_verify_cost"),
    ],
)
def test_bad_config_is_refused(spec, message):
    from ddtree.vllm_plugin.patches import parse_options

    full = {"method": "ddtree", "model": str(MODELS / "drafter"), **spec}
    with pytest.raises(ValueError, match=message):
        parse_options(full)


def test_default_verify_cap():
    from ddtree.vllm_plugin.patches import parse_options

    base = {"method": "ddtree", "model": str(MODELS / "drafter")}
    assert parse_options({**base, "ddtree_budget": 64})[1].max_verify_tokens == 512
    assert parse_options({**base, "ddtree_budget": 1023})[1].max_verify_tokens == 1024
    off = {**base, "ddtree_budget": 64, "ddtree_max_verify_tokens": None}
    assert parse_options(off)[1].max_verify_tokens is None
    # The cost model is off by default on the CPU; asked for, it replaces the default cap.
    assert parse_options({**base, "ddtree_budget": 64})[1].max_verify_cost is None
    costed = parse_options({**base, "ddtree_budget": 64, "ddtree_max_verify_cost": 1.2})[1]
    assert (costed.max_verify_cost, costed.max_verify_tokens) == (1.2, None)


def test_step_budget_follows_the_batch_but_keeps_the_chain():
    from ddtree.vllm_plugin.runtime import DDTreeOptions

    fixed = DDTreeOptions(budget=255)
    assert [fixed.step_budget(n, 15) for n in (1, 8, 64)] == [255, 255, 255]
    capped = DDTreeOptions(budget=255, max_verify_tokens=512)
    assert [capped.step_budget(n, 15) for n in (1, 2, 4, 16, 64)] == [255, 255, 127, 31, 15]
    assert DDTreeOptions(budget=8, max_verify_tokens=16).step_budget(32, 15) == 8
    costed = DDTreeOptions(budget=255, max_verify_tokens=512, bucket_budgets={1: 127, 2: 255})
    assert [costed.step_budget(n, 15) for n in (1, 2, 4)] == [127, 255, 127]


def test_budget_above_batched_tokens_is_refused():
    spec = {"method": "ddtree", "model": str(MODELS / "drafter"), "ddtree_budget": 512}
    with pytest.raises(ValueError, match="must be below max_num_batched_tokens"):
        vllm.LLM(model=str(MODELS / "target"), speculative_config=spec,
                 max_num_batched_tokens=256, gpu_memory_utilization=0.2)  # fmt: skip


def test_scheduler_keeps_room_for_whole_trees():
    """vLLM reserves drafter slots per sequence out of max_num_batched_tokens; with DDTree that
    is the drafter's D queries, not B (B=511 x 16 sequences once left 32 tokens per step)."""
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "ddtree", "model": str(MODELS / "drafter"), "ddtree_budget": 511}
    config = EngineArgs(
        model=str(MODELS / "target"), speculative_config=spec, max_num_seqs=16,
        max_num_batched_tokens=8192, max_model_len=2048,
    ).create_engine_config()  # fmt: skip
    assert config.speculative_config.max_num_new_slots_for_drafting == 14
    assert config.scheduler_config.max_num_scheduled_tokens == 8192 - 14 * 16


def test_triton_tree_attention_is_refused_on_the_cpu(monkeypatch):
    from ddtree.vllm_plugin import runtime

    monkeypatch.setattr(runtime, "TREE_ATTENTION", "triton")
    spec = {"method": "ddtree", "model": str(MODELS / "drafter"), "ddtree_budget": 16}
    with pytest.raises(NotImplementedError, match="DDTREE_TREE_ATTENTION=triton needs a CUDA"):
        vllm.LLM(model=str(MODELS / "target"), speculative_config=spec,
                 max_num_batched_tokens=2048, gpu_memory_utilization=0.2)  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 128}, "hidden_size 128 != target hidden_size 256"),
        ({"vocab_size": 9000}, "vocab_size 9000 != target vocab_size 8192"),
        ({"dflash_config": {"mask_token_id": 9000}}, "mask_token_id 9000 is not in the target"),
        (
            {"dflash_config": {"target_layer_ids": [1, 2, 7]}},
            r"target_layer_ids \[7\] out of range",
        ),
    ],
)
def test_mismatched_drafter_is_refused_at_start(tmp_path, change, message):
    import json
    import shutil

    draft = tmp_path / "drafter"
    shutil.copytree(MODELS / "drafter", draft)
    cfg = json.loads((draft / "config.json").read_text())
    for key, value in change.items():
        if key == "dflash_config":
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    (draft / "config.json").write_text(json.dumps(cfg))
    spec = {"method": "ddtree", "model": str(draft), "ddtree_budget": 16}
    with pytest.raises(ValueError, match=message):
        vllm.LLM(
            model=str(MODELS / "target"),
            speculative_config=spec,
            max_num_batched_tokens=2048,
            max_num_seqs=4,
            gpu_memory_utilization=0.2,
        )


@pytest.mark.parametrize(
    "env, overrides, message",
    [
        ("1", {}, "V1 model runner"),
        (None, {"async_scheduling": True}, "async_scheduling"),
        (None, {"cudagraph_mode": "FULL_AND_PIECEWISE"}, "cudagraph_mode"),
    ],
)
def test_cuda_settings_refuse_conflicting_choices(monkeypatch, env, overrides, message):
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from ddtree.vllm_plugin.patches import _configure_for_cuda

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # restored after the test
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    mode = overrides.get("cudagraph_mode")
    args = SimpleNamespace(
        async_scheduling=overrides.get("async_scheduling"),
        enforce_eager=False,
        compilation_config=SimpleNamespace(
            cudagraph_mode=None if mode is None else CUDAGraphMode[mode]
        ),
    )
    with pytest.raises(ValueError, match=message):
        _configure_for_cuda(args)


def test_cuda_settings_defaults(monkeypatch):
    import os
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from ddtree.vllm_plugin.patches import _configure_for_cuda

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # restored after the test
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    args = SimpleNamespace(async_scheduling=None, enforce_eager=False,
                           compilation_config=SimpleNamespace(cudagraph_mode=None))  # fmt: skip
    _configure_for_cuda(args)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert args.async_scheduling is False
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_plugin_leaves_torch_cuda_alone_off_the_cpu():
    """Importing vLLM's CPU worker swaps torch.cuda.Event / Stream for placeholders in the whole
    process (it broke every CUDA engine once): off the CPU platform the plugin must not."""
    code = (
        "import sys, torch\n"
        "from vllm.platforms import current_platform\n"
        "current_platform.is_cpu = lambda: False\n"
        "event = torch.cuda.Event\n"
        "from ddtree.vllm_plugin import patches\n"
        "patches._patch_workers_warm_up()\n"
        "assert 'vllm.v1.worker.cpu_worker' not in sys.modules\n"
        "assert torch.cuda.Event is event\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
