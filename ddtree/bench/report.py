"""``ddtree bench``'s pure reporting: repeats, speed ratios, markdown tables, profile-log
parsing, plot.

Nothing here starts vLLM; the rows are ``ddtree bench``'s (one per engine, concurrency c and
temperature T: ``engine``, ``concurrency``, ``temperature``, ``tokens_per_s``, ``tau``, ...;
one per repeat before :func:`aggregate`).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

CHAIN = "dflash"  # vLLM's default DFlash chain engine: the reference of every speed ratio
NO_SPEC = "ar"
# The log lines vllm_plugin/debug.py writes (StepProfile, AcceptanceLog) and this module reads.
PROFILE_MARKER = "ddtree-profile "
ACCEPTANCE_MARKER = "ddtree-acceptance "
STEPS_MARKER = "ddtree-steps "


def _point(row: dict) -> tuple[int, float]:
    return row["concurrency"], row["temperature"]


_SUMMED = ("tokens", "seconds", "engine_steps")  # over the repeats ("requests": per repeat)
_MEDIAN = ("ms_per_engine_step", "ms_per_step")


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (engine, c, T) from its repeats (``repeat`` 0, 1, ...): the median tokens/s
    (the repeats' own in ``tokens_per_s_runs``, in repeat order), tau and the acceptance per
    depth pooled over all the repeats' drafts, the median ms per step, summed counts.
    Rows without repeats pass through as they are."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["engine"], *_point(run)), []).append(run)
    rows = []
    for group in groups.values():
        if len(group) == 1 and "repeat" not in group[0]:
            rows.append(dict(group[0]))
            continue
        group = sorted(group, key=lambda r: r.get("repeat", 0))
        row = {k: v for k, v in group[0].items() if k != "repeat"}
        row["repeats"] = len(group)
        row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in group]
        row["tokens_per_s"] = round(statistics.median(row["tokens_per_s_runs"]), 1)
        for key in _SUMMED:
            if all(key in r for r in group):
                row[key] = round(sum(r[key] for r in group), 4)
        for key in _MEDIAN:
            if all(key in r for r in group):
                row[key] = round(statistics.median(r[key] for r in group), 3)
        if all(r.get("draft_steps") for r in group):
            drafts = sum(r["draft_steps"] for r in group)
            row["draft_steps"] = drafts
            row["tau"] = round(
                1 + sum((r["tau"] - 1) * r["draft_steps"] for r in group) / drafts, 4
            )
            if all("accepted_per_depth" in r for r in group):
                depth = min(len(r["accepted_per_depth"]) for r in group)
                row["accepted_per_depth"] = [
                    round(
                        sum(r["accepted_per_depth"][d] * r["draft_steps"] for r in group) / drafts,
                        4,
                    )
                    for d in range(depth)
                ]
        profiles = [r["profile"] for r in group if r.get("profile")]
        if profiles:
            row["profile"] = mean_profile(profiles)
        periods = [r["step_periods"] for r in group if r.get("step_periods")]
        if periods:
            row["step_periods"] = pool_step_periods(periods)
        stalls = [stall for r in group for stall in r.get("stalls", [])]
        if stalls:
            row["stalls"] = stalls
        curves = [r["acceptance"] for r in group if r.get("acceptance")]
        if curves:
            from ddtree.budget import mean_accepted

            row["acceptance"] = sum_acceptance(curves)
            row["accepted_by_budget"] = mean_accepted([row["acceptance"]])
        rows.append(row)
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add ``tokens_per_s_vs_dflash`` (every engine's tokens/s over the chain's at the same
    (c, T)) and ``tokens_per_s_vs_ar`` (over no-spec's; not on no-spec's own rows), where that
    engine has a row at that point; with repeats also ``..._runs``: the ratio of each repeat to
    the reference's same repeat (measured back to back). Returns new row dicts; the input is
    left as it is."""
    by_point = {(r["engine"], *_point(r)): r for r in rows}
    out = []
    for row in rows:
        row = dict(row)
        for reference, key in ((CHAIN, "tokens_per_s_vs_dflash"), (NO_SPEC, "tokens_per_s_vs_ar")):
            base = by_point.get((reference, *_point(row)))
            if (
                not base
                or not base["tokens_per_s"]
                or (reference == NO_SPEC and row["engine"] == NO_SPEC)
            ):
                continue
            row[key] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
            mine, theirs = row.get("tokens_per_s_runs"), base.get("tokens_per_s_runs")
            if mine and theirs and len(mine) == len(theirs):
                row[key + "_runs"] = [round(a / b, 3) for a, b in zip(mine, theirs, strict=True)]
        out.append(row)
    return out


