"""``ddtree bench``: no-spec vs vLLM's DFlash chain vs DDTree inside vLLM (offline engines).

Every engine is its own process. They start side by side (model load, compilation and CUDA
graph capture in parallel; an "auto" engine, which times its steps at start-up, once the
others are warm), wait until all are ready, then measure one at a time, taking turns
per point (``Turns``), so no measurement shares the device with another engine's work and the
engines of a point run back to back; ``--repeats`` measures every point that many times
(median and per-repeat ratios in the report). Every engine runs the
same requests: one prompt set (``OUT/prompts.json``, written by the driver: ``--prompts``
held-out prompts, or random ids for dummy shapes) and, per concurrency c, the same request
schedule (``request_schedule``) with c requests in flight (at c=1 one after another). Per
engine and per (c, temperature): output tokens/s, mean acceptance length (tau = 1 + accepted
/ drafts, from vLLM's own spec-decode counters), accepted tokens per depth, the time per
engine step, and with ``--ddtree-profile N`` DDTree's step split.

Writes ``OUT/<engine>.json`` (+ ``.log``), ``OUT/bench.json`` (all rows, with the speed ratios
to the chain and no-spec), ``OUT/bench.md`` (the printed tables) and ``OUT/bench.png``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ddtree.bench.report import (
    add_ratios,
    aggregate,
    mean_profile,
    memory_table,
    parse_acceptance_log,
    parse_memory_log,
    parse_profile_log,
    plot,
    sum_acceptance,
    summary_markdown,
    window_steps,
)
from ddtree.bench.shapes import DUMMY_SHAPES, write_dummy_shapes
from ddtree.budget import mean_accepted, schedule_label
from ddtree.vllm_plugin import plugin_env
from ddtree.vllm_plugin.config import budget_schedule

PROFILE_ENV = "DDTREE_PROFILE"  # read at plugin registration (vllm_plugin/config.py)
ACCEPTANCE_ENV = "DDTREE_ACCEPTANCE"
STEP_LOG_ENV = "DDTREE_STEP_LOG"


def engine_names(
    methods: list[str], budgets: list[int], schedules: list | tuple = (), auto: int | None = None
) -> list[str]:
    """``methods`` with ``ddtree`` as one ``ddtree-<B>`` engine per budget, then one
    ``ddtree-s<i>`` engine per schedule of ``--ddtree-schedules`` (i from 1), then
    ``ddtree-a<B>`` for ``--ddtree-auto B``."""
    names = [m for m in methods if m != "ddtree"]
    if "ddtree" in methods:
        names += [f"ddtree-{b}" for b in budgets]
    names += [f"ddtree-s{i}" for i in range(1, len(schedules) + 1)]
    return names + ([f"ddtree-a{auto}"] if auto else [])


# vLLM's DFlash chain under other engine settings: (V1 runner, cudagraph_mode, async_scheduling);
# None = vLLM's choice. "dflash" is what users get (V2 runner, FULL_AND_PIECEWISE, async on);
# "dflash-v1-sync" is DDTree's own settings; the others split the gap between the two.
CHAIN_SETTINGS = {
    "dflash": (False, None, None),
    "dflash-v1": (True, "PIECEWISE", None),  # async scheduling as vLLM decides: on
    "dflash-v1-sync": (True, "PIECEWISE", False),
    "dflash-v1-full": (True, None, False),  # V1 with vLLM's default graphs (FULL_AND_PIECEWISE)
    "dflash-v1-full-async": (True, None, None),
    "dflash-v2-sync": (False, None, False),
}
MTP_TOKENS = 3  # vLLM's "mtp" method (a Qwen3.5 / 3.6 target's own MTP layer), chained
METHODS = ("ar", "mtp", *CHAIN_SETTINGS, "ddtree")


def engine_kwargs(name: str, args) -> dict:
    """``vllm.LLM`` arguments of one engine: ``ar``, a DFlash chain (``CHAIN_SETTINGS``) or
    ``ddtree-<budget>``."""
    import torch

    cuda = torch.cuda.is_available()
    scheduled = [b for schedule in args.ddtree_schedules for _, _, b in schedule]
    auto = [args.ddtree_auto] if args.ddtree_auto else []
    widest = max(args.concurrency) * (1 + max([15, *args.budgets, *scheduled, *auto]))
    kw = dict(
        model=str(args.target),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.concurrency),
        seed=0,
        disable_log_stats=False,
        max_num_batched_tokens=max(8192, widest),
        skip_tokenizer_init=args.dummy,
        load_format="dummy" if args.dummy else "auto",
    )
    if cuda:
        kw.update(
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), gpu_memory_utilization=0.05
        )
        capture = args.max_cudagraph_capture_size
        if capture is not None:
            kw["compilation_config"] = {"max_cudagraph_capture_size": capture}
            kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], capture)
    else:
        kw.update(enforce_eager=True, gpu_memory_utilization=0.1)
    if is_hybrid_target(args.target):
        kw["language_model_only"] = True  # text prompts: the vision tower is never loaded
        if cuda:  # vLLM's default GDN prefill on sm90 needs flashinfer, not in every install
            kw["additional_config"] = {"gdn_prefill_backend": "triton"}
    if name == "ar":
        return kw
    if name == "mtp":
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": MTP_TOKENS}
        return kw
    if name in CHAIN_SETTINGS:
        spec = {"method": "dflash", "model": str(args.draft), "num_speculative_tokens": 15}
        v1, cudagraph_mode, async_scheduling = CHAIN_SETTINGS[name]
        if v1:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # this engine's own process
        if cuda and cudagraph_mode is not None:
            kw.setdefault("compilation_config", {})["cudagraph_mode"] = cudagraph_mode
        if async_scheduling is not None:
            kw["async_scheduling"] = async_scheduling
    elif name.startswith("ddtree-a"):
        spec = {
            "method": "ddtree",
            "model": str(args.draft),
            **args.ddtree_options,
            "ddtree_budget": int(name[8:]),
            "ddtree_budget_per_batch_size": "auto",
        }
        kw["distributed_executor_backend"] = "uni"  # the tuner shares the scheduler's process
        if not cuda:  # vLLM's CPU build keeps "uni" only with the engine core in-process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # this engine's own process
    elif name.startswith("ddtree-s"):
        schedule = args.ddtree_schedules[int(name[8:]) - 1]
        spec = {
            "method": "ddtree",
            "model": str(args.draft),
            **args.ddtree_options,
            "ddtree_budget": max(b for _, _, b in schedule),
            "ddtree_budget_per_batch_size": schedule,
        }
    elif name.startswith("ddtree-"):
        spec = {
            "method": "ddtree",
            "model": str(args.draft),
            "ddtree_budget": int(name[7:]),
            "ddtree_budget_per_batch_size": "fixed",  # B at every batch size, as named
            **args.ddtree_options,
        }
    else:
        raise ValueError(
            f"unknown engine {name!r}: one of {METHODS[:-1]}, ddtree-<budget>, ddtree-s<i> or "
            "ddtree-a<budget>"
        )
    kw["speculative_config"] = spec
    return kw


def is_hybrid_target(target: Path) -> bool:
    """Whether the checkpoint at ``target`` is a Qwen3.5 / 3.6 layout (Gated DeltaNet +
    attention layers, loaded by vLLM as ``Qwen3_5ForConditionalGeneration``); a folder without
    a config.json is left to vLLM's loader to refuse."""
    path = Path(target) / "config.json"
    if not path.exists():
        return False
    config = json.loads(path.read_text())
    return any(a.startswith("Qwen3_5") for a in config.get("architectures", []))


