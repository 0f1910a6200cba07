"""DDTree's configuration in vLLM: options parsed and refused with clear errors, the
environment settings, CUDA settings per runner, start-up refusals that need no engine."""

import os

import pytest

vllm = pytest.importorskip("vllm")

from engines import MODELS  # noqa: E402


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
        (
            {"ddtree_budget": 64, "ddtree_budgte": 9},
            r"unknown ddtree option\(s\) \['ddtree_budgte'\]",
        ),
    ],
)
def test_bad_config_is_refused(spec, message):
    from ddtree.vllm_plugin.config import parse_options

    full = {"method": "ddtree", "model": str(MODELS / "drafter"), **spec}
    with pytest.raises(ValueError, match=message):
        parse_options(full)


def test_default_verify_cap():
    from ddtree.vllm_plugin.config import parse_options

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
    from ddtree.vllm_plugin.config import DDTreeOptions

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
        vllm.LLM(
            model=str(MODELS / "target"),
            speculative_config=spec,
            max_num_batched_tokens=256,
            gpu_memory_utilization=0.2,
        )


def test_scheduler_keeps_room_for_whole_trees():
    """vLLM reserves drafter slots per sequence out of max_num_batched_tokens; with DDTree that
    is the drafter's D queries, not B (B - 1 per sequence would leave B=511 x 16 sequences 32
    tokens per step)."""
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "ddtree", "model": str(MODELS / "drafter"), "ddtree_budget": 511}
    config = EngineArgs(
        model=str(MODELS / "target"),
        speculative_config=spec,
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        max_model_len=2048,
    ).create_engine_config()
    assert config.speculative_config.max_num_new_slots_for_drafting == 14
    assert config.scheduler_config.max_num_scheduled_tokens == 8192 - 14 * 16


def test_triton_tree_attention_is_refused_on_the_cpu():
    from ddtree.vllm_plugin.config import Settings, check_platform

    with pytest.raises(NotImplementedError, match="DDTREE_TREE_ATTENTION=triton needs a CUDA"):
        check_platform(Settings(tree_attention="triton"))
    with pytest.raises(NotImplementedError, match="DDTREE_TREE_ATTENTION=flash needs a CUDA"):
        check_platform(Settings(tree_attention="flash"))
    with pytest.raises(NotImplementedError, match="DDTREE_TREE_KERNELS=fused runs on CUDA"):
        check_platform(Settings(tree_kernels="fused"))
    with pytest.raises(NotImplementedError, match="DDTREE_CONTEXT_SPLITS splits the CUDA"):
        check_platform(Settings(context_splits=4))
    check_platform(Settings(tree_attention="auto"))
    check_platform(Settings(context_splits=0))  # auto: nothing to split on the CPU
    check_platform(Settings(context_splits=1))


@pytest.mark.parametrize(
    "env, message",
    [
        ({"DDTREE_TREE_ATTENTION": "flashinfer"}, "DDTREE_TREE_ATTENTION must be one of"),
        ({"DDTREE_SYNC_DEBUG": "loud"}, "DDTREE_SYNC_DEBUG must be warn or error"),
        ({"DDTREE_PROFILE": "often"}, "DDTREE_PROFILE must be a number"),
        ({"DDTREE_TREE_KERNELS": "cuda"}, "DDTREE_TREE_KERNELS must be one of"),
        ({"DDTREE_CONTEXT_SPLITS": "many"}, "DDTREE_CONTEXT_SPLITS must be auto or a number"),
        ({"DDTREE_CONTEXT_SPLITS": "0"}, "DDTREE_CONTEXT_SPLITS must be auto or a number"),
        (
            {"DDTREE_CONTEXT_SPLITS": "4", "DDTREE_TREE_ATTENTION": "flash"},
            "with DDTREE_TREE_ATTENTION=flash FlashAttention computes it",
        ),
    ],
)
def test_bad_environment_is_refused(monkeypatch, env, message):
    from ddtree.vllm_plugin.config import Settings

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        Settings.from_env()