def reference_key(rows: list[dict]) -> str | None:
    """The ratio the table shows: against the chain when it ran, else against no-spec."""
    engines = {r["engine"] for r in rows}
    if CHAIN in engines:
        return "tokens_per_s_vs_dflash"
    if NO_SPEC in engines:
        return "tokens_per_s_vs_ar"
    return None


def speed_cell(row: dict, ratio_key: str | None) -> str:
    """``tok/s (tau) xRATIO``, e.g. ``1840 (8.73) x1.00``; with repeats the range of the
    per-repeat ratios too, e.g. ``1840 (8.73) x1.04 [0.98-1.10]`` (the reference's own row
    shows none)."""
    cell = f"{row['tokens_per_s']:.0f} ({row['tau']:.2f})"
    if ratio_key is not None and ratio_key in row:
        cell += f" x{row[ratio_key]:.2f}"
        runs = row.get(ratio_key + "_runs")
        if runs and len(runs) > 1 and (min(runs), max(runs)) != (1.0, 1.0):
            cell += f" [{min(runs):.2f}-{max(runs):.2f}]"
    return cell


def step_cell(row: dict) -> str:
    """ms per engine step, or ``-`` where vLLM reported no step counter."""
    ms = row.get("ms_per_engine_step")
    return "-" if ms is None else f"{ms:.2f}"


def markdown_table(rows: list[dict], cell: Callable[[dict], str], engines: list[str]) -> str:
    """Rows = ``engines`` (in that order, those with rows), columns = (c, T) points."""
    points = sorted({_point(r) for r in rows})
    by_key = {(r["engine"], *_point(r)): r for r in rows}
    lines = [
        "| engine | " + " | ".join(f"c={c} T={t:g}" for c, t in points) + " |",
        "|---|" + "---:|" * len(points),
    ]
    for engine in engines:
        if not any((engine, *p) in by_key for p in points):
            continue
        cells = [cell(by_key[(engine, *p)]) if (engine, *p) in by_key else "-" for p in points]
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _marked_reports(
    text: str, marker: str, valid: Callable[[dict], bool], needs: str
) -> list[dict]:
    """The JSON reports after ``marker`` in a log, one per line: the JSON follows the marker to
    the end of the line (vLLM prefixes the line with the process name and the log level).
    ValueError for a line that does not parse or that ``valid`` refuses (naming ``needs``)."""
    name = marker.strip()
    reports = []
    for line in text.splitlines():
        at = line.find(marker)
        if at < 0:
            continue
        try:
            report = json.loads(line[at + len(marker) :].strip())
        except json.JSONDecodeError as err:
            raise ValueError(f"unreadable {name} line: {line!r}") from err
        if not valid(report):
            raise ValueError(f"{name} line without {needs}: {line!r}")
        reports.append(report)
    return reports


def parse_profile_log(text: str) -> list[dict]:
    """The ``ddtree-profile {...}`` reports in a log: ``[{"steps": n, "ms_per_step": {...}}]``."""
    return _marked_reports(
        text,
        PROFILE_MARKER,
        lambda r: isinstance(r.get("ms_per_step"), dict) and bool(r.get("steps")),
        "steps / ms_per_step",
    )