def target_vocab_size(target: Path) -> int:
    """The target's vocabulary size (its text config's, for a multimodal checkpoint)."""
    config = json.loads((Path(target) / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def dummy_prompts(
    count: int, length: int, seed: int = 0, low: int = 1000, high: int = 100000
) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids in [low, high) (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (length,), generator=gen).tolist() for _ in range(count)]


def bench_prompts(args) -> tuple[list[list[int]], str]:
    """The prompt set every engine runs, and where it comes from: held-out stdlib ``def`` lines
    (as ``ddtree tau``) tokenized by the target's tokenizer, or random ids for dummy shapes
    and with ``--random-prompts`` (ids 2 .. V - 2 of the target's vocabulary: past a word-level
    pair's unknown and EOS tokens, short of its mask token)."""
    if args.dummy:
        return dummy_prompts(args.prompts, args.input_len), "random token ids, seed 0"
    if getattr(args, "random_prompts", False):
        vocab = target_vocab_size(args.target)
        if vocab < 4:
            raise SystemExit(
                f"ddtree bench: --random-prompts needs a vocabulary of >= 4, got {vocab}"
            )
        prompts = dummy_prompts(args.prompts, args.input_len, low=2, high=vocab - 1)
        return prompts, f"random token ids in [2, {vocab - 1}), seed 0"
    from transformers import AutoTokenizer

    from ddtree.bench.tau import held_out_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = held_out_prompts(tokenizer, args.prompts, args.input_len)
    return prompts, "held-out stdlib modules (ddtree.train.data.HELD_OUT_MODULES), def lines"


def prompt_set_digest(prompts: list[list[int]]) -> str:
    """A short fingerprint of a prompt set (token ids, in order)."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def request_schedule(num_prompts: int, concurrency: int) -> list[int]:
    """The prompt index of each request, in submission order, at one concurrency.

    Whole passes over the prompt set (each prompt weighs the same in tau and tokens/s), as
    many as it takes to reach max(num_prompts, 4 x concurrency) requests: at c > 1 the c slots
    refill at least three times, so the measurement is mostly steady state, not one batch that
    fills and drains (and lasts long enough to time: at c=32 on an H200 two passes were under a
    second)."""
    if num_prompts < 1 or concurrency < 1:
        raise ValueError(f"need >= 1 prompt and concurrency >= 1, got {num_prompts}, {concurrency}")
    wanted = max(num_prompts, 4 * concurrency)
    passes = -(-wanted // num_prompts)
    return [i % num_prompts for i in range(passes * num_prompts)]


def run_requests(
    add: Callable[[list[int]], object],
    step: Callable[[], list],
    prompts: list[list[int]],
    concurrency: int,
    on_finish: Callable[[int], None] | None = None,
) -> list:
    """Run ``prompts`` (one request each, in order) keeping ``concurrency`` requests in flight:
    a new one is added as soon as one finishes, before the next engine step. At c=1 each
    request runs alone, one after another. ``add(prompt)`` submits one request, ``step()`` runs
    one engine step and returns outputs (``.finished``). Returns the finished outputs in
    finishing order; ``on_finish(done)`` after each."""
    pending = iter(prompts)
    in_flight = 0
    finished: list = []

    def fill() -> None:
        nonlocal in_flight
        while in_flight < concurrency:
            prompt = next(pending, None)
            if prompt is None:
                return
            add(prompt)
            in_flight += 1

    fill()
    while in_flight:
        for output in step():
            if output.finished:
                in_flight -= 1
                finished.append(output)
                if on_finish is not None:
                    on_finish(len(finished))
        fill()
    return finished


def _spec_counters(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            found[metric.name] = value if value is not None else list(metric.values)
        elif metric.name == "vllm:iteration_tokens_total":  # one observation per engine step
            found["engine_steps"] = metric.count
    return found


def _delta(after: dict, before: dict, name: str):
    a, b = after.get(name), before.get(name)
    if a is None:
        return None
    if isinstance(a, list):
        b = b or [0] * len(a)
        return [x - y for x, y in zip(a, b, strict=True)]
    return a - (b or 0)


class ProgressFile:
    """A measurement's requests done / total in ``OUT/<engine>.progress`` (JSON, replaced
    atomically), which the driver shows as a tqdm line: the workers' own output goes to their
    logs. Written at most every 0.5 s and at the end, since it runs inside the timed loop."""

    def __init__(self, path: Path, label: str, total: int):
        self.path, self.label, self.total = path, label, total
        self.last = 0.0
        self.write(0)

    def write(self, done: int) -> None:
        state = {"label": self.label, "done": done, "total": self.total}
        tmp = self.path.with_suffix(".progress.tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.path)
        self.last = time.perf_counter()

    def update(self, done: int) -> None:
        if done == self.total or time.perf_counter() - self.last > 0.5:
            self.write(done)


# ``--structured-output json``: every request asks for this JSON schema (vLLM's xgrammar
# backend). Two free strings let a code model write for a while before the object closes.
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "body": {"type": "string"}},
    "required": ["name", "body"],
}


def measure(
    llm,
    prompts: list[list[int]],
    schedule: list[int],
    concurrency: int,
    temperature: float,
    max_tokens: int,
    progress: ProgressFile | None = None,
    structured_output: str = "none",
) -> dict:
    """Run the requests ``schedule`` (prompt indices) at ``concurrency``; one row."""
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = structured_output == "json"
    # seed=None: per-request seeds make vLLM sample row by row (and skip FlashInfer's sampler),
    # which would slow the measured step; at T=1 tau therefore varies a little between runs.
    # A grammar ends a request at its EOS (past it the grammar rejects every token): no
    # ignore_eos with structured output, so rows count the tokens each request produced.
    params = vllm.SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        ignore_eos=not structured,
        seed=None,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA) if structured else None,
    )
    engine = llm.llm_engine

    def add(prompt: list[int]) -> None:
        llm.enqueue(TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)

    def step() -> list:
        if not engine.has_unfinished_requests():
            raise RuntimeError("ddtree bench: vLLM has no unfinished request, the bench waits")
        return engine.step()

    on_finish = progress.update if progress is not None else None
    before = _spec_counters(llm)
    wall_start = time.time()  # the window whose steps DDTREE_STEP_LOG's lines are read for
    start = time.perf_counter()
    outs = run_requests(add, step, [prompts[i] for i in schedule], concurrency, on_finish)
    seconds = time.perf_counter() - start
    wall_end = time.time()
    after = _spec_counters(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {
        "concurrency": concurrency,
        "temperature": temperature,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "requests": len(schedule),
        "prompts": len(set(schedule)),
        "max_tokens": max_tokens,
        "window": [wall_start, wall_end],
    }
    if structured:
        row["structured_output"] = structured_output
    steps = _delta(after, before, "engine_steps")
    if steps:  # exact, whatever the number of requests running in each step
        row["engine_steps"] = steps
        row["ms_per_engine_step"] = round(1000 * seconds / steps, 3)
    drafts = _delta(after, before, "vllm:spec_decode_num_drafts")
    if drafts:
        accepted = _delta(after, before, "vllm:spec_decode_num_accepted_tokens")
        row["tau"] = round(1 + accepted / drafts, 4)
        row["draft_steps"] = drafts
        row["ms_per_step"] = round(1000 * seconds * concurrency / drafts, 3)
        per_pos = _delta(after, before, "vllm:spec_decode_num_accepted_tokens_per_pos")
        if per_pos:
            row["accepted_per_depth"] = [round(x / drafts, 4) for x in per_pos[:16]]
    else:
        row["tau"] = 1.0
        row["ms_per_step"] = round(1000 * seconds * concurrency / tokens, 3)
    return row


def _own_log(out: Path, name: str) -> Path | None:
    """``OUT/<engine>.log`` if this worker's stdout is that file (the driver started it)."""
    path = out / f"{name}.log"
    try:
        return path if os.path.samestat(os.fstat(sys.stdout.fileno()), path.stat()) else None
    except (OSError, ValueError):  # no such log, or stdout is not a file
        return None