def test_environment_settings(monkeypatch):
    from ddtree.vllm_plugin.config import Settings

    for name, value in {
        "DDTREE_TREE_ATTENTION": "merge",
        "DDTREE_CUDA_GRAPHS": "0",
        "DDTREE_SYNC_DEBUG": "warn",
        "DDTREE_PROFILE": "20",
    }.items():
        monkeypatch.setenv(name, value)
    assert Settings.from_env() == Settings("merge", False, "warn", 20, False)
    assert Settings.from_env().context_splits == 0  # auto, the default
    monkeypatch.setenv("DDTREE_CONTEXT_SPLITS", "4")
    assert Settings.from_env().context_splits == 4
    monkeypatch.setenv("DDTREE_CONTEXT_SPLITS", "1")
    assert Settings.from_env().context_splits == 1
    monkeypatch.setenv("DDTREE_CONTEXT_SPLITS", "auto")
    assert Settings.from_env().context_splits == 0
    monkeypatch.setenv("DDTREE_TREE_ATTENTION", "flash")  # auto: no shares with that context
    assert Settings.from_env().context_splits == 0


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


def _cuda_args(async_scheduling=None, cudagraph_mode=None):
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    mode = None if cudagraph_mode is None else CUDAGraphMode[cudagraph_mode]
    return SimpleNamespace(
        async_scheduling=async_scheduling,
        enforce_eager=False,
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
    )


@pytest.mark.parametrize(
    "env, overrides, message",
    [
        (None, {"cudagraph_mode": "FULL"}, "not FULL: a full graph of a mixed batch"),
        ("1", {"cudagraph_mode": "FULL"}, "not FULL: a full graph of a mixed batch"),
        ("0", {"async_scheduling": True}, "does not support async_scheduling"),
        ("0", {"cudagraph_mode": "FULL_AND_PIECEWISE"}, "cudagraph_mode PIECEWISE or NONE"),
    ],
)
def test_cuda_settings_refuse_conflicting_choices(monkeypatch, env, overrides, message):
    from ddtree.vllm_plugin.config import configure_for_cuda

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # restored after the test
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    with pytest.raises(ValueError, match=message):
        configure_for_cuda(_cuda_args(**overrides))


def test_cuda_settings_defaults(monkeypatch):
    """The V2 runner keeps vLLM's defaults (full graphs of the verify step, async scheduling);
    the V1 fallback gets synchronous scheduling and piecewise graphs."""
    from vllm.config.compilation import CUDAGraphMode

    from ddtree.vllm_plugin.config import configure_for_cuda

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # restored after the test
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    args = _cuda_args()
    configure_for_cuda(args)
    assert args.async_scheduling is None and args.compilation_config.cudagraph_mode is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    args = _cuda_args()
    configure_for_cuda(args)
    assert args.async_scheduling is False
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


