"""Kernel time per step by kind, side by side for several ``profile_step.py`` outputs.

    python benchmarks/profile_compare.py DIR/profile_dflash_c1.txt DIR/profile_ddtree-63_c1.txt

Each file's torch.profiler table (its "Self CUDA" column) is summed per kernel kind (the
target's and drafter's GEMMs, FlashAttention, the paged tree attention, DDTree's other Triton
kernels, ...) and divided by the run's steps (the file's first line), so that the difference
between two engines reads as where it goes (``--plot``: the same as stacked bars). CPU-side
rows (``aten::``, ``_C_``, ``cuda*``) are left out: their kernels have rows of their own.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

KINDS = (  # (kind, test on the kernel's name), first match wins
    ("GEMM (cuBLAS)", lambda n: "nvjet" in n or "cublas" in n or "gemm" in n.lower()),
    ("FlashAttention", lambda n: "flash::" in n or "FlashAttn" in n),
    ("paged tree attention", lambda n: "paged_tree" in n or "merge_splits" in n),
    ("DDTree Triton kernels", lambda n: n.startswith("_") and n.endswith("_kernel")),
    ("KV cache write", lambda n: "reshape_and_cache" in n),
    ("fused elementwise (inductor)", lambda n: n.startswith("triton_")),
)
_CPU_SIDE = ("aten::", "_C_", "cuda", "Activity", "ProfilerStep")


def kind(name: str) -> str | None:
    """The kind of a kernel row, None for a CPU-side row."""
    if name.startswith(_CPU_SIDE):
        return None
    return next((k for k, test in KINDS if test(name)), "other")


def _ms(text: str) -> float:
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"not a time: {text!r}")


def read(path: Path) -> tuple[int, dict[str, float]]:
    """(steps, ms per step by kind) of one profile file."""
    lines = path.read_text().splitlines()
    steps = re.search(r"(\d+) steps", lines[0])
    if steps is None:
        raise ValueError(f"{path}: no 'N steps' on its first line")
    total: dict[str, float] = {}
    for line in lines:
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) < 11 or not re.fullmatch(r"[\d.]+%", cols[1]):
            continue
        k = kind(cols[0])
        if k is not None:
            total[k] = total.get(k, 0.0) + _ms(cols[6])  # Self CUDA
    n = int(steps.group(1))
    return n, {k: v / n for k, v in total.items()}


def table(paths: list[Path]) -> str:
    runs = [read(p)[1] for p in paths]
    kinds = sorted({k for r in runs for k in r}, key=lambda k: -max(r.get(k, 0) for r in runs))
    names = [p.stem.removeprefix("profile_") for p in paths]
    out = ["| ms per step | " + " | ".join(names) + " |", "|---" + "|---:" * len(names) + "|"]
    for k in kinds:
        out.append(f"| {k} | " + " | ".join(f"{r.get(k, 0):.3f}" for r in runs) + " |")
    out.append("| all kernels | " + " | ".join(f"{sum(r.values()):.3f}" for r in runs) + " |")
    return "\n".join(out)


def plot(paths: list[Path], out: Path, title: str = "") -> None:
    """The same split as stacked bars, one per file (ms of kernel time per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read(p)[1] for p in paths]
    kinds = sorted({k for r in runs for k in r}, key=lambda k: -max(r.get(k, 0) for r in runs))
    names = [p.stem.removeprefix("profile_") for p in paths]
    fig, ax = plt.subplots(figsize=(4.4 + 1.6 * len(paths), 4.2))
    bottom = [0.0] * len(runs)
    for i, k in enumerate(kinds):
        heights = [r.get(k, 0.0) for r in runs]
        ax.bar(names, heights, bottom=bottom, label=k, color=f"C{i % 10}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("kernel ms per step")
    ax.set_title(title or "GPU kernel time per step by kind", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+", help="profile_<engine>_c<c>.txt files")
    parser.add_argument("--plot", type=Path, help="also stacked bars into this PNG")
    parser.add_argument("--title", default="", help="the plot's title")
    args = parser.parse_args()
    print(table(args.files))
    if args.plot:
        plot(args.files, args.plot, args.title)


if __name__ == "__main__":
    main()
