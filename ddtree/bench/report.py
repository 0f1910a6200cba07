"""``ddtree bench``'s pure reporting: speed ratios, markdown tables, profile-log parsing, plot.

Nothing here starts vLLM; the rows are ``ddtree bench``'s (one per engine, concurrency c and
temperature T: ``engine``, ``concurrency``, ``temperature``, ``tokens_per_s``, ``tau``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

CHAIN = "dflash"  # vLLM's default DFlash chain engine: the reference of every speed ratio
NO_SPEC = "ar"
PROFILE_MARKER = "ddtree-profile "  # vllm_plugin/debug.py StepProfile's log lines


def _point(row: dict) -> tuple[int, float]:
    return row["concurrency"], row["temperature"]


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add ``tokens_per_s_vs_dflash`` (every engine's tokens/s over the chain's at the same
    (c, T)) and ``tokens_per_s_vs_ar`` (over no-spec's; not on no-spec's own rows), where that
    engine has a row at that point. Returns new row dicts; the input is left as it is."""
    speed = {(r["engine"], *_point(r)): r["tokens_per_s"] for r in rows}
    out = []
    for row in rows:
        row = dict(row)
        chain = speed.get((CHAIN, *_point(row)))
        if chain:
            row["tokens_per_s_vs_dflash"] = round(row["tokens_per_s"] / chain, 3)
        no_spec = speed.get((NO_SPEC, *_point(row)))
        if no_spec and row["engine"] != NO_SPEC:
            row["tokens_per_s_vs_ar"] = round(row["tokens_per_s"] / no_spec, 3)
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
    """``tok/s (tau) xRATIO``, e.g. ``1840 (8.73) x1.00``."""
    cell = f"{row['tokens_per_s']:.0f} ({row['tau']:.2f})"
    if ratio_key is not None and ratio_key in row:
        cell += f" x{row[ratio_key]:.2f}"
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


def parse_profile_log(text: str) -> list[dict]:
    """The ``ddtree-profile {...}`` reports in a log: ``[{"steps": n, "ms_per_step": {...}}]``.

    The JSON follows the marker to the end of the line (vLLM prefixes the line with the
    process name and the log level)."""
    reports = []
    for line in text.splitlines():
        at = line.find(PROFILE_MARKER)
        if at < 0:
            continue
        payload = line[at + len(PROFILE_MARKER) :].strip()
        try:
            report = json.loads(payload)
        except json.JSONDecodeError as err:
            raise ValueError(f"unreadable ddtree-profile line: {line!r}") from err
        if not isinstance(report.get("ms_per_step"), dict) or not report.get("steps"):
            raise ValueError(f"ddtree-profile line without steps / ms_per_step: {line!r}")
        reports.append(report)
    return reports


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
    parts = [
        f"Output tokens/s (tau) x(tokens/s over {against or 'no reference engine'} at the same "
        f"(c, T)). Requests per engine and point: "
        + ", ".join(f"c={c}: {n}" for c, n in sorted(requests.items()))
        + f", over {first.get('prompts', '?')} distinct prompts, "
        f"{first.get('max_tokens', '?')} output tokens each.",
        "",
        markdown_table(rows, lambda r: speed_cell(r, ratio_key), engines),
        "",
        "ms per engine step (vllm:iteration_tokens_total):",
        "",
        markdown_table(rows, step_cell, engines),
    ]
    profiles = profile_table(rows)
    if profiles:
        parts += [
            "",
            "DDTree step split (DDTREE_PROFILE, synchronized, ms per step):",
            "",
            profiles,
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
    budgets = sorted(int(e[7:]) for e in engines if e.startswith("ddtree-"))
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