def _v2_vllm_config(options, max_model_len: int, vocab: int, mode=None):
    """What ``v2.prepare.check_settings`` reads of a vLLM config (one GPU, bf16 KV cache)."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    parallel = SimpleNamespace(
        pipeline_parallel_size=1,
        data_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
    )
    return SimpleNamespace(
        parallel_config=parallel,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        model_config=SimpleNamespace(
            uses_xdrope_dim=0, max_model_len=max_model_len, get_vocab_size=lambda: vocab
        ),
        compilation_config=SimpleNamespace(cudagraph_mode=mode or CUDAGraphMode.FULL_AND_PIECEWISE),
        speculative_config=SimpleNamespace(ddtree=options),
    )


@pytest.mark.parametrize(
    "budget, mode, max_model_len, message",
    [
        (511, "FULL_AND_PIECEWISE", 1024, "needs max_model_len >= 1025"),
        (64, "FULL", 2048, "not FULL: a full graph of a mixed batch"),
        (255, "FULL_AND_PIECEWISE", 512, "needs max_model_len >= 513"),
        (63, "FULL_AND_PIECEWISE", 1024, "needs a vocabulary of >= 65 tokens"),
    ],
)
def test_v2_runner_refuses_what_it_cannot_serve(budget, mode, max_model_len, message):
    """The V2 runner's checks (CUDA only at run time; the check itself is plain Python)."""
    from vllm.config.compilation import CUDAGraphMode

    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.v2.prepare import check_settings

    config = _v2_vllm_config(DDTreeOptions(budget), max_model_len, 64, CUDAGraphMode[mode])
    with pytest.raises((ValueError, NotImplementedError), match=message):
        check_settings(config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.model_config.max_model_len = 1025
    config.speculative_config.ddtree = DDTreeOptions(511)
    config.model_config.get_vocab_size = lambda: 151936
    check_settings(config)  # what the H200 suite verified passes
    config.model_config.uses_xdrope_dim = 3
    with pytest.raises(NotImplementedError, match="XD-RoPE"):
        check_settings(config)


def test_v2_runner_refuses_the_v1_only_budget_caps():
    """``ddtree_max_verify_tokens`` / ``ddtree_max_verify_cost`` shape only the V1 runner's
    trees: on V2, given in the config, they are refused by name, not silently ignored (the
    default cap, which V2 does not apply, passes)."""
    from ddtree.vllm_plugin.config import parse_options
    from ddtree.vllm_plugin.v2.prepare import check_settings

    def config(**keys):
        _, options = parse_options({"method": "ddtree", "model": "d", "ddtree_budget": 63, **keys})
        return _v2_vllm_config(options, 1024, 151936)

    check_settings(config())
    check_settings(config(ddtree_max_verify_tokens=None))  # no cap: what V2 does
    for keys in ({"ddtree_max_verify_tokens": 256}, {"ddtree_max_verify_cost": 1.2}):
        with pytest.raises(ValueError, match="ddtree_max_verify_tokens and ddtree_max_verify"):
            check_settings(config(**keys))


def test_request_options_served_or_refused():
    """Both runners serve every option of the sampling distribution, logprobs and structured
    output (also behind a reasoning parser): the V1 runner per tree node (CPU tests), the V2
    runner per node too (GPU equality cases pairopts, pairpen, pairjson); what no runner
    serves is refused by name."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from ddtree.vllm_plugin.requests import REFUSED, unsupported_request

    served = {
        "logprobs": 0,
        "min_p": 0.1,
        "min_tokens": 3,
        "logit_bias": {5: 1.0},
        "allowed_token_ids": [1, 2],
        "top_k": 5,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
        "bad_words": ["x"],
        "structured_outputs": StructuredOutputsParams(choice=["a"]),
    }
    for name, value in served.items():
        assert unsupported_request(SamplingParams(**{name: value})) is None, name
    refused = {"logprob_token_ids": [3, 4], "thinking_token_budget": 0}
    assert refused.keys() == REFUSED.keys()
    for name, value in refused.items():
        params = SamplingParams(max_tokens=4)
        setattr(params, name, value)  # vLLM validates these only with more context
        assert unsupported_request(params) == REFUSED[name], name


def test_budget_per_batch_size_option():
    """``ddtree_budget_per_batch_size`` becomes vLLM's dynamic-SD schedule; the step budget
    follows it (on the V1 runner the largest of a bucket's sizes); bad schedules are refused
    with the option's name."""
    from ddtree.vllm_plugin.config import parse_options

    base = {"method": "ddtree", "model": "d", "ddtree_budget": 64}
    spec, options = parse_options(
        {**base, "ddtree_budget_per_batch_size": [[1, 2, 64], [5, 8, 15]]}
    )
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 64], [5, 8, 15]]
    assert spec["num_speculative_tokens"] == 64 and options.max_verify_tokens is None
    assert [options.scheduled_budget(n) for n in (1, 2, 3, 4, 5, 8, 100)] == [64] * 4 + [15] * 3
    assert [options.step_budget(n, 15) for n in (1, 2, 4, 8, 16)] == [64, 64, 64, 15, 15]
    bad = [
        ([[2, 4, 8]], "must start at 1"),
        ([[1, 4, 65]], "must be in \\[1, ddtree_budget=64\\]"),
        ([[1, 4, 0]], "must be in"),
        ([[1, 4]], "3-item"),
        ("fast", '"auto" or "fixed"'),
        ({}, "non-empty list"),
        ([[1, 4, 8.5]], "ints"),
    ]
    for schedule, message in bad:
        with pytest.raises(ValueError, match="ddtree_budget_per_batch_size: .*" + message):
            parse_options({**base, "ddtree_budget_per_batch_size": schedule})
    with pytest.raises(ValueError, match="drop ddtree_max_verify_tokens"):
        parse_options(
            {**base, "ddtree_budget_per_batch_size": [[1, 4, 8]], "ddtree_max_verify_tokens": 99}
        )
    # "auto": the tuner's schedule (tuner.py); vLLM starts from the whole budget.
    spec, options = parse_options({**base, "ddtree_budget_per_batch_size": "auto"})
    assert options.auto_budget and options.budget_schedule is None
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 64]]
    with pytest.raises(ValueError, match="drop ddtree_max_verify_tokens / ddtree_max_verify_cost"):
        parse_options({**base, "ddtree_budget_per_batch_size": "auto", "ddtree_max_verify_cost": 2})
    # "fixed": B at every batch size (no schedule; the V1 runner's cap still applies)
    spec, options = parse_options({**base, "ddtree_budget_per_batch_size": "fixed"})
    assert options.fixed_budget and options.budget_schedule is None and not options.auto_budget
    assert "num_speculative_tokens_per_batch_size" not in spec
    assert options.max_verify_tokens == 512