def parse_acceptance_log(text: str) -> list[dict]:
    """The ``ddtree-acceptance {...}`` reports in a log (``DDTREE_ACCEPTANCE``):
    ``[{"steps", "budget", "rows": [B], "accepted": [B]}]``."""
    return _marked_reports(
        text,
        ACCEPTANCE_MARKER,
        lambda r: isinstance(r.get("rows"), list) and isinstance(r.get("accepted"), list),
        "rows / accepted",
    )


# vLLM's start-up lines (v1/core/kv_cache_utils.py) and DDTree's hybrid stash line
# (vllm_plugin/v2/gdn.py): what a request costs in memory.
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_STASH = re.compile(r"tree stashes of ([\d.]+) MiB \((\d+) requests")


def parse_memory_log(text: str) -> dict | None:
    """An engine's KV cache from its start-up log: ``{"kv_cache_tokens", "max_model_len",
    "max_concurrency"}`` and, for a DDTree engine of a hybrid target, ``"stash_mib"`` (the
    tree stashes, outside the KV cache, for ``"stash_requests"`` request rows). None when the
    log has no KV cache line."""
    tokens, concurrency = _KV_TOKENS.search(text), _CONCURRENCY.search(text)
    if tokens is None or concurrency is None:
        return None
    found = {
        "kv_cache_tokens": int(tokens.group(1).replace(",", "")),
        "max_model_len": int(concurrency.group(1).replace(",", "")),
        "max_concurrency": float(concurrency.group(2)),
    }
    stash = _STASH.search(text)
    if stash is not None:
        found["stash_mib"] = float(stash.group(1))
        found["stash_requests"] = int(stash.group(2))
    return found


def memory_table(engines: dict[str, dict]) -> str | None:
    """One line per engine with a ``memory`` record: KV cache tokens, requests it holds at
    max_model_len, and (with ``kv_cache_gib``, the pool size the bench set) GiB per request;
    a hybrid DDTree engine's stashes (outside the pool) per request row beside it."""
    lines = []
    for name, engine in engines.items():
        memory = engine.get("memory")
        if not memory:
            continue
        pool = engine.get("kv_cache_gib")
        per_request = f"{pool / memory['max_concurrency']:.3f}" if pool else "-"
        stash = "-"
        if memory.get("stash_mib") is not None:
            stash = f"{memory['stash_mib'] / memory['stash_requests']:.1f}"
        lines.append(
            f"| {name} | {memory['kv_cache_tokens']:,} | {memory['max_concurrency']:.2f} | "
            f"{per_request} | {stash} |"
        )
    if not lines:
        return None
    max_len = next(e["memory"]["max_model_len"] for e in engines.values() if e.get("memory"))
    head = [
        f"KV cache (vLLM's start-up report; requests of {max_len:,} tokens):",
        "",
        "| engine | KV cache tokens | requests it holds | GiB per request | "
        "tree stash MiB per request |",
        "|---|---:|---:|---:|---:|",
    ]
    return "\n".join(head + lines)


STEP_KINDS = {"v": "verify", "m": "mixed", "p": "plain"}  # vllm_plugin/debug.StepPeriods


def _step_reports(text: str) -> list[dict]:
    return _marked_reports(
        text,
        STEPS_MARKER,
        lambda r: (
            isinstance(r.get("t"), list)
            and isinstance(r.get("k"), str)
            and len(r["t"]) == len(r["k"]) + 1
            and set(r["k"]) <= set(STEP_KINDS)
            and (r.get("gap") is None or (len(r["gap"]) == 4 and r["gap"][2] in STEP_KINDS))
        ),
        "t / k (one more time than kinds), gap [start, seconds, kind, drafts]",
    )


