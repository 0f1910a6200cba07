"""Where do two servers' greedy answers part, and was it a near-tie? (issue 7, GPU soaks)

For every greedy mismatch a `ddtree soak --compare` run recorded (soak.json), this re-encodes both
answers, finds the first token where they differ and scores that point with the bundled target
in float32 on the CPU: the logit of the token each server chose, and which one float32 prefers.
Texts are re-encoded, which can split a word otherwise than the server did: such splits show as
two tokens that are not float32's top two and are counted apart. A lossless server whose answers
differ from no-spec only by bf16 rounding parts at near-ties and wins about half of them; a lossy
one parts where no-spec's token is clearly ahead.

    python benchmarks/soak_margins.py --soak RUN/soak.json --control CONTROL/soak.json --out DIR \
        [--run "LABEL=OTHER/soak.json" ...]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

TARGET = Path(__file__).resolve().parents[1] / "models" / "target"


def first_split(tok, mismatch: dict) -> tuple[list[int], int, int] | None:
    """(context token ids, server token, no-spec token) at the first differing token, or None."""
    stop = mismatch["request"]["args"].get("stop") or [""]
    answers = zip(
        mismatch["texts"],
        mismatch["reasons"],
        mismatch["no_spec"]["texts"],
        mismatch["no_spec"]["reasons"],
        strict=True,
    )
    for ours, ours_reason, ref, ref_reason in answers:
        if ours == ref and ours_reason == ref_reason:
            continue
        # vLLM drops the stop string from the text; what was generated includes it (the soak
        # gives one stop string per request; a stop by EOS is taken for one by it, a rare slip)
        ours += stop[0] if ours_reason == "stop" else ""
        ref += stop[0] if ref_reason == "stop" else ""
        ids_ours = tok(ours, add_special_tokens=False).input_ids
        ids_ref = tok(ref, add_special_tokens=False).input_ids
        k = next(
            (i for i, (a, b) in enumerate(zip(ids_ours, ids_ref, strict=False)) if a != b), None
        )
        if k is None:  # one answer is a prefix of the other: the shorter one stopped early
            return None
        prompt_ids = tok(mismatch["request"]["args"]["prompt"]).input_ids
        return prompt_ids + ids_ours[:k], ids_ours[k], ids_ref[k]
    return None


@torch.no_grad()
def score(model, tok, mismatches: list[dict], label: str) -> list[dict]:
    rows = []
    for m in tqdm(mismatches, desc=label):
        split = first_split(tok, m)
        if split is None:
            rows.append({"kind": "prefix"})
            continue
        context, ours, ref = split
        logits = model(torch.tensor([context])).logits[0, -1].float()  # [vocab]
        top2 = logits.topk(2)
        rows.append(
            {
                "kind": "split",
                "margin": float(
                    logits[ours] - logits[ref]
                ),  # > 0: float32 prefers the server's token
                "top_gap": float(top2.values[0] - top2.values[1]),
                "in_top2": {ours, ref} == set(top2.indices.tolist()),
                "first_char": len(os.path.commonprefix([m["texts"][0], m["no_spec"]["texts"][0]])),
            }
        )
    return rows


def summarize(rows: list[dict], compared: int) -> dict:
    splits = [r for r in rows if r["kind"] == "split"]
    margins = torch.tensor([abs(r["margin"]) for r in splits])
    out = {
        "greedy_compared": compared,
        "mismatches": len(rows),
        "one_answer_is_prefix_of_other": len(rows) - len(splits),
        "split_tokens_are_float32_top2": sum(r["in_top2"] for r in splits),
        "float32_prefers_server": sum(r["margin"] > 0 for r in splits),
        "float32_prefers_no_spec": sum(r["margin"] < 0 for r in splits),
    }
    top2 = [r for r in splits if r["in_top2"]]  # the re-encoding matched the servers' tokens
    out["top2_float32_prefers_server"] = sum(r["margin"] > 0 for r in top2)
    out["top2_abs_margin_max"] = round(max((abs(r["margin"]) for r in top2), default=0.0), 4)
    if len(splits):
        q = torch.tensor([0.5, 0.9, 0.99, 1.0])
        out["abs_margin_quantiles_p50_p90_p99_max"] = [
            round(v, 4) for v in margins.quantile(q).tolist()
        ]
    return out


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in runs.items():
        m = sorted(abs(r["margin"]) for r in rows if r["kind"] == "split")
        ax.plot(m, [(i + 1) / len(m) for i in range(len(m))], label=f"{label} ({len(m)})")
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlabel("|logit(server token) - logit(no-spec token)|, float32, at the split")
    ax.set_ylabel("share of greedy mismatches")
    ax.set_title("Where the greedy answers part: float32 logit gap of the two choices")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--soak", type=Path, required=True, help="soak.json of DDTree vs no-spec")
    parser.add_argument("--control", type=Path, help="soak.json of no-spec vs no-spec")
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="LABEL=SOAK_JSON",
        help="more runs to score, each under its label (repeatable)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    inputs = [("DDTree vs no-spec", args.soak), ("no-spec vs no-spec", args.control)]
    for item in args.run:
        label, sep, path = item.rpartition("=")  # a label may hold "=" ("B=64"), a path rarely
        if not sep or not label or not path:
            parser.error(f"--run wants LABEL=SOAK_JSON, got {item!r}")
        inputs.append((label, Path(path)))
    missing = [f"{label}: {path}" for label, path in inputs if path and not path.is_file()]
    if missing:  # before the model loads
        parser.error("no such soak.json: " + "; ".join(missing))
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    runs, summary = {}, {}
    for label, path in inputs:
        if path is None:
            continue
        soak = json.loads(path.read_text())
        runs[label] = score(model, tok, soak["greedy_mismatches"], label)
        summary[label] = summarize(runs[label], soak["greedy_compared"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "margins.json").write_text(json.dumps({"summary": summary, "rows": runs}) + "\n")
    plot(runs, args.out / "margins.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
