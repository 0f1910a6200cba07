"""Where a DDTree step's GPU time goes inside vLLM: torch.profiler over a few steps of an
in-process engine (so the profiler sees the engine's kernels), kernels grouped and summed.

    python benchmarks/profile_step.py --budget 63 --concurrency 16 --out DIR [--dummy-shapes]

Writes DIR/profile_<engine>_c<c>.txt (top kernels by CUDA time, per step) and prints a
summary line per run: ms per step of a plain run (and its steps' mean period by kind: every
request verifying drafts, a prefill among them, none), of the profiled run, and of GPU time.
With ``--host``, one more run under cProfile (the engine core runs in this process: scheduler,
runner, drafter, sampler) writes DIR/host_<engine>_c<c>.txt: Python functions by own and by
cumulative time per step, where a step's host time goes (the bundled pair's steps are
host-bound: its GPU work is ~1 ms of a 5-8 ms step).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the profiler needs the engine here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=63, help="0: vLLM's DFlash chain")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dummy-shapes", action="store_true", help="Qwen3-8B shapes")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="float32 for a CPU dry run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--host", action="store_true", help="also a cProfile run of the host")
    parser.add_argument(
        "--plain-only", action="store_true", help="only the plain run: its ms per step by kind"
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=1,
        help="requests per slot: with > 1, waves x concurrency requests of mixed lengths, so "
        "that requests arrive (a prefill) while others decode, as in `ddtree bench`",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    import vllm

    from ddtree.bench.shapes import write_dummy_shapes
    from ddtree.vllm_plugin.patches import register

    register()  # the engine runs in this process: its plugin too, whether installed or not
    step_log = log_steps()

    root = Path(__file__).resolve().parent.parent
    target, drafter = root / "models" / "target", root / "models" / "drafter"
    extra = {}
    if args.dummy_shapes:
        target, drafter = write_dummy_shapes(args.out / "models")
        extra = dict(load_format="dummy", skip_tokenizer_init=True)
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15}
    if args.budget:
        spec = {
            "method": "ddtree",
            "model": str(drafter),
            "ddtree_budget": args.budget,
            "ddtree_budget_per_batch_size": "fixed",  # the budget profiled, at every size
        }
    llm = vllm.LLM(
        model=str(target),
        speculative_config=spec,
        dtype=args.dtype,
        max_model_len=2048,
        max_num_seqs=args.concurrency,
        seed=0,
        kv_cache_memory_bytes=2 << 30,
        gpu_memory_utilization=0.05,
        disable_log_stats=False,
        **extra,
    )
    count = args.concurrency * args.waves
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(count)]
    # one length with one wave; else 0.5x .. 1.5x the length, so that finishes (and arrivals)
    # spread over the run
    lengths = [
        args.max_tokens if args.waves == 1 else args.max_tokens // 2 + (i * 7919) % args.max_tokens
        for i in range(count)
    ]
    params = [
        vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in lengths
    ]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles, first graphs

    def steps() -> int:
        return next(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total")

    before = steps()  # a plain run first: the step's wall time without a profiler's overhead
    step_log.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain_steps = steps() - before
    plain_ms = 1e3 * (time.perf_counter() - start) / plain_steps
    split = step_split(step_log)
    name = f"{'ddtree-' + str(args.budget) if args.budget else 'dflash'}_c{args.concurrency}"
    if args.waves > 1:
        name += f"_w{args.waves}"
    if args.plain_only:
        print(f"{name}: {plain_steps} steps, {plain_ms:.2f} ms wall/step unprofiled\n{split}")
        llm.llm_engine.engine_core.shutdown()
        return

    before = steps()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    num_steps = steps() - before
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45)
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total_ms = sum(e.self_device_time_total for e in events) / 1e3
    (args.out / f"profile_{name}.txt").write_text(
        f"{name}: {num_steps} steps, {plain_ms:.2f} ms wall per step unprofiled, "
        f"{1e3 * seconds / num_steps:.2f} profiled, {total_ms / num_steps:.2f} ms GPU per step"
        f"\n{split}\n\n{table}\n"
    )
    print(split)
    print(
        f"{name}: {num_steps} steps, {plain_ms:.2f} ms wall/step unprofiled, "
        f"{1e3 * seconds / num_steps:.2f} profiled, {total_ms / num_steps:.2f} ms GPU/step"
    )
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    for e in top:
        per_step = e.self_device_time_total / 1e3 / num_steps
        print(f"  {per_step:7.3f} ms/step {e.count // num_steps:4d}x {e.key[:90]}")
    if args.host:
        host_profile(llm, prompts, params, steps, args.out / f"host_{name}.txt")
    llm.llm_engine.engine_core.shutdown()


def log_steps() -> list[tuple[float, str]]:
    """(time, kind) at each call of a runner's ``execute_model`` in this process; kind:
    ``verify`` (every request has drafts), ``mixed`` (a prefill among them) or ``plain``."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner  # the CPU's too

    from ddtree.bench.report import STEP_KINDS
    from ddtree.vllm_plugin.debug import StepPeriods

    log: list[tuple[float, str]] = []

    def logged(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            if not kwargs.get("dummy_run") and scheduler_output.total_num_scheduled_tokens:
                kind = STEP_KINDS[StepPeriods.kind(scheduler_output)]
                log.append((time.perf_counter(), kind))
            return original(self, scheduler_output, *args, **kwargs)

        return execute_model

    for runner in (GPUModelRunner, V1Runner):
        runner.execute_model = logged(runner.execute_model)
    return log


def step_split(log: list[tuple[float, str]]) -> str:
    """Mean ms from a step's ``execute_model`` call to the next one, by the step's kind (with
    async scheduling: the host's step time, the GPU's where it is the longer)."""
    from ddtree.bench.report import step_periods

    steps = [(t, t_next, kind) for (t, kind), (t_next, _) in zip(log[:-1], log[1:], strict=True)]
    periods = step_periods(steps, float("-inf"), float("inf"))
    return "  step split: " + ", ".join(
        f"{kind} {p['steps']} steps {p['ms']:.2f} ms" for kind, p in sorted(periods.items())
    )


def host_profile(llm, prompts, params, steps, path: Path) -> None:
    """One more generate under cProfile: host seconds per step by function."""
    import cProfile
    import io
    import pstats

    before = steps()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - start
    num_steps = steps() - before
    text = io.StringIO()
    per_step = 1e3 * seconds / num_steps
    text.write(
        f"{path.stem}: {num_steps} steps, {per_step:.2f} ms wall per step under cProfile "
        "(its overhead included: compare engines, not absolutes)\n"
    )
    for order in ("tottime", "cumulative"):
        text.write(f"\n--- by {order} (seconds over {num_steps} steps) ---\n")
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
    # What DDTree adds sits below vLLM's entry points (the drafter's propose, the sampler):
    # every ddtree function, and what the speculator's and sampler's entry points call.
    text.write(f"\n--- ddtree functions, cumulative (seconds over {num_steps} steps) ---\n")
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(r"ddtree/")
    text.write("\n--- callees of the drafter's and the sampler's entry points ---\n")
    stats.print_callees(r"speculator.py.*\(propose\)|sampler.py.*\(__call__\)|_chain_step")
    path.write_text(text.getvalue())
    print(text.getvalue().splitlines()[0])


if __name__ == "__main__":
    main()