def test_v2_default_schedule_keeps_every_verify_in_a_full_graph():
    """With no ``ddtree_budget_per_batch_size`` and several workers (tensor parallel: "auto"
    needs one) the V2 runner verifies per request bucket the widest tree whose verify fits
    vLLM's full-graph limit (512 tokens unless configured), down to the chain; "fixed",
    "auto", a given schedule and a budget within the chain are left alone."""
    from types import SimpleNamespace

    from ddtree.vllm_plugin.config import apply_default_schedule, parse_options

    draft = SimpleNamespace(hf_config=SimpleNamespace(block_size=16))  # D = 15
    two_gpus = SimpleNamespace(distributed_executor_backend="mp", world_size=2)

    def applied(keys: dict, capture=None):
        spec, options = parse_options({"method": "ddtree", "model": "d", **keys})
        vllm_spec = SimpleNamespace(
            draft_model_config=draft,
            num_speculative_tokens_per_batch_size=spec.get("num_speculative_tokens_per_batch_size"),
        )
        compilation = SimpleNamespace(max_cudagraph_capture_size=capture)
        apply_default_schedule(vllm_spec, options, compilation, two_gpus)
        assert options.budget_schedule == (
            None
            if vllm_spec.num_speculative_tokens_per_batch_size is None or options.auto_budget
            else tuple(tuple(r) for r in vllm_spec.num_speculative_tokens_per_batch_size)
        )
        return vllm_spec.num_speculative_tokens_per_batch_size

    big = 1 << 20
    assert applied({"ddtree_budget": 255}) == [
        [1, 2, 255], [3, 4, 127], [5, 8, 63], [9, 16, 31], [17, big, 15]
    ]  # fmt: skip
    assert applied({"ddtree_budget": 63}, capture=2048) == [
        [1, 32, 63],
        [33, 64, 31],
        [65, big, 15],
    ]
    assert applied({"ddtree_budget": 1023})[0] == [1, 1, 511]  # 1 x 1024 tokens: no graph
    assert applied({"ddtree_budget": 15}) is None  # the chain: nothing to schedule
    assert applied({"ddtree_budget": 255, "ddtree_budget_per_batch_size": "fixed"}) is None
    given = [[1, 4, 64], [5, 8, 15]]
    assert applied({"ddtree_budget": 64, "ddtree_budget_per_batch_size": given}) == given
    auto = applied({"ddtree_budget": 64, "ddtree_budget_per_batch_size": "auto"})
    assert auto == [[1, 1, 64]]  # the tuner's to rewrite


def test_v2_default_on_one_gpu_is_auto():
    """With no ``ddtree_budget_per_batch_size`` and the engine's one worker in the scheduler's
    process (``uni``, world size 1: one GPU) the budgets are chosen by throughput ("auto", set
    up as parse_options sets it); a given setting and a chain-sized budget are left alone."""
    from types import SimpleNamespace

    from ddtree.vllm_plugin.config import apply_default_schedule, parse_options

    draft = SimpleNamespace(hf_config=SimpleNamespace(block_size=16))  # D = 15
    one_gpu = SimpleNamespace(distributed_executor_backend="uni", world_size=1)
    compilation = SimpleNamespace(max_cudagraph_capture_size=None)

    def applied(keys: dict):
        spec, options = parse_options({"method": "ddtree", "model": "d", **keys})
        vllm_spec = SimpleNamespace(
            draft_model_config=draft,
            num_speculative_tokens_per_batch_size=spec.get("num_speculative_tokens_per_batch_size"),
        )
        apply_default_schedule(vllm_spec, options, compilation, one_gpu)
        return vllm_spec.num_speculative_tokens_per_batch_size, options

    lookup, options = applied({"ddtree_budget": 255})
    _, given_auto = applied({"ddtree_budget": 255, "ddtree_budget_per_batch_size": "auto"})
    assert lookup == [[1, 1, 255]] and options == given_auto
    assert options.auto_budget and options.budget_schedule is None
    for setting in ("fixed", [[1, 4, 64], [5, 8, 15]]):
        lookup, options = applied({"ddtree_budget": 64, "ddtree_budget_per_batch_size": setting})
        assert not options.auto_budget
    lookup, options = applied({"ddtree_budget": 15})
    assert lookup is None and not options.auto_budget  # the chain: nothing to choose