def parse_steps_log(text: str) -> list[tuple[float, float, str]]:
    """The steps of the ``ddtree-steps {...}`` reports in a log (``DDTREE_STEP_LOG``): one
    ``(start, end, kind)`` per step, wall-clock seconds, kind ``verify|mixed|plain``."""
    return [
        (start, end, STEP_KINDS[kind])
        for r in _step_reports(text)
        for start, end, kind in zip(r["t"][:-1], r["t"][1:], r["k"], strict=True)
    ]


def parse_step_gaps(text: str) -> list[tuple[float, float, str, int]]:
    """The steps the step log left out of its periods, each followed by more than
    ``StepPeriods.IDLE_S`` without a step (idle, or a stall): ``(start, seconds, kind,
    drafts)``, drafts: the most one request of that step verified."""
    gaps = [r["gap"] for r in _step_reports(text) if r.get("gap")]
    return [(start, seconds, STEP_KINDS[kind], drafts) for start, seconds, kind, drafts in gaps]


def window_steps(text: str, rows: list[dict]) -> None:
    """Each row's ``step_periods`` from its ``window`` (popped) and, where a step took over
    ``IDLE_S`` and ended inside the window (the engine was busy: a stall), ``stalls``: ``[[seconds,
    kind, drafts], ...]``. A log that does not parse: ``step_log_error`` on every row."""
    try:
        steps, gaps = parse_steps_log(text), parse_step_gaps(text)
    except ValueError as err:
        for row in rows:
            row.pop("window", None)
            row["step_log_error"] = str(err)
        return
    for row in rows:
        window = row.pop("window", None)
        if not (steps and window):
            continue
        row["step_periods"] = step_periods(steps, *window)
        start, end = window
        # a gap that outlasts the window followed its last step: the engine went idle
        stalls = [
            [round(sec, 2), kind, k] for t, sec, kind, k in gaps if start <= t and t + sec <= end
        ]
        if stalls:
            row["stalls"] = stalls


def _mean_periods(cells: Iterable[tuple[str, int, float]]) -> dict:
    """``(kind, steps, total ms)`` cells summed per kind: ``{kind: {"steps", "ms": mean}}``."""
    totals: dict[str, list[float]] = {}
    for kind, steps, ms in cells:
        total = totals.setdefault(kind, [0, 0.0])
        total[0] += steps
        total[1] += ms
    return {k: {"steps": int(n), "ms": round(ms / n, 3)} for k, (n, ms) in totals.items() if n}


def step_periods(steps: list[tuple[float, float, str]], start: float, end: float) -> dict:
    """``{kind: {"steps": n, "ms": mean}}`` of the ``steps`` that ran inside [start, end]."""
    return _mean_periods(
        (kind, 1, 1000 * (last - first))
        for first, last, kind in steps
        if start <= first and last <= end
    )


def pool_step_periods(periods: list[dict]) -> dict:
    """``step_periods`` of several repeats pooled: steps summed, ms weighted by steps."""
    return _mean_periods(
        (kind, cell["steps"], cell["steps"] * cell["ms"])
        for period in periods
        for kind, cell in period.items()
    )


def step_period_table(rows: list[dict]) -> str | None:
    """Rows with ``step_periods``: one line per (engine, c, T), mean ms per step and steps of
    each kind."""
    logged = [r for r in rows if r.get("step_periods")]
    if not logged:
        return None
    kinds = ("verify", "mixed", "plain")
    lines = [
        "| engine | c | T | " + " | ".join(f"{k} ms (steps)" for k in kinds) + " |",
        "|---|---:|---:|" + "---:|" * len(kinds),
    ]
    for row in logged:
        periods = row["step_periods"]
        cells = [
            f"{periods[k]['ms']:.2f} ({periods[k]['steps']})" if k in periods else "-"
            for k in kinds
        ]
        lines.append(
            f"| {row['engine']} | {row['concurrency']} | {row['temperature']:g} | "
            + " | ".join(cells)
            + " |"
        )
    stalls = [
        f"{r['engine']} c={r['concurrency']} T={r['temperature']:g}: "
        + ", ".join(f"{sec:.2f} s ({kind}, {k} drafts)" for sec, kind, k in r["stalls"])
        for r in rows
        if r.get("stalls")
    ]
    if stalls:
        lines.append(
            "\nSteps that took over 1 s inside a measurement (stalls; not in the means above): "
            + "; ".join(stalls)
        )
    return "\n".join(lines)


