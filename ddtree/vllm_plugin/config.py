"""DDTree's options in a vLLM speculative config, and the process settings from the environment.

``{"method": "ddtree", "model": DRAFTER, "ddtree_budget": B, ...}`` becomes vLLM's own DFlash
config plus a :class:`DDTreeOptions` attached to it (``parse_options``); the environment is
read once, when the plugin registers (:class:`Settings`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("vllm.ddtree")

MAX_BUDGET = 1024
# Default cap on a step's tree tokens (all requests together). On an H200 at Qwen3-8B shapes a
# verify forward of up to ~512 tokens costs about what a 16-token chain verify costs; beyond it
# the forward grows with the tokens, so trees shrink as the batch grows.
DEFAULT_MAX_VERIFY_TOKENS = 512
TREE_ATTENTION_CHOICES = ("auto", "merge", "triton", "flash")
TREE_KERNELS_CHOICES = ("auto", "torch", "fused")


@dataclass(frozen=True)
class Settings:
    """Process-wide knobs from the environment, read once at plugin registration.

    - ``DDTREE_TREE_ATTENTION=auto|merge|triton|flash``: the GPU tree attention (auto:
      triton; flash, V2 only: the context part by vLLM's FlashAttention, the tree's slots by
      the paged tree kernel, so that the bulk of each sum rounds as no-spec's does);
    - ``DDTREE_CUDA_GRAPHS=0``: DDTree's own graphs (tree stage, KV commit) off;
    - ``DDTREE_SYNC_DEBUG=warn|error``: torch's CUDA sync checker around DDTree's step code;
    - ``DDTREE_PROFILE=N``: the step's time split logged every N steps;
      ``DDTREE_PROFILE_OPS=1``: plus a torch.profiler op table;
    - ``DDTREE_TREE_KERNELS=auto|torch|fused``: the V2 runner's tree build, walk and KV
      compaction in ``ddtree.kernels`` (auto, fused: Triton, 10-25x faster than the torch ops
      on the H200 and token-identical in its equality suite) or in torch ops (the reference;
      the only choice on the CPU and the V1 runner);
    - ``DDTREE_TUNE_EVERY=N``: steps between updates of an ``"auto"`` budget schedule
      (default 64; ``tuner.py``);
    - ``DDTREE_ACCEPTANCE=N``: every N steps, what each budget K <= B would have accepted on
      the steps' walks (``ddtree.budget.AcceptanceCurve``: device sums, one host read per log
      line), logged as ``ddtree-acceptance {...}`` (``ddtree bench --ddtree-acceptance``);
    - ``DDTREE_STEP_LOG=N``: any engine (the chain's and no-spec's too) logs each step's start
      (host clock at ``execute_model``) and kind (every request verifying drafts, some, none),
      N steps per ``ddtree-steps {...}`` line (``debug.StepPeriods``; ``ddtree bench
      --step-log`` reads them): no sync, so under async scheduling a step's period is the step
      time the engine runs at;
    - ``DDTREE_CONTEXT_SPLITS=auto|N`` (V2 runner, tree kernel): the paged tree kernel
      attends the cached context in shares merged by log-sum-exp (split-KV: a long context is
      otherwise one program's serial loop). ``auto`` (default): per launch, as many shares
      (up to 4) as keep the grid within one wave of the GPU (``shares_for_grid``: one or two
      requests at moderate budgets), for steps of up to ``AUTO_SPLIT_TOKENS`` tokens; ``1``:
      never; ``N``: always N, in steps of up to the largest CUDA graph's tokens. Float32
      scratch of shares x those tokens x heads x head size.
    """

    tree_attention: str = "auto"
    cuda_graphs: bool = True
    sync_debug: str | None = None
    profile_every: int = 0
    profile_ops: bool = False
    tree_kernels: str = "auto"
    acceptance_every: int = 0
    tune_every: int = 64
    step_log_every: int = 0
    context_splits: int = 0  # 0: auto (shares by the launch grid), 1: off, N: always N

    @property
    def fused_tree_kernels(self) -> bool:
        """The V2 runner's tree stage runs ``ddtree.kernels`` (it runs on CUDA only)."""
        return self.tree_kernels in ("auto", "fused")

    @classmethod
    def from_env(cls) -> Settings:
        tree_attention = os.environ.get("DDTREE_TREE_ATTENTION", "auto")
        if tree_attention not in TREE_ATTENTION_CHOICES:
            raise ValueError(
                f"DDTREE_TREE_ATTENTION must be one of {TREE_ATTENTION_CHOICES}, "
                f"got {tree_attention!r}"
            )
        sync_debug = os.environ.get("DDTREE_SYNC_DEBUG") or None
        if sync_debug not in (None, "warn", "error"):
            raise ValueError(f"DDTREE_SYNC_DEBUG must be warn or error, got {sync_debug!r}")
        profile, acceptance = _steps("DDTREE_PROFILE"), _steps("DDTREE_ACCEPTANCE")
        splits_text = os.environ.get("DDTREE_CONTEXT_SPLITS", "auto") or "auto"
        if splits_text != "auto" and not (splits_text.isdigit() and int(splits_text) >= 1):
            raise ValueError(
                f"DDTREE_CONTEXT_SPLITS must be auto or a number of shares >= 1, got "
                f"{splits_text!r}"
            )
        splits = 0 if splits_text == "auto" else int(splits_text)
        if splits > 1 and tree_attention == "flash":
            raise ValueError(
                "DDTREE_CONTEXT_SPLITS splits the tree kernel's context part; with "
                "DDTREE_TREE_ATTENTION=flash FlashAttention computes it: set one of them"
            )
        tree_kernels = os.environ.get("DDTREE_TREE_KERNELS", "auto")
        if tree_kernels not in TREE_KERNELS_CHOICES:
            raise ValueError(
                f"DDTREE_TREE_KERNELS must be one of {TREE_KERNELS_CHOICES}, got {tree_kernels!r}"
            )
        return cls(
            tree_attention=tree_attention,
            cuda_graphs=os.environ.get("DDTREE_CUDA_GRAPHS", "1") != "0",
            sync_debug=sync_debug,
            profile_every=profile,
            profile_ops=os.environ.get("DDTREE_PROFILE_OPS") == "1",
            tree_kernels=tree_kernels,
            acceptance_every=acceptance,
            tune_every=_steps("DDTREE_TUNE_EVERY") or 64,
            step_log_every=_steps("DDTREE_STEP_LOG"),
            context_splits=splits,
        )


def _steps(name: str) -> int:
    """A number of steps from environment variable ``name`` (unset or empty: 0, off)."""
    value = os.environ.get(name, "0") or "0"
    if not value.isdigit():
        raise ValueError(f"{name} must be a number of steps, got {value!r}")
    return int(value)


SETTINGS = Settings()  # replaced by Settings.from_env() in patches.register()


@dataclass
class DDTreeOptions:
    """The ``ddtree_*`` keys of one engine's speculative config."""

    budget: int  # B: tree nodes per request and step (at most)
    chain_seed: bool = True
    max_verify_tokens: int | None = None  # cap on the step's tree tokens, all requests together
    max_verify_cost: float | None = None  # verify forward time / the chain's, at most
    max_verify_tokens_given: bool = False  # the cap came from the config, not the default
    bucket_budgets: dict[int, int] | None = None  # {request bucket: B_step}, from the cost model
    # ((first, last, B_step), ...): batch-size ranges (sorted) and the budget each verifies
    budget_schedule: tuple[tuple[int, int, int], ...] | None = None
    # ddtree_budget_per_batch_size "auto": budget_schedule is chosen by throughput while
    # serving (tuner.py) and written into the scheduler's lookup, shared here once it exists
    auto_budget: bool = False
    # ddtree_budget_per_batch_size "fixed": B at every batch size (no default schedule on V2)
    fixed_budget: bool = False
    live_lookup: list[int] | None = field(default=None, repr=False, compare=False)
    # Structured-output requests (V1 runner): request id -> parent slot of each draft, from
    # the proposer to the scheduler's grammar bitmask (v1/grammar.py); one process only.
    tree_parents: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)

    def dense_schedule(self, max_batch: int) -> list[int]:
        """``budget_schedule`` as vLLM's scheduler holds it: entry n the budget of n requests,
        n = 1..max_batch (``build_dynamic_sd_schedule_lookup``; entry 0 unused)."""
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        ranges = [list(r) for r in self.budget_schedule]
        return build_dynamic_sd_schedule_lookup(ranges, max_batch, self.budget)

    def scheduled_budget(self, num_reqs: int) -> int | None:
        """The schedule's budget for ``num_reqs`` requests, as vLLM's scheduler looks it up,
        or None without a schedule."""
        if not self.budget_schedule:
            return None
        size = max(num_reqs, 1)
        return self.dense_schedule(size)[size]

    def step_budget(self, num_reqs: int, depth: int) -> int:
        """This step's B for ``num_reqs`` requests (a bucket of the V1 runner's graphs). With
        ``ddtree_budget_per_batch_size``: the largest scheduled budget of the batch sizes in
        the bucket (vLLM verifies the first 1 + K slots of each tree for the step's actual
        size, which is the budget-K tree); with ``"auto"`` the whole budget (the tuner learns
        every K's prediction from it). Otherwise the budget, shrunk so that
        ``num_reqs * (1 + B)`` stays within ``max_verify_tokens`` and to the start-up cost
        model's choice for the bucket, but never below the chain (``min(budget, D)`` nodes)."""
        if self.auto_budget:  # whole trees: the drafter's own prediction covers every K
            return self.budget
        if self.budget_schedule:
            sizes = range(num_reqs // 2 + 1, num_reqs + 1)  # the bucket (powers of two)
            return max(self.scheduled_budget(n) for n in sizes)
        steps = self.budget
        if self.max_verify_tokens is not None:
            steps = min(steps, self.max_verify_tokens // max(num_reqs, 1) - 1)
        if self.bucket_budgets:
            steps = min(steps, self.bucket_budgets.get(num_reqs, steps))
        return max(min(self.budget, depth), steps)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_options(spec: dict) -> tuple[dict, DDTreeOptions]:
    """Turn a ``{"method": "ddtree", ...}`` speculative config into a DFlash one + options."""
    spec = dict(spec)
    budget = spec.pop("ddtree_budget", None)
    chain_seed = spec.pop("ddtree_chain_seed", True)
    max_verify_tokens = spec.pop("ddtree_max_verify_tokens", "default")
    max_verify_cost = spec.pop("ddtree_max_verify_cost", None)  # opt-in (docs: README)
    schedule = spec.pop("ddtree_budget_per_batch_size", None)
    unknown = sorted(k for k in spec if k.startswith("ddtree_"))
    if unknown:
        raise ValueError(f"unknown ddtree option(s) {unknown}")
    if budget is None:
        budget = spec.get("num_speculative_tokens")
    if not _is_int(budget) or not 1 <= budget <= MAX_BUDGET:
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
    auto = schedule == "auto"
    fixed = schedule == "fixed"
    if fixed:
        schedule = None
    if schedule is not None:
        schedule = None if auto else budget_schedule(schedule, budget)
        if max_verify_cost is not None or max_verify_tokens not in ("default", None):
            raise ValueError(
                "ddtree_budget_per_batch_size sets the budget per batch size itself: drop "
                "ddtree_max_verify_tokens / ddtree_max_verify_cost"
            )
        max_verify_tokens = None
        # vLLM's dynamic speculative decoding: the scheduler verifies K of the B drafts for
        # the step's batch size; the first 1 + K slots of a DDTree tree are its budget-K tree.
        # "auto" starts from the whole budget; the tuner rewrites the lookup at start-up.
        spec["num_speculative_tokens_per_batch_size"] = (
            [[1, 1, budget]] if auto else [list(r) for r in schedule]
        )
    given_cap = max_verify_tokens not in ("default", None)
    if max_verify_tokens == "default":
        # The cost model measures what the fixed cap guesses: with it, no cap by default.
        cap = max(DEFAULT_MAX_VERIFY_TOKENS, 1 + budget)
        max_verify_tokens = cap if max_verify_cost is None else None
    if max_verify_tokens is not None and (not _is_int(max_verify_tokens) or max_verify_tokens < 1):
        raise ValueError(
            "ddtree_max_verify_tokens must be a positive int (tree tokens per step, all "
            f"requests together) or null (no cap), got {max_verify_tokens!r}"
        )
    if spec.get("model") is None:
        raise ValueError("speculative_config.model must name the DFlash drafter for ddtree")
    spec["method"] = "dflash"
    spec["num_speculative_tokens"] = budget  # vLLM schedules and counts the B tree nodes
    cost = None if max_verify_cost is None else float(max_verify_cost)
    return spec, DDTreeOptions(
        budget,
        chain_seed,
        max_verify_tokens,
        cost,
        max_verify_tokens_given=given_cap,
        budget_schedule=schedule,
        auto_budget=auto,
        fixed_budget=fixed,
    )


def budget_schedule(schedule, budget: int) -> tuple[tuple[int, int, int], ...]:
    """``ddtree_budget_per_batch_size``: ``[[first, last, B_step], ...]`` inclusive batch-size
    ranges (the first starting at 1) and the tree nodes verified per request there, each in
    [1, ddtree_budget]; vLLM's own format (``num_speculative_tokens_per_batch_size``). (Or
    ``"auto"``, which ``parse_options`` handles: chosen by throughput while serving.)"""
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    hint = "ddtree_budget_per_batch_size: "
    if isinstance(schedule, str):
        raise ValueError(f'{hint}[[first, last, budget], ...], "auto" or "fixed", got {schedule!r}')
    if isinstance(schedule, list):
        for entry in schedule:
            if not isinstance(entry, list | tuple) or not all(_is_int(x) for x in entry):
                raise ValueError(f"{hint}entries must be [first, last, budget] ints, got {entry!r}")
    try:
        ranges = validate_and_normalize_dynamic_sd_schedule(schedule)
    except ValueError as err:
        raise ValueError(hint + str(err)) from None
    for first, last, steps in ranges:
        if not 1 <= steps <= budget:
            raise ValueError(
                f"{hint}the budget of batch sizes {first}-{last} must be in [1, ddtree_budget="
                f"{budget}], got {steps}"
            )
    return tuple(ranges)


def options_of(config) -> DDTreeOptions | None:
    """The DDTree options of a vLLM ``SpeculativeConfig`` (or None: not a DDTree engine)."""
    return getattr(config, "ddtree", None) if config is not None else None


def draft_depth(spec) -> int:
    """D: the positions the DFlash drafter of speculative config ``spec`` proposes per step
    (its block size - 1; block size 16 when the checkpoint does not say)."""
    return (getattr(spec.draft_model_config.hf_config, "block_size", None) or 16) - 1


def configure_for_cuda(args) -> None:
    """Engine settings on CUDA; an explicit choice the tree path cannot serve is refused.

    vLLM's V2 model runner (the CUDA default) runs DDTree with full CUDA graphs of the verify
    step and async scheduling; only ``cudagraph_mode=FULL`` (full graphs of mixed batches) is
    refused. With ``VLLM_USE_V2_MODEL_RUNNER=0`` (the V1 runner, kept as a fallback) the tree
    batch is built from host-side step data and attention runs eagerly between piecewise
    graphs: async scheduling off, ``cudagraph_mode`` PIECEWISE or NONE.
    """
    from vllm.config.compilation import CUDAGraphMode

    mode = args.compilation_config.cudagraph_mode
    v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if v2 not in ("0", "false"):
        if mode == CUDAGraphMode.FULL:
            raise ValueError(
                "ddtree needs compilation_config.cudagraph_mode FULL_AND_PIECEWISE (the "
                "default), FULL_DECODE_ONLY, PIECEWISE or NONE, not FULL: a full graph of a "
                "mixed batch would replay the tree attention for prefill rows"
            )
        return
    if args.async_scheduling:
        raise ValueError(
            "ddtree on the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0) does not support "
            "async_scheduling: drop --async-scheduling or use the V2 runner"
        )
    args.async_scheduling = False
    if mode is not None and mode not in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        raise ValueError(
            f"ddtree on the V1 model runner needs compilation_config.cudagraph_mode PIECEWISE "
            f"or NONE, got {mode.name}: the tree mask is applied in eager attention between "
            "piecewise graphs"
        )
    if mode is None and not args.enforce_eager:
        args.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        log.info("ddtree: compilation_config.cudagraph_mode=PIECEWISE (V1 model runner)")


def uses_v2_runner() -> bool:
    """Whether a CUDA engine runs vLLM's V2 model runner (its default; hybrid targets are
    switched to it by :func:`check_hybrid`), read from ``VLLM_USE_V2_MODEL_RUNNER``."""
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() not in ("0", "false")


def apply_default_schedule(spec, options: DDTreeOptions, compilation, parallel=None) -> None:
    """On the V2 runner with no ``ddtree_budget_per_batch_size``, on vLLM's built
    ``SpeculativeConfig`` ``spec`` (read by its scheduler and the runner's graph manager, in
    every process) and on ``options``: ``"auto"`` (budgets per batch size chosen by throughput
    while serving, ``tuner.py``) when the engine's one worker shares the scheduler's process
    (``parallel``: ``distributed_executor_backend`` "uni", world size 1, i.e. one GPU), which
    "auto" needs; otherwise (several workers) the schedule of ``tuner.default_schedule``: per
    request bucket the widest tree whose verify fits a full CUDA graph. ``"fixed"`` keeps B at
    every batch size, and so does a budget within the chain (nothing to choose). Hybrid targets
    too: a tree width changing between a request's steps under the GDN stash and replay gives
    what a fixed width gives (H100 equality cases ``hybrid_ddtreesched_30`` /
    ``hybrid_ddtreeauto_30``, 2026-12-07)."""
    from ddtree.vllm_plugin.tuner import default_schedule

    if options.budget_schedule or options.auto_budget or options.fixed_budget:
        return
    depth = draft_depth(spec)
    if options.budget <= depth:
        return
    one_worker = (
        parallel is not None
        and parallel.distributed_executor_backend == "uni"
        and parallel.world_size == 1
    )
    if one_worker:  # as parse_options sets "auto" up; the tuner writes the schedule
        spec.num_speculative_tokens_per_batch_size = [[1, 1, options.budget]]
        options.auto_budget = True
        options.max_verify_tokens = None
        log.info(
            'ddtree: budgets per batch size chosen by throughput while serving ("auto", up to '
            '%d; ddtree_budget_per_batch_size "fixed" verifies %d at every size)',
            options.budget,
            options.budget,
        )
        return
    graph_tokens = getattr(compilation, "max_cudagraph_capture_size", None)
    schedule = default_schedule(options.budget, depth, graph_tokens)
    if schedule is None:
        return
    spec.num_speculative_tokens_per_batch_size = schedule
    options.budget_schedule = tuple(tuple(r) for r in schedule)
    workers = "none" if parallel is None else parallel.world_size
    log.info(
        "ddtree: budgets per batch size %s (each verify within a full CUDA graph; "
        '"auto", which chooses by throughput, needs one worker: %s here; '
        'ddtree_budget_per_batch_size "fixed" verifies %d at every size)',
        ", ".join(f"{a}-{b}: {k}" for a, b, k in schedule[:-1])
        + f", {schedule[-1][0]}+: {schedule[-1][2]}",
        workers,
        options.budget,
    )


AUTO_GRAPH_TOKENS = 2048  # the full-graph limit "auto" raises vLLM's default (512) to


def widen_graph_capture(args, options: DDTreeOptions) -> None:
    """With ``"auto"`` budgets and no capture size given (``max_cudagraph_capture_size`` and
    ``cudagraph_capture_sizes`` unset), full CUDA graphs up to ``AUTO_GRAPH_TOKENS`` verify
    tokens (or the most that ``max_num_seqs`` requests of 1 + B tokens need, never below
    vLLM's own default) instead of vLLM's 512: the tuner builds only trees whose verify
    replays a full graph, so at 512 a bucket of 32 requests is held to the chain (x0.98 of the
    chain at c=32 on an H100) while 2048 lets it verify 31-63 (x1.17, H100, 2026-12-06).
    vLLM still clips the limit to ``max_num_batched_tokens``."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = args.compilation_config
    if not options.auto_budget or args.enforce_eager:
        return
    if compilation.cudagraph_mode == CUDAGraphMode.NONE:
        return
    if compilation.max_cudagraph_capture_size is not None:
        return
    if compilation.cudagraph_capture_sizes is not None:
        return
    seqs = args.max_num_seqs or AUTO_GRAPH_TOKENS  # None: vLLM's default (256 or more)
    vllm_default = min(seqs * (1 + options.budget) * 2, 512)
    tokens = max(vllm_default, min(seqs * (1 + options.budget), AUTO_GRAPH_TOKENS))
    if tokens <= vllm_default:
        return
    compilation.max_cudagraph_capture_size = tokens
    log.info(
        'ddtree: CUDA graphs up to %d tokens (vLLM: 512), so that "auto" can verify wider '
        "trees at larger batches in full graphs; set compilation_config "
        "max_cudagraph_capture_size to choose",
        tokens,
    )


def check_platform(settings: Settings) -> None:
    """Refuse platforms and settings the tree path is not wired for."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        if settings.tree_attention in ("triton", "flash"):
            raise NotImplementedError(
                f"DDTREE_TREE_ATTENTION={settings.tree_attention} needs a CUDA GPU; on the CPU "
                "use merge or auto"
            )
        if settings.tree_kernels == "fused":
            raise NotImplementedError(
                "DDTREE_TREE_KERNELS=fused runs on CUDA's V2 model runner; on the CPU use torch"
            )
        if settings.context_splits > 1:
            raise NotImplementedError(
                "DDTREE_CONTEXT_SPLITS splits the CUDA tree kernel's context; unset it on the CPU"
            )
    elif not current_platform.is_cuda():
        # The tree mask is wired into vLLM's CPU and FlashAttention paths only; elsewhere the
        # target would attend causally across siblings and outputs would be wrong.
        raise NotImplementedError(
            f"ddtree in vLLM runs on the CPU and CUDA platforms only, not on "
            f"{current_platform.device_name!r}"
        )


def check_hybrid(args, target_model_config) -> None:
    """A hybrid target (Qwen3.5 / 3.6: Gated DeltaNet + attention layers): the tree verify of
    its linear-attention layers runs in vLLM's CPU build (``vllm_plugin/gdn.py``) and on CUDA's
    V2 model runner (``vllm_plugin/v2/gdn.py``); refuse what they do not serve."""
    from vllm.platforms import current_platform

    if not target_model_config.is_hybrid:
        return
    arch = target_model_config.architecture
    chosen = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if current_platform.is_cuda():
        if chosen in ("0", "false"):
            raise NotImplementedError(
                f"ddtree on a hybrid target ({arch}: linear-attention layers) runs on CUDA's V2 "
                "model runner only: unset VLLM_USE_V2_MODEL_RUNNER=0"
            )
        if not chosen:
            # vLLM 0.26 gives hybrid targets its V1 runner by default (and forces V2 only for
            # DFlash drafters that mix sliding and full attention): DDTree's GDN path is V2's.
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            log.info("ddtree: hybrid target %s: VLLM_USE_V2_MODEL_RUNNER=1", arch)
    if args.enable_prefix_caching:
        raise ValueError(
            f"ddtree on a hybrid target ({arch}) needs prefix caching off (drop "
            "--enable-prefix-caching): vLLM's mamba_cache_mode keeps a linear-attention state "
            "per cache block, and the tree commit writes only the request's current state"
        )


def check_drafter_fits(draft_path: str, target_hf_config) -> None:
    """Refuse at start-up a drafter that cannot serve the target (a local z-lab checkpoint)."""
    from ddtree.dflash import DFlashConfigError, check_pair, read_config

    config_path = Path(draft_path) / "config.json"
    if not config_path.is_file():
        return  # a hub id: vLLM resolves and checks it
    try:
        check_pair(read_config(config_path), target_hf_config)
    except DFlashConfigError as err:
        raise ValueError(f"ddtree: drafter {draft_path} does not fit the target: {err}") from err