def test_auto_widens_the_graph_capture():
    """With "auto", vLLM's full-graph limit (512 tokens) is raised to what its widest trees
    need, up to 2048, only where the user set no capture size and graphs are on; other budget
    settings keep vLLM's."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from ddtree.vllm_plugin.config import widen_graph_capture

    def capture(
        auto=True, budget=255, max_num_seqs=None, size=None, sizes=None, eager=False, mode=None
    ):
        compilation = SimpleNamespace(
            max_cudagraph_capture_size=size, cudagraph_capture_sizes=sizes, cudagraph_mode=mode
        )
        args = SimpleNamespace(
            compilation_config=compilation, max_num_seqs=max_num_seqs, enforce_eager=eager
        )
        widen_graph_capture(args, SimpleNamespace(auto_budget=auto, budget=budget))
        return compilation.max_cudagraph_capture_size

    assert capture() == 2048
    assert capture(max_num_seqs=4) == 1024  # 4 x (1 + 255)
    assert capture(max_num_seqs=1) is None  # 1 x 256: vLLM's 512 already holds it
    assert capture(budget=31, max_num_seqs=8) is None  # 8 x 32 x 2 = 512: vLLM's own
    assert capture(auto=False) is None
    assert capture(size=256) == 256 and capture(sizes=[1, 2, 4]) is None
    assert capture(eager=True) is None and capture(mode=CUDAGraphMode.NONE) is None
    assert capture(mode=CUDAGraphMode.FULL_AND_PIECEWISE) == 2048


def test_hybrid_targets_refused_on_cudas_v1_runner_and_with_prefix_caching(monkeypatch):
    """Hybrid (Gated DeltaNet) targets: the CPU build or CUDA's V2 runner, prefix caching off;
    dense targets pass."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from ddtree.vllm_plugin.config import check_hybrid

    hybrid = SimpleNamespace(is_hybrid=True, architecture="Qwen3_5ForConditionalGeneration")
    dense = SimpleNamespace(is_hybrid=False, architecture="Qwen3ForCausalLM")
    args = SimpleNamespace(enable_prefix_caching=None)
    check_hybrid(args, hybrid)
    with pytest.raises(ValueError, match="prefix caching off"):
        check_hybrid(SimpleNamespace(enable_prefix_caching=True), hybrid)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    check_hybrid(args, dense)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # so that the original is restored after
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")  # the test (check_hybrid sets it itself)
    check_hybrid(args, hybrid)  # vLLM would give a hybrid its V1 runner: V2 is asked for
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    check_hybrid(args, dense)
    with pytest.raises(NotImplementedError, match="V2 model runner only"):
        check_hybrid(args, hybrid)


def test_auto_budget_needs_the_worker_in_the_scheduler_process():
    """``"auto"`` rewrites the scheduler's lookup from the worker: refused, naming the option,
    when the engine core runs its workers in other processes; otherwise the scheduler's list
    is built from the tuner's first schedule and shared with it."""
    from types import SimpleNamespace

    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.patches import _share_lookup

    options = DDTreeOptions(64, auto_budget=True, budget_schedule=((1, 2, 64), (3, 8, 15)))
    scheduler = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="mp"))
    with pytest.raises(ValueError, match='ddtree_budget_per_batch_size "auto" needs'):
        _share_lookup(scheduler, config, options)
    config.parallel_config.distributed_executor_backend = "uni"
    _share_lookup(scheduler, config, options)
    assert scheduler.dynamic_sd_lookup is options.live_lookup
    assert scheduler.dynamic_sd_lookup[1:] == [64, 64] + [15] * 6