def rows_from_logs(out: Path) -> tuple[list[dict], list[str]]:
    """A cut-off ``ddtree bench`` run (its tables are written at its end; seen when the device
    time ran out): the result line each engine worker printed per measurement in
    ``out/<engine>.log``, with the step periods of its window where the step log is on, and
    the engines (no-spec and the chain first). Feed the rows to :func:`aggregate` /
    :func:`summary_markdown`."""
    runs, engines = [], []
    for log in sorted(out.glob("*.log")):
        text = log.read_text(errors="replace")
        rows = [json.loads(line) for line in text.splitlines() if line.startswith('{"engine"')]
        window_steps(text, rows)
        for row in rows:
            runs.append(row)
            if row["engine"] not in engines:
                engines.append(row["engine"])
    references = [e for e in (NO_SPEC, CHAIN) if e in engines]
    return runs, references + [e for e in engines if e not in references]


def sum_acceptance(reports: list[dict]) -> dict:
    """``{"rows", "accepted"}`` summed over acceptance reports (or rows' ``acceptance``)."""
    return {
        key: [sum(col) for col in zip(*(r[key] for r in reports), strict=True)]
        for key in ("rows", "accepted")
    }


def budget_plan(rows: list[dict]) -> str | None:
    """From a run with several fixed budgets (``ddtree-<B>`` engines) and the acceptance log
    of the largest (``--ddtree-acceptance``): per temperature, what each budget would accept
    (read off the largest budget's walks, pooled over c), the expected tokens/s per request
    (1 + accepted) / ms per engine step at each (c, B), and the schedule that picks the best B
    per c (``ddtree.budget.throughput_schedule``). None when the run cannot say."""
    from ddtree.budget import fastest, throughput_schedule, tokens_per_ms

    fixed = {
        (r["engine"], *_point(r)): r
        for r in rows
        if r["engine"].startswith("ddtree-") and r["engine"][7:].isdigit()
    }
    parts = []
    for temperature in sorted({t for _, _, t in fixed}):
        here = {(e, c): r for (e, c, t), r in fixed.items() if t == temperature}
        budgets = sorted({int(e[7:]) for e, _ in here})
        curves = [r["accepted_by_budget"] for (e, _), r in here.items()
                  if int(e[7:]) == budgets[-1] and r.get("accepted_by_budget")]  # fmt: skip
        sizes = sorted(
            c for c in {c for _, c in here}
            if all(here.get((f"ddtree-{b}", c), {}).get("ms_per_engine_step") for b in budgets)
        )  # fmt: skip
        if len(budgets) < 2 or not curves or not sizes:
            continue
        accepted = []
        for b in budgets:
            values = [curve[b - 1] for curve in curves if curve[b - 1] is not None]
            accepted.append(sum(values) / len(values) if values else 0.0)
        step_ms = [[here[(f"ddtree-{b}", c)]["ms_per_engine_step"] for b in budgets] for c in sizes]
        schedule = throughput_schedule(accepted, step_ms, sizes, budgets, max(sizes))
        lines = [
            f"Budget plan, T={temperature:g}: accepted draft tokens per request step by budget "
            f"(ddtree-{budgets[-1]}'s walks, all c): "
            + ", ".join(f"B={b}: {a:.2f}" for b, a in zip(budgets, accepted, strict=True)),
            "",
            "| c | " + " | ".join(f"B={b}" for b in budgets) + " |",
            "|---:|" + "---:|" * len(budgets),
        ]
        for c, ms in zip(sizes, step_ms, strict=True):
            speed = tokens_per_ms(accepted, ms)
            best = fastest(speed, budgets)
            cells = [
                f"**{1000 * v:.0f}**" if j == best else f"{1000 * v:.0f}"
                for j, v in enumerate(speed)
            ]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "(expected tokens/s per request: (1 + accepted) / ms per engine step.) Suggested: "
            f'`"ddtree_budget_per_batch_size": {schedule}` (the last range up to your '
            "max_num_seqs).",
        ]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) if parts else None