def _read_lines(path: Path, start: int, end: int) -> str:
    """The complete lines of ``path`` between byte offsets ``start`` and ``end``."""
    with path.open("rb") as log:
        log.seek(start)
        text = log.read(end - start).decode(errors="replace")
    return text[: text.rfind("\n") + 1]


def run_engine(name: str, args, log: Path | None = None) -> None:
    """One engine: start, warm up, wait for the others, measure under the lock. ``log``: the
    engine's log, where ``DDTREE_PROFILE``'s reports are read from (None: not read)."""
    import vllm

    out = args.out
    prompt_file = out / "prompts.json"
    if not prompt_file.exists():
        raise SystemExit(f"ddtree bench --engine {name}: no {prompt_file} (the driver writes it)")
    prompt_set = json.loads(prompt_file.read_text())
    prompts = prompt_set["prompts"]
    t0 = time.time()
    kwargs = engine_kwargs(name, args)
    llm = vllm.LLM(**kwargs)
    started = round(time.time() - t0, 1)
    for temperature in args.temperatures:  # warm-up: first uses compile (Triton) / allocate
        for concurrency in args.concurrency:
            schedule = request_schedule(len(prompts), concurrency)[:concurrency]
            measure(
                llm, prompts, schedule, concurrency, temperature, 8,
                structured_output=args.structured_output,
            )  # fmt: skip
    (out / f"{name}.ready").touch()
    while not all(
        (out / f"{n}.ready").exists() or (out / f"{n}.failed").exists() for n in args.engines
    ):
        time.sleep(1)
    rows, reports = [], []
    turns = Turns(out, args.engines)
    repeats = args.repeats
    for point, (repeat, temperature, concurrency) in enumerate(measurement_points(args)):
        turns.wait(point, name)
        try:
            schedule = request_schedule(len(prompts), concurrency)
            label = f"c={concurrency} T={temperature:g}"
            if repeats > 1:
                label += f" #{repeat + 1}/{repeats}"
            progress = ProgressFile(out / f"{name}.progress", label, len(schedule))
            sys.stdout.flush()
            log_start = log.stat().st_size if log else 0
            row = measure(
                llm, prompts, schedule, concurrency, temperature, args.max_tokens, progress,
                structured_output=args.structured_output,
            )  # fmt: skip
        finally:
            turns.done()
        if repeats > 1:
            row["repeat"] = repeat
        if log is not None:
            # DDTREE_PROFILE's reports logged during this measurement (the first may include
            # up to N-1 steps of the one before: the profile's own window).
            text = _read_lines(log, log_start, log.stat().st_size)
            try:
                found = parse_profile_log(text)
            except ValueError as err:
                row["profile_error"] = str(err)
            else:
                reports += found
                if found:
                    row["profile"] = mean_profile(found)
            try:  # DDTREE_ACCEPTANCE's reports, likewise
                curves = parse_acceptance_log(text)
            except ValueError as err:
                row["acceptance_error"] = str(err)
            else:
                if curves:
                    row["acceptance"] = sum_acceptance(curves)
                    row["accepted_by_budget"] = mean_accepted([row["acceptance"]])
        rows.append({"engine": name, **row})
        print(json.dumps(rows[-1]), flush=True)
    text = log.read_text(errors="replace") if log is not None else ""
    if args.step_log:  # the steps each measurement's window holds (lines come in late)
        window_steps(text, rows)
    for row in rows:
        row.pop("window", None)
    config = llm.llm_engine.vllm_config
    memory = parse_memory_log(text)  # None without a log
    result = {
        "engine": name,
        "engine_start_s": started,
        "memory": memory,
        "kv_cache_gib": args.kv_cache_gib if "kv_cache_memory_bytes" in kwargs else None,
        "v2_model_runner": getattr(config, "use_v2_model_runner", None),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "max_cudagraph_capture_size": config.compilation_config.max_cudagraph_capture_size,
        "prompts_sha256": prompt_set["sha256"],
        "profile": mean_profile(reports),
        "rows": rows,
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    llm.llm_engine.engine_core.shutdown()


def measurement_points(args) -> list[tuple[int, float, int]]:
    """(repeat, temperature, concurrency) in measurement order: every point once per repeat."""
    return [
        (repeat, temperature, concurrency)
        for repeat in range(args.repeats)
        for temperature in args.temperatures
        for concurrency in args.concurrency
    ]


class Turns:
    """Engines measure one at a time, in turns: point k's slots go to the engines in their
    order rotated by k (no engine always first), each slot after the one before has ended.
    The turn is a counter in ``OUT/turn`` (absent: 0), moved under a file lock; a slot whose
    engine failed (``OUT/<engine>.failed``) is skipped by whoever waits next."""

    def __init__(self, out: Path, engines: list[str]):
        self.path, self.lock, self.engines = out / "turn", out / ".device.lock", engines

    def slot(self, point: int, engine: str) -> int:
        count = len(self.engines)
        return point * count + (self.engines.index(engine) - point) % count

    def owner(self, slot: int) -> str:
        point, offset = divmod(slot, len(self.engines))
        return self.engines[(offset + point) % len(self.engines)]

    def _read(self) -> int:
        try:
            return int(self.path.read_text() or 0)
        except FileNotFoundError:
            return 0

    def _advance(self, expected: int | None = None) -> None:
        with open(self.lock, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            turn = self._read()
            if expected is None or turn == expected:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(str(turn + 1))
                tmp.replace(self.path)
            fcntl.flock(lock, fcntl.LOCK_UN)

    def wait(self, point: int, engine: str) -> None:
        mine = self.slot(point, engine)
        while (turn := self._read()) != mine:
            if turn > mine:
                raise RuntimeError(f"ddtree bench: {engine} missed its turn {mine} (now {turn})")
            if (self.path.parent / f"{self.owner(turn)}.failed").exists():
                self._advance(expected=turn)
            else:
                time.sleep(0.005)

    def done(self) -> None:
        self._advance()


def engine_env(
    name: str,
    base: dict[str, str],
    profile_every: int | None,
    acceptance_every: int | None = None,
    step_log_every: int | None = None,
) -> dict[str, str]:
    """One engine process's environment: with ``--ddtree-profile N``, ``DDTREE_PROFILE=N`` for
    the DDTree engines and unset for the others (its synchronizing timer is DDTree's only);
    ``--ddtree-acceptance N`` likewise sets ``DDTREE_ACCEPTANCE``; ``--step-log N`` sets
    ``DDTREE_STEP_LOG=N`` for every engine (no sync: the chain is timed the same way)."""
    env = dict(base)
    for variable, every in ((PROFILE_ENV, profile_every), (ACCEPTANCE_ENV, acceptance_every)):
        if every is not None:
            if name.startswith("ddtree-"):
                env[variable] = str(every)
            else:
                env.pop(variable, None)
    if step_log_every is not None:
        env[STEP_LOG_ENV] = str(step_log_every)
    return env


class MeasurementBars:
    """One tqdm line per engine measurement (requests done / total), read from the workers'
    ``OUT/<engine>.progress`` files: the driver owns the terminal, the workers log to files."""

    def __init__(self, out: Path, engines: list[str]):
        self.out, self.engines = out, engines
        self.open: dict[str, tuple[str, object]] = {}  # engine -> (label, its tqdm bar)
        self.closed: set[tuple[str, str]] = set()  # (engine, label)

    def _close(self, name: str, done: int | None = None) -> None:
        label, bar = self.open.pop(name)
        bar.n = bar.total if done is None else done
        bar.close()
        self.closed.add((name, label))

    def poll(self) -> None:
        from tqdm import tqdm

        states = {}
        for name in self.engines:
            try:  # replaced atomically, so never half written; absent until it measures
                states[name] = json.loads((self.out / f"{name}.progress").read_text())
            except FileNotFoundError:
                continue
        # First close what has ended, so at most one bar is open at a time: an engine's
        # measurements run one after another, so a new label means the previous one is done.
        for name, state in states.items():
            if name in self.open and self.open[name][0] != state["label"]:
                self._close(name)
        ended_first = sorted(states.items(), key=lambda item: item[1]["done"] < item[1]["total"])
        for name, state in ended_first:
            if (name, state["label"]) in self.closed:
                continue
            if name not in self.open:
                bar = tqdm(total=state["total"], desc=f"{name} {state['label']}", unit="req")
                self.open[name] = (state["label"], bar)
            bar = self.open[name][1]
            if state["done"] >= state["total"]:
                self._close(name, state["done"])
            else:
                bar.n = state["done"]
                bar.refresh()

    def close(self) -> None:
        for name in list(self.open):
            self._close(name, self.open[name][1].n)


def drive(args) -> list[dict]:
    from tqdm import tqdm

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    stale = [
        out / f"{name}{suffix}"
        for name in args.engines
        for suffix in (".ready", ".failed", ".progress", ".json")
    ] + [out / "turn"]
    for path in stale:  # an old run's files would pass for this run's
        path.unlink(missing_ok=True)
    prompts, source = bench_prompts(args)
    prompt_set = {
        "source": source,
        "count": len(prompts),
        "input_len": args.input_len,
        "sha256": prompt_set_digest(prompts),
        "prompts": prompts,
    }
    (out / "prompts.json").write_text(json.dumps(prompt_set) + "\n")
    tqdm.write(
        f"{len(prompts)} prompts ({source}); requests per engine: "
        + ", ".join(f"c={c}: {len(request_schedule(len(prompts), c))}" for c in args.concurrency)
    )
    procs, base_env = {}, plugin_env()

    def launch(name: str) -> None:
        log = (out / f"{name}.log").open("w")
        cmd = [sys.executable, "-m", "ddtree.cli", "bench", *args.argv, "--engine", name]
        env = engine_env(name, base_env, args.ddtree_profile, args.ddtree_acceptance, args.step_log)
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    # An "auto" engine times its steps at start-up: it starts once the others are warm, not
    # while they capture their graphs (that contention once cut its c=1 budget to 31).
    later = [name for name in args.engines if name.startswith("ddtree-a")]
    for name in args.engines:
        if name not in later:
            launch(name)
            time.sleep(2)
    if later and len(later) < len(args.engines):
        tqdm.write(f"{', '.join(later)}: starts once the other engines are warm (it times steps)")
    pending, ready = dict(procs), set()
    bars = MeasurementBars(out, args.engines)
    t0 = time.time()
    while pending or later:
        for name in args.engines:
            if name not in ready and (out / f"{name}.ready").exists():
                ready.add(name)
                tqdm.write(f"{name}: started and warmed up ({time.time() - t0:.0f} s)")
        if later and all(n in ready or n not in pending for n in procs):
            for name in later:
                launch(name)
                pending[name] = procs[name]
            later = []
        bars.poll()
        for name, proc in list(pending.items()):
            if proc.poll() is not None:
                if proc.returncode != 0:
                    (out / f"{name}.failed").touch()
                    tqdm.write(f"{name}: exit {proc.returncode}, see {out / name}.log")
                del pending[name]
        time.sleep(0.5)
    bars.poll()
    bars.close()
    runs, engines = [], {}
    for name in args.engines:
        path = out / f"{name}.json"
        if path.exists():
            engines[name] = json.loads(path.read_text())
            runs += engines[name]["rows"]
    rows = add_ratios(aggregate(runs))
    summary = {
        "command": " ".join(["ddtree", "bench", *args.argv]),
        "exit_codes": {n: p.returncode for n, p in procs.items()},
        "prompts": {k: v for k, v in prompt_set.items() if k != "prompts"},
        "requests": {str(c): len(request_schedule(len(prompts), c)) for c in args.concurrency},
        "repeats": args.repeats,
        "schedules": {
            f"ddtree-s{i}": schedule for i, schedule in enumerate(args.ddtree_schedules, 1)
        },
        "ddtree_profile": args.ddtree_profile,
        "ddtree_acceptance": args.ddtree_acceptance,
        "step_log": args.step_log,
        "engines": {n: {k: v for k, v in e.items() if k != "rows"} for n, e in engines.items()},
        "rows": rows,
        "runs": runs if args.repeats > 1 else None,
    }
    (out / "bench.json").write_text(json.dumps(summary, indent=1) + "\n")
    failed = [n for n, p in procs.items() if p.returncode != 0]
    if rows or failed:
        table = summary_markdown(rows, args.engines) if rows else ""
        table += "".join(
            f"\nddtree-s{i}: budget per batch size {schedule_label(schedule)}\n"
            for i, schedule in enumerate(args.ddtree_schedules, 1)
        )
        memory = memory_table(engines)
        if memory:
            table += "\n" + memory + "\n"
        table += "".join(  # a failed engine has no row: say so beside the table
            f"\n**{n}: failed** (exit {procs[n].returncode}), no measurements: see {n}.log\n"
            for n in failed
        )
        (out / "bench.md").write_text(table)
        print("\n" + table, flush=True)
    if rows:
        plot(rows, out / "bench.png", args.title or Path(args.target).name)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, default=None, help="default: models/target")
    parser.add_argument("--draft", type=Path, default=None, help="default: models/drafter")
    parser.add_argument(
        "--dummy-shapes",
        choices=sorted(DUMMY_SHAPES),
        default=None,
        help="random weights of these shapes (target + drafter); qwen3.6-27b: the hybrid "
        "Qwen3.6-27B with its MTP layer (method mtp) and a drafter of z-lab's outline",
    )
    parser.add_argument(
        "--methods", default="ar,dflash,ddtree", help=f"comma-separated: {', '.join(METHODS)}"
    )
    parser.add_argument("--budgets", default="16,32,64,128,255,511,1023")
    parser.add_argument(
        "--concurrency",
        default="1,4,16,32",
        help="requests in flight; each level runs whole passes over the prompts, "
        "at least max(prompts, 2c) requests",
    )
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument(
        "--prompts",
        type=int,
        default=16,
        help="distinct prompts: held-out stdlib def lines (as `ddtree tau`), "
        "random ids with --dummy-shapes",
    )
    parser.add_argument(
        "--random-prompts",
        action="store_true",
        help="random token ids of the target's vocabulary instead of held-out text (word-level "
        "test pairs, e.g. the tiny hybrid pair of `h200.sh hybrid`)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--structured-output",
        choices=("none", "json"),
        default="none",
        help="json: every request asks for a JSON schema (bench.vllm.JSON_SCHEMA; requests end "
        "at their EOS, so up to --max-tokens each)",
    )
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="per engine (GPU)")
    parser.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="every engine's compilation_config.max_cudagraph_capture_size (GPU; vLLM's "
        "default: min(2 x max_num_seqs x (1 + K), 512) tokens, so wide trees at high "
        "concurrency run without full graphs)",
    )
    parser.add_argument(
        "--ddtree-options",
        type=json.loads,
        default={},
        help="more ddtree keys as JSON, e.g. '{\"ddtree_chain_seed\": false}'",
    )
    parser.add_argument(
        "--ddtree-profile",
        type=int,
        default=None,
        metavar="N",
        help="DDTREE_PROFILE=N for the DDTree engines only: their step "
        "split (mean ms per stage) in the rows and the summary",
    )
    parser.add_argument(
        "--ddtree-acceptance",
        type=int,
        default=None,
        metavar="N",
        help="DDTREE_ACCEPTANCE=N for the DDTree engines: what every smaller budget would "
        "have accepted on their walks (a host read every N steps); with several --budgets the "
        "report adds a budget plan (best budget per c) and a suggested schedule",
    )
    parser.add_argument(
        "--step-log",
        type=int,
        default=None,
        metavar="N",
        help="DDTREE_STEP_LOG=N for every engine: each row gets its steps' mean period by "
        "kind (every request verifying drafts, some: a prefill among them, none), host clock, "
        "no sync; a table in the summary",
    )
    parser.add_argument(
        "--ddtree-schedules",
        type=json.loads,
        default=[],
        metavar="JSON",
        help="more DDTree engines, one per budget-per-batch-size schedule: a JSON list of "
        "schedules, e.g. '[[[1, 4, 255], [5, 512, 15]]]' (engine ddtree-s1, budget = its "
        "largest B)",
    )
    parser.add_argument(
        "--ddtree-auto",
        type=int,
        default=None,
        metavar="B",
        help='one more DDTree engine (ddtree-a<B>): budget B, ddtree_budget_per_batch_size "auto" '
        "(the budget per batch size chosen by throughput while serving)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measure every (c, T) point this many times, the engines in turn (median and "
        "per-repeat ratios in the report)",
    )
    parser.add_argument("--title", default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # one worker


def _numbers(flag: str, text: str, kind: type, minimum: float) -> list:
    """A comma-separated flag value as numbers >= ``minimum``; SystemExit naming the flag."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(
            f"ddtree bench: {flag} {text!r}: not comma-separated {kind.__name__}s"
        ) from None
    if not values:
        raise SystemExit(f"ddtree bench: {flag} is empty")
    if any(v < minimum for v in values):
        raise SystemExit(f"ddtree bench: {flag} {text!r}: each must be >= {minimum}")
    return values


def _check_args(args: argparse.Namespace) -> list[str]:
    """Parse and check the flags (SystemExit naming the flag); returns the methods."""
    args.budgets = _numbers("--budgets", args.budgets, int, 1)
    args.concurrency = _numbers("--concurrency", args.concurrency, int, 1)
    args.temperatures = _numbers("--temperatures", args.temperatures, float, 0.0)
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        if method not in METHODS:
            raise SystemExit(
                f"ddtree bench: unknown method {method!r} in --methods (one of {METHODS})"
            )
    for flag, value in (
        ("--prompts", args.prompts),
        ("--max-tokens", args.max_tokens),
        ("--input-len", args.input_len),
        ("--repeats", args.repeats),
        ("--ddtree-profile", args.ddtree_profile),  # these three: None when not given
        ("--ddtree-acceptance", args.ddtree_acceptance),
        ("--step-log", args.step_log),
        ("--max-cudagraph-capture-size", args.max_cudagraph_capture_size),
    ):
        if value is not None and value < 1:
            raise SystemExit(f"ddtree bench: {flag} must be >= 1, got {value}")
    if args.max_cudagraph_capture_size is not None:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(
                "ddtree bench: --max-cudagraph-capture-size needs a CUDA GPU (the CPU build "
                "runs its engines eagerly, without graphs)"
            )
    if args.ddtree_profile is not None and "ddtree" not in methods:
        raise SystemExit("ddtree bench: --ddtree-profile needs ddtree in --methods")
    if not isinstance(args.ddtree_options, dict):
        raise SystemExit("ddtree bench: --ddtree-options must be a JSON object")
    if "ddtree_budget_per_batch_size" in args.ddtree_options and args.ddtree_auto:
        raise SystemExit(
            "ddtree bench: --ddtree-auto and ddtree_budget_per_batch_size in --ddtree-options "
            "both set schedules: use one"
        )
    if args.ddtree_auto is not None and not 1 <= args.ddtree_auto <= 1024:
        raise SystemExit("ddtree bench: --ddtree-auto must be a budget in [1, 1024]")
    if "ddtree_budget_per_batch_size" in args.ddtree_options and args.ddtree_schedules:
        raise SystemExit(
            "ddtree bench: --ddtree-schedules and ddtree_budget_per_batch_size in "
            "--ddtree-options both set schedules: use one"
        )
    if not isinstance(args.ddtree_schedules, list):
        raise SystemExit("ddtree bench: --ddtree-schedules must be a JSON list of schedules")
    for schedule in args.ddtree_schedules:
        try:
            budget_schedule(schedule, max(b for _, _, b in schedule))
        except (TypeError, ValueError) as err:
            raise SystemExit(f"ddtree bench: --ddtree-schedules {schedule!r}: {err}") from None
    return methods


def run(args: argparse.Namespace, argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    methods = _check_args(args)
    args.dummy = args.dummy_shapes is not None
    if args.dummy:
        args.target, args.draft = write_dummy_shapes(args.out / "models", args.dummy_shapes)
    else:
        args.target = args.target or root / "models" / "target"
        args.draft = args.draft or root / "models" / "drafter"
    args.engines = engine_names(methods, args.budgets, args.ddtree_schedules, args.ddtree_auto)
    args.argv = list(argv)
    if args.engine is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        try:
            run_engine(args.engine, args, _own_log(args.out, args.engine))
        except BaseException:
            (args.out / f"{args.engine}.failed").touch()
            raise
        return 0
    rows = drive(args)
    return 0 if rows and len({r["engine"] for r in rows}) == len(args.engines) else 1