def test_v2_drafts_reach_the_scheduler_with_their_parents():
    """The V2 runner's drafts of a structured-output step go to the scheduler as
    ``TreeDraftTokenIds``: each request's draft parents from the tree tables' copy, in batch
    order (what ``v1/grammar.tree_grammar_bitmask`` reads)."""
    import numpy as np
    from vllm.v1.outputs import DraftTokenIds

    from ddtree.vllm_plugin.v1.grammar import TreeDraftTokenIds
    from ddtree.vllm_plugin.v2.grammar import with_parents

    drafts = DraftTokenIds(["a", "b"], [[5, 6, 7], [8, 9, 10]])
    parents = np.array([[0, 0, 1], [0, 1, 2]])
    got = with_parents(drafts, parents)
    assert isinstance(got, TreeDraftTokenIds)
    assert got.req_ids == ["a", "b"] and got.draft_token_ids == drafts.draft_token_ids
    assert got.ddtree_parents == {"a": [0, 0, 1], "b": [0, 1, 2]}


class _PrefixGrammar:
    """A grammar accepting the token sequences in ``valid`` (prefix-closed); counts the tokens
    it advanced by and records any it was asked to accept but rejects."""

    def __init__(self, valid):
        self.valid, self.seq, self.rejected, self.advances = valid, [], [], 0

    def is_terminated(self):
        return False

    def validate_tokens(self, tokens):
        out = []
        for t in tokens:
            if tuple(self.seq + out + [t]) not in self.valid:
                break
            out.append(t)
        return out

    def accept_tokens(self, request_id, tokens):
        for t in tokens:
            if tuple(self.seq + [t]) not in self.valid:
                self.rejected.append(t)
                return False
            self.seq.append(t)
            self.advances += 1
        return True

    def rollback(self, n):
        del self.seq[len(self.seq) - n :]


class _BitmaskManager:
    """The ``StructuredOutputManager`` members the tree bitmask uses; a row holds the grammar's
    state, encoded (100 x tokens advanced + the last token), or -1 for no mask."""

    enable_in_reasoning = False

    def __init__(self, apply: bool = True, reasoner=None):
        import torch

        self._grammar_bitmask = torch.zeros(8, dtype=torch.long)
        self.apply, self.reasoner = apply, reasoner

    def should_fill_bitmask(self, request):
        return self.apply

    def _get_reasoner(self, request):
        return self.reasoner

    def _fill_bitmasks(self, batch):
        for grammar, index, apply in batch:
            state = len(grammar.seq) * 100 + (grammar.seq[-1] if grammar.seq else 0)
            self._grammar_bitmask[index] = state if apply else -1


def test_tree_grammar_bitmask_fills_each_node_from_its_root_path():
    """The scheduler's bitmask for a tree: row 0 from the request's state, row s from the state
    after draft s's root path, the full mask where the grammar rejects that path; the grammar
    moves one token per node, is left where it was, and is never asked to accept a token it
    rejects (vLLM's backends log an ERROR for each)."""
    from types import SimpleNamespace

    from ddtree.vllm_plugin.v1.grammar import tree_grammar_bitmask

    grammar = _PrefixGrammar({(), (5,), (6,), (5, 7)})
    requests = {"r": SimpleNamespace(structured_output_request=SimpleNamespace(grammar=grammar))}
    # drafts 5, 6, 7, 8 with parents root, root, draft 1, draft 3: paths [5] [6] [5 7] [5 7 8]
    rows = tree_grammar_bitmask(_BitmaskManager(), requests, ["r"], {"r": [5, 6, 7, 8]},
                                {"r": [0, 0, 1, 3]})  # fmt: skip
    assert rows.tolist() == [0, 105, 106, 207, -1]
    assert grammar.rejected == [] and grammar.seq == []
    assert grammar.advances == 3  # one per node the grammar allows (depth first), not per path


def test_tree_grammar_bitmask_gates_each_path_at_its_end_of_reasoning():
    """With a reasoning parser, while the request reasons: a node's row is unconstrained until
    its own root path holds the end-of-reasoning token; from that token on, constrained by the
    grammar advanced through the path's tokens after it (vLLM's gate on a chain, per path)."""
    from types import SimpleNamespace

    from ddtree.vllm_plugin.v1.grammar import tree_grammar_bitmask

    END = 9

    class Reasoner:  # reasoning ends at token END
        def is_reasoning_end_streaming(self, input_ids, delta_ids):
            return END in delta_ids

    # drafts 5, END, 7, END, 8, 6 with parents root, 1, 2, root, 4, 5:
    # paths [5] [5 E] [5 E 7] [E] [E 8] [E 8 6]
    drafts, parents = [5, END, 7, END, 8, 6], [0, 1, 2, 0, 4, 5]
    grammar = _PrefixGrammar({(), (7,), (8,)})  # after reasoning: 7 or 8, nothing after them
    request = SimpleNamespace(
        structured_output_request=SimpleNamespace(grammar=grammar), all_token_ids=[1, 2]
    )
    manager = _BitmaskManager(apply=False, reasoner=Reasoner())  # reasoning, not yet ended
    rows = tree_grammar_bitmask(manager, {"r": request}, ["r"], {"r": drafts},
                                {"r": parents})  # fmt: skip
    # root and [5]: reasoning; [5 E], [E]: the grammar's start; [5 E 7], [E 8]: after 7 / 8;
    # [E 8 6]: rejected content (never accepted: 6 is masked out of its parent's row)
    assert rows.tolist() == [-1, -1, 0, 107, 0, 108, -1]
    assert grammar.rejected == [] and grammar.seq == []


