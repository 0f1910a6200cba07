import json

import pytest

import ddtree.cli
from ddtree.cli import TINY_DEFAULTS, TRAIN_DEFAULTS, main
from ddtree.generate import generate

from models import make_drafter, make_target, save_word_tokenizer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = make_target(seed=0)
    target.save_pretrained(root / "target")
    save_word_tokenizer(root / "target", target.config.vocab_size)
    make_drafter(target, root / "draft", seed=1)
    return root / "target", root / "draft", target


def test_generate_cli_prints_text_and_tau(model_dirs, capsys):
    target_dir, draft_dir, target = model_dirs
    argv = [
        "generate",
        "--target",
        str(target_dir),
        "--draft",
        str(draft_dir),
        "--budget",
        "64",
        "--prompt",
        "w1 w15 w40",
        "--max-new-tokens",
        "12",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    # Same tokens as the AR loop on the same ids (w1 w15 w40 -> ids 3 17 42).
    want = generate(target, None, [3, 17, 42], "ar", max_new_tokens=12, stop_token_ids=[1]).tokens
    words = " ".join(f"w{t - 2}" for t in want if t > 1)
    assert out.strip() == words
    assert "[ddtree]" in err and "tau" in err


def test_generate_cli_needs_draft_for_ddtree(model_dirs):
    target_dir, _, _ = model_dirs
    with pytest.raises(SystemExit, match="needs --draft"):
        main(["generate", "--target", str(target_dir), "--prompt", "w1"])


@pytest.mark.parametrize("with_tree", [True, False])
def test_bench_plot_with_and_without_ddtree_rows(tmp_path, with_tree):
    """`ddtree bench`'s plot: chain-only runs (e.g. the engine-settings comparison) plot too."""
    from ddtree.bench.vllm import METHODS, plot

    rows = [
        {
            "engine": name,
            "concurrency": c,
            "temperature": 0.0,
            "tokens_per_s": 100.0 + c,
            "tau": 2.0,
            "ms_per_step": 5.0,
        }
        for name in METHODS[:-1]
        for c in (1, 4)
    ]
    if with_tree:
        tree = {
            "concurrency": 1,
            "temperature": 0.0,
            "tokens_per_s": 90.0,
            "tau": 3.0,
            "ms_per_step": 7.0,
        }
        rows += [{"engine": f"ddtree-{b}", **tree} for b in (16, 64)]
    plot(rows, tmp_path / "bench.png", "test")
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_refuses_unknown_methods(tmp_path):
    with pytest.raises(SystemExit, match="unknown method 'dflash-v3'"):
        main(["bench", "--methods", "ar,dflash-v3", "--out", str(tmp_path)])


def _serve_args(**kw):
    import argparse

    base = {
        "model": None,
        "draft": None,
        "host": "127.0.0.1",
        "port": 8000,
        "budget": 64,
        "max_num_seqs": 32,
        "method": "ddtree",
        "budget_per_batch_size": None,
    }
    return argparse.Namespace(**{**base, **kw})


def _spec(cmd: list[str]) -> dict | None:
    if "--speculative-config" not in cmd:
        return None
    return json.loads(cmd[cmd.index("--speculative-config") + 1])


def test_serve_command_methods(model_dirs):
    from ddtree.cli import serve_command

    target, drafter = (str(p) for p in model_dirs[:2])
    tree = serve_command(_serve_args(model=target, draft=drafter), ["--seed", "0"])
    assert _spec(tree) == {"method": "ddtree", "model": drafter, "ddtree_budget": 64}
    assert tree[-2:] == ["--seed", "0"]  # the user's vLLM arguments come last
    chain = serve_command(_serve_args(model=target, draft=drafter, method="dflash"), [])
    block = json.loads((model_dirs[1] / "config.json").read_text())["block_size"]
    assert _spec(chain) == {
        "method": "dflash",
        "model": drafter,
        "num_speculative_tokens": block - 1,
    }
    assert chain[chain.index("--max-num-seqs") + 1] == "32"
    assert _spec(serve_command(_serve_args(model=target, draft=drafter, budget=0), [])) is None
    names = tree.index("--served-model-name")
    assert tree[names + 1 : names + 3] == ["target", target]  # short name first, path still works
    own = serve_command(_serve_args(model=target, draft=drafter), ["--served-model-name", "m"])
    assert own.count("--served-model-name") == 1  # the user's choice stands
    fixed = serve_command(
        _serve_args(model=target, draft=drafter, budget_per_batch_size="fixed"), []
    )
    assert _spec(fixed)["ddtree_budget_per_batch_size"] == "fixed"


@pytest.mark.parametrize(
    ("text", "want"), [("auto", "auto"), ("fixed", "fixed"), ("[[1, 4, 63]]", [[1, 4, 63]])]
)
def test_budget_per_batch_size_flag(text, want):
    from ddtree.cli import budget_mode

    assert budget_mode(text) == want


def test_budget_per_batch_size_flag_refuses_other_text():
    import argparse

    from ddtree.cli import budget_mode

    with pytest.raises(argparse.ArgumentTypeError, match="auto.*fixed.*JSON"):
        budget_mode("fast")


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ([], TRAIN_DEFAULTS),  # the recipe, unchanged by --tiny's defaults
        (["--tiny"], TINY_DEFAULTS),
        (["--tiny", "--target-steps", "7"], {**TINY_DEFAULTS, "target_steps": 7}),
        (["--distill-tokens", "0"], {**TRAIN_DEFAULTS, "distill_tokens": 0}),
    ],
)
def test_train_sizes_default_to_the_recipe_or_tiny(monkeypatch, flags, want):
    seen = {}
    monkeypatch.setattr(ddtree.cli, "_train", lambda args: seen.update(vars(args)) or 0)
    assert main(["train", "all", "--out", "unused", *flags]) == 0
    assert {name: seen[name] for name in want} == want
    assert TRAIN_DEFAULTS == {
        "vocab_size": 8192,
        "target_steps": 1200,
        "drafter_steps": 4000,
        "distill_tokens": 3_000_000,
    }


@pytest.mark.parametrize(
    ("flags", "which", "want"),
    [
        ([], "target", {}),  # the recipe's own shapes
        (["--target-layers", "4", "--batch", "16"], "target", {"num_layers": 4, "batch": 16}),
        (["--target-layers", "4", "--seq-len", "256"], "drafter", {"seq_len": 256}),
        (["--batch", "16"], "distill", {}),  # distillation keeps its own batch
        (["--tiny", "--arch", "qwen3_5", "--target-layers", "4"], "target", {"num_layers": 4}),
    ],
)
def test_train_shape_flags_reach_the_recipes(monkeypatch, flags, which, want):
    seen = {}
    monkeypatch.setattr(ddtree.cli, "_train", lambda args: seen.update(args=args) or 0)
    assert main(["train", "all", "--out", "unused", *flags]) == 0
    fields = ddtree.cli._small(seen["args"], which)
    assert {name: fields[name] for name in want} == want
    if "--tiny" in flags:  # the flags win over --tiny's shapes, the rest of which stay
        assert fields["hidden_size"] == 64 and fields["batch"] == 4
    elif not want:
        assert fields == {}


def test_train_shape_flags_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["train", "all", "--out", "unused", "--seq-len", "0"])
    assert "must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--method", "dflash"], ["--budget", "0"]])
def test_serve_refuses_budget_per_batch_size_without_a_tree(flags):
    with pytest.raises(SystemExit, match="--budget-per-batch-size applies to --method ddtree"):
        main(["serve", "--budget-per-batch-size", "fixed", *flags])
