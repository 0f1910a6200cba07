"""The tables of a cut-off ``ddtree bench`` run, from its engine logs (the bench writes
``bench.md`` only at its end; `h200.sh collect` brings a running bench's logs back as
``<mode>.bench_partial.tgz``).

    python benchmarks/bench_partial.py /tmp/bench_sched [--rows rows.jsonl] [--plot bench.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree.bench.report import add_ratios, aggregate, plot, rows_from_logs, summary_markdown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the bench's --out directory (its <engine>.log)")
    parser.add_argument("--rows", type=Path, help="also write the raw rows here (JSON lines)")
    parser.add_argument("--plot", type=Path, help="also plot tokens/s, the ratio and tau here")
    parser.add_argument("--title", default="ddtree bench (cut off)", help="the plot's title")
    args = parser.parse_args()
    runs, engines = rows_from_logs(args.out)
    if not runs:
        print(f"no measurement lines in {args.out}/*.log", file=sys.stderr)
        return 1
    if args.rows:
        args.rows.write_text("".join(json.dumps(r) + "\n" for r in runs))
    rows = aggregate(runs)
    print(summary_markdown(add_ratios(rows), engines), end="")
    if args.plot:
        plot(rows, args.plot, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