def test_async_scheduling_drafts_reach_the_grammar_whole_with_their_parents():
    """With async scheduling vLLM hands a structured-output step's drafts to
    ``Scheduler.update_draft_token_ids_in_output``: for DDTree the tree nodes stay whole (vLLM
    would pad the drafts after the first one its grammar rejects as a chain with -1) and their
    parents reach the bitmask; a non-DDTree scheduler keeps vLLM's chain check."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from ddtree.vllm_plugin import patches
    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.v1.grammar import TreeDraftTokenIds

    patches.register()

    class Grammar:  # accepts only token 5 first: as a chain, [5, 6, 7] keeps 5
        def validate_tokens(self, tokens):
            return tokens[:1] if tokens[:1] == [5] else []

    def scheduler(options):
        request = SimpleNamespace(
            is_finished=lambda: False,
            structured_output_request=SimpleNamespace(grammar=Grammar()),
        )

        class Manager:  # vLLM's: should_advance is a method, the patch shadows it per call
            def should_advance(self, request):
                return True

        manager = Manager()
        spec = SimpleNamespace(ddtree=options) if options else None
        return SimpleNamespace(
            requests={"r": request},
            structured_output_manager=manager,
            vllm_config=SimpleNamespace(speculative_config=spec),
        )

    def deferred_output():
        return SimpleNamespace(scheduled_spec_decode_tokens={"r": [-1, -1, -1]})

    drafts = TreeDraftTokenIds(["r"], [[5, 6, 7, 8]], {"r": [0, 0, 1, 3]})
    options = DDTreeOptions(3)
    sched, out = scheduler(options), deferred_output()
    Scheduler.update_draft_token_ids_in_output(sched, drafts, out)
    assert out.scheduled_spec_decode_tokens == {"r": [5, 6, 7]}  # trimmed to 3, not cut
    assert out.num_invalid_spec_tokens == {}
    assert options.tree_parents == {"r": [0, 0, 1, 3]}
    assert sched.structured_output_manager.should_advance(None)  # restored after the call

    drafts = TreeDraftTokenIds(["r"], [[5, 6, 7]], {})
    sched, out = scheduler(None), deferred_output()
    Scheduler.update_draft_token_ids_in_output(sched, drafts, out)
    assert out.scheduled_spec_decode_tokens == {"r": [5, -1, -1]}  # vLLM's chain check


def test_tree_grammar_bitmask_leaves_placeholder_drafts_unmasked():
    """Drafts the scheduler never learned (async placeholders, -1) get rows without a mask,
    as vLLM leaves them; real drafts without a tree shape are an error naming the request."""
    from types import SimpleNamespace

    import torch

    from ddtree.vllm_plugin.v1.grammar import tree_grammar_bitmask

    class Grammar:
        def is_terminated(self):
            return False

        def validate_tokens(self, tokens):
            raise AssertionError("a placeholder reached the grammar")

    class Manager:
        _grammar_bitmask = torch.zeros(4, dtype=torch.long)

        def should_fill_bitmask(self, request):
            return True

        def _fill_bitmasks(self, batch):
            for _grammar, index, apply in batch:
                self._grammar_bitmask[index] = 1 if apply else -1

    requests = {"r": SimpleNamespace(structured_output_request=SimpleNamespace(grammar=Grammar()))}
    rows = tree_grammar_bitmask(Manager(), requests, ["r"], {"r": [-1, -1, -1]}, {})
    assert rows.tolist() == [1, -1, -1, -1]
    with pytest.raises(RuntimeError, match="no tree shape reached the scheduler.*request r"):
        tree_grammar_bitmask(Manager(), requests, ["r"], {"r": [5, -1, -1]}, {})