def mean_profile(reports: Iterable[dict]) -> dict | None:
    """Steps-weighted mean ms per step of each stage over ``reports``; None if there are none.

    A stage missing from some reports (``attention`` off the tree path) is averaged over the
    steps of the reports that have it."""
    sums: dict[str, float] = {}
    steps_of: dict[str, int] = {}
    count = total = 0
    for report in reports:
        count += 1
        total += report["steps"]
        for stage, ms in report["ms_per_step"].items():
            sums[stage] = sums.get(stage, 0.0) + ms * report["steps"]
            steps_of[stage] = steps_of.get(stage, 0) + report["steps"]
    if not count:
        return None
    means = {stage: round(sums[stage] / steps_of[stage], 3) for stage in sums}
    return {"reports": count, "steps": total, "ms_per_step": means}


def profile_table(rows: list[dict]) -> str | None:
    """Rows with a ``profile``: one line per (engine, c, T), one column per stage (ms/step)."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return None
    stages: list[str] = []
    for row in profiled:
        stages += [s for s in row["profile"]["ms_per_step"] if s not in stages]
    lines = [
        "| engine | c | T | steps | " + " | ".join(stages) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(stages),
    ]
    for row in profiled:
        ms = row["profile"]["ms_per_step"]
        cells = [f"{ms[s]:.2f}" if s in ms else "-" for s in stages]
        lines.append(
            f"| {row['engine']} | {row['concurrency']} | {row['temperature']:g} | "
            f"{row['profile']['steps']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def summary_markdown(rows: list[dict], engines: list[str]) -> str:
    """What ``ddtree bench`` prints at the end (and writes to ``bench.md``)."""
    ratio_key = reference_key(rows)
    against = {
        "tokens_per_s_vs_dflash": f"{CHAIN} (vLLM's default chain)",
        "tokens_per_s_vs_ar": f"{NO_SPEC} (no-spec)",
    }.get(ratio_key)
    requests = {r["concurrency"]: r.get("requests", "?") for r in rows}
    first = rows[0] if rows else {}
    repeats = first.get("repeats")
    parts = [
        f"Output tokens/s (tau) x(tokens/s over {against or 'no reference engine'} at the same "
        f"(c, T)). Requests per engine and point: "
        + ", ".join(f"c={c}: {n}" for c, n in sorted(requests.items()))
        + f", over {first.get('prompts', '?')} distinct prompts, "
        f"{first.get('max_tokens', '?')} output tokens each."
        + (
            f" Each point measured {repeats} times, the engines in turn (back to back): the "
            "median tokens/s, tau over all repeats, [the lowest-highest ratio of a repeat to "
            "the reference's same repeat]."
            if repeats and repeats > 1
            else ""
        ),
        "",
        markdown_table(rows, lambda r: speed_cell(r, ratio_key), engines),
        "",
        "ms per engine step (vllm:iteration_tokens_total):",
        "",
        markdown_table(rows, step_cell, engines),
    ]
    plan = budget_plan(rows)
    if plan:
        parts += ["", plan]
    profiles = profile_table(rows)
    if profiles:
        parts += [
            "",
            "DDTree step split (DDTREE_PROFILE, synchronized, ms per step):",
            "",
            profiles,
        ]
    periods = step_period_table(rows)
    if periods:
        parts += [
            "",
            "Step period by kind (DDTREE_STEP_LOG: one execute_model to the next, host clock; "
            "verify: every request verifies drafts, mixed: some (a prefill among them), plain: "
            "none):",
            "",
            periods,
        ]
    parts += [
        f"profile log of {r['engine']} c={r['concurrency']} T={r['temperature']:g} not read: "
        f"{r['profile_error']}"
        for r in rows
        if "profile_error" in r
    ]
    return "\n".join(parts) + "\n"


def _style(engine: str, budgets: list[int]) -> dict:
    import matplotlib

    if engine == CHAIN:
        return {
            "color": "black",
            "ls": "--",
            "lw": 2.5,
            "marker": "s",
            "label": f"{CHAIN} (vLLM default chain, reference)",
        }
    if engine == NO_SPEC:
        return {"color": "0.5", "ls": ":", "lw": 2, "marker": "x", "label": "ar (no-spec)"}
    if engine.startswith("ddtree-a"):  # ddtree_budget_per_batch_size "auto"
        return {
            "color": "tab:red",
            "ls": "-",
            "lw": 2.2,
            "marker": "*",
            "label": f"DDTree auto (B={engine[8:]})",
        }
    if engine.startswith("ddtree-s"):  # a budget-per-batch-size schedule
        number = int(engine[8:])
        return {
            "color": matplotlib.colormaps["plasma"](min(0.15 * number, 0.85)),
            "ls": "-.",
            "lw": 1.8,
            "marker": "D",
            "label": f"DDTree schedule {number}",
        }
    if engine.startswith("ddtree-"):
        share = budgets.index(int(engine[7:])) / max(len(budgets) - 1, 1)
        return {
            "color": matplotlib.colormaps["viridis"](0.9 * share),
            "ls": "-",
            "lw": 1.8,
            "marker": "o",
            "label": f"DDTree B={engine[7:]}",
        }
    return {"ls": "-.", "lw": 1.5, "marker": "^", "label": engine}  # other chain settings


def plot(rows: list[dict], path: Path, title: str) -> None:
    """tokens/s vs concurrency (the chain in bold black), tokens/s over the chain's, and tau;
    one column per temperature, the legend outside the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = add_ratios(rows)
    ratio_key = reference_key(rows)
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    budgets = sorted(int(e[7:]) for e in engines if e.startswith("ddtree-") and e[7:].isdigit())
    panels = [("tokens_per_s", "output tokens/s")]
    if ratio_key is not None:
        reference = CHAIN if ratio_key == "tokens_per_s_vs_dflash" else NO_SPEC
        panels.append((ratio_key, f"tokens/s / {reference}'s at the same c"))
    panels.append(("tau", "tau (mean acceptance length)"))
    temps = sorted({r["temperature"] for r in rows})
    concurrencies = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(
        len(panels), len(temps), figsize=(5.5 * len(temps), 3.6 * len(panels)), squeeze=False
    )
    handles = {}
    for col, temperature in enumerate(temps):
        for line_no, (key, label) in enumerate(panels):
            ax = axes[line_no, col]
            for engine in engines:
                points = sorted(
                    (r["concurrency"], r[key])
                    for r in rows
                    if r["engine"] == engine and r["temperature"] == temperature and key in r
                )
                if not points:
                    continue
                style = _style(engine, budgets)
                (line,) = ax.plot([c for c, _ in points], [v for _, v in points], **style)
                handles.setdefault(style["label"], line)
            if key == ratio_key:
                ax.axhline(1.0, color="black", lw=1, alpha=0.6)
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.set_xlabel("concurrency c (requests in flight)")
            ax.set_ylabel(label)
            ax.set_title(f"{title}, T={temperature:g}", fontsize=10)
            ax.grid(alpha=0.3)
        axes[0, col].set_yscale("log")
        # Plain numbers (200, 500, 1000), not 2x10^2: tokens/s spans one or two decades.
        axes[0, col].yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        axes[0, col].yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axes[0, col].yaxis.set_minor_formatter(ticker.NullFormatter())
    fig.tight_layout()
    fig.legend(
        handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
