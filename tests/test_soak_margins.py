"""benchmarks/soak_margins.py: the split of two greedy answers is found at the right token."""

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("soak_margins", ROOT / "benchmarks/soak_margins.py")
soak_margins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak_margins)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ROOT / "models" / "target")


def mismatch(ours: str, ref: str, reasons=("length", "length"), stop=None) -> dict:
    args = {"prompt": "def add(a, b):\n", "max_tokens": 16, "temperature": 0.0}
    if stop:
        args["stop"] = [stop]
    return {
        "request": {"args": args},
        "texts": [ours],
        "reasons": [reasons[0]],
        "no_spec": {"texts": [ref], "reasons": [reasons[1]]},
    }


def test_split_at_first_differing_token(tok):
    ours, ref = "    return a + b\n", "    return a - b\n"
    context, a, b = soak_margins.first_split(tok, mismatch(ours, ref))
    common = tok(ours, add_special_tokens=False).input_ids
    ref_ids = tok(ref, add_special_tokens=False).input_ids
    k = next(i for i, t in enumerate(ref_ids) if t != common[i])
    assert context == tok("def add(a, b):\n").input_ids + common[:k]
    assert tok.decode([a]).strip() == "+" and tok.decode([b]).strip() == "-"


def test_stop_string_is_put_back(tok):
    # the server stopped on "return" (dropped from its text); no-spec went on with "print"
    m = mismatch("    ", "    print(a)", reasons=("stop", "length"), stop="return")
    _, a, b = soak_margins.first_split(tok, m)
    assert "return" in tok.decode([a]) and "print" in tok.decode([b])


def test_equal_answers_have_no_split(tok):
    assert soak_margins.first_split(tok, mismatch("x = 1", "x = 1")) is None
    assert soak_margins.first_split(tok, mismatch("x = 1", "x = 1 + 2")) is None  # a prefix


def test_summary_counts_sides():
    rows = [
        {"kind": "split", "margin": 0.1, "in_top2": True},
        {"kind": "split", "margin": -0.3, "in_top2": True},
        {"kind": "split", "margin": -5.0, "in_top2": False},
        {"kind": "prefix"},
    ]
    s = soak_margins.summarize(rows, compared=10)
    assert s["mismatches"] == 4 and s["one_answer_is_prefix_of_other"] == 1
    assert s["float32_prefers_server"] == 1 and s["float32_prefers_no_spec"] == 2
    assert s["top2_float32_prefers_server"] == 1 and s["top2_abs_margin_max"] == 0.3


def test_run_labels_may_hold_equals_and_missing_files_are_named(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(
        "sys.argv",
        ["soak_margins.py", "--soak", str(tmp_path / "a.json"), "--out", str(tmp_path),
         "--run", f"DDTree B=64=={tmp_path / 'b.json'}"],
    )  # fmt: skip
    with pytest.raises(SystemExit):
        soak_margins.main()
    err = capsys.readouterr().err
    assert f"DDTree B=64=: {tmp_path / 'b.json'}" in err  # the label keeps its "="s
    assert f"DDTree vs no-spec: {tmp_path / 'a.json'}" in err
