"""The transformers reference loop: lossless greedy and sampling, stops, limits, loader errors."""

import json
import math

import pytest
import torch

from ddtree.dflash import DFlashConfigError, load_drafter, save_drafter
from ddtree.generate import generate

from models import known_pair, make_drafter, make_target

PROMPTS = [[3, 17, 42, 5, 9], [60], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_target(seed=0)
    drafter = make_drafter(target, tmp_path_factory.mktemp("drafter"), seed=1)
    return target, drafter


@pytest.fixture(scope="module")
def ar_outputs(pair):
    target, _ = pair
    return [generate(target, None, p, "ar", max_new_tokens=40).tokens for p in PROMPTS]


def test_ar_matches_hf_generate(pair, ar_outputs):
    target, _ = pair
    for prompt, ours in zip(PROMPTS, ar_outputs, strict=True):
        hf = target.generate(
            torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False
        )
        assert hf[0, len(prompt) :].tolist() == ours


@pytest.mark.parametrize(
    "method, budget", [("dflash", 0)] + [("ddtree", b) for b in (0, 1, 15, 64, 255)]
)
def test_greedy_is_lossless(pair, ar_outputs, method, budget):
    target, drafter = pair
    for prompt, want in zip(PROMPTS, ar_outputs, strict=True):
        got = generate(target, drafter, prompt, method, budget=budget, max_new_tokens=40)
        assert got.tokens == want
        assert sum(got.taus) >= len(want) - 1  # every token but the prefill's came from a step


def test_greedy_lossless_other_block_size_and_layers(tmp_path):
    target = make_target(seed=3, vocab=50, layers=6)
    drafter = make_drafter(target, tmp_path, seed=4, layers=1, block_size=5)
    want = generate(target, None, [1, 2, 3], "ar", max_new_tokens=30).tokens
    for budget in (3, 17, 100):
        got = generate(target, drafter, [1, 2, 3], "ddtree", budget=budget, max_new_tokens=30)
        assert got.tokens == want
        assert len(got.accepted_per_depth) == 4  # D = block_size - 1


def test_known_acceptance_all(tmp_path):
    target, drafter = known_pair(tmp_path, lambda x: 7, 7)
    for method in ("dflash", "ddtree"):
        got = generate(target, drafter, [1, 2], method, budget=64, max_new_tokens=1 + 16 * 3)
        assert got.tokens == [7] * 49
        assert got.taus == [16, 16, 16]
        assert got.accepted_per_depth == [3] * 15


def test_known_acceptance_exactly_one(tmp_path):
    # After 7 the target says 9, after anything else 7; the drafter always proposes 7.
    target, drafter = known_pair(tmp_path, lambda x: 9 if x == 7 else 7, 7)
    got = generate(target, drafter, [1, 2], "ddtree", budget=1, max_new_tokens=21)
    assert got.tokens == [7] + [9, 7] * 10
    assert got.taus[1:] == [2] * (len(got.taus) - 1)


def test_known_acceptance_none(tmp_path):
    target, drafter = known_pair(tmp_path, lambda x: 9, 7)
    for method, budget in (("dflash", 0), ("ddtree", 1)):
        got = generate(target, drafter, [1, 2], method, budget=budget, max_new_tokens=10)
        assert got.tokens == [9] * 10
        assert set(got.taus) == {1}


def test_stop_inside_accepted_path_and_exact_length(tmp_path):
    target, drafter = known_pair(tmp_path, lambda x: 7, 7)
    # max_new_tokens inside a 16-token accepted path: exactly that many.
    for limit in (1, 2, 5, 16, 17, 30):
        got = generate(target, drafter, [1, 2], "ddtree", budget=32, max_new_tokens=limit)
        assert got.tokens == [7] * limit and got.finish_reason == "length"
    # "one": each step emits [7 (accepted draft), 9 (bonus)]; stop on the accepted 7.
    target, drafter = known_pair(tmp_path / "one", lambda x: 9 if x == 7 else 7, 7)
    got = generate(target, drafter, [7], "ddtree", budget=4, max_new_tokens=50, stop_token_ids=[7])
    assert got.tokens == [9, 7] and got.finish_reason == "stop"
    got = generate(target, drafter, [1], "ddtree", budget=4, max_new_tokens=50, stop_token_ids=[9])
    assert got.tokens == [7, 9] and got.finish_reason == "stop"


def test_stop_tokens_match_ar(pair, ar_outputs):
    target, drafter = pair
    for prompt, full in zip(PROMPTS, ar_outputs, strict=True):
        stop = full[10]
        want = full[: full.index(stop) + 1]
        for method in ("ar", "dflash", "ddtree"):
            got = generate(
                target, drafter, prompt, method, budget=64, stop_token_ids=[stop], max_new_tokens=40
            )
            assert got.tokens == want and got.finish_reason == "stop"
        for limit in (1, 3, 7, 16, 33):
            got = generate(target, drafter, prompt, "ddtree", budget=64, max_new_tokens=limit)
            assert got.tokens == full[:limit] and got.finish_reason == "length"


def _chi2_critical(dof: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.29: p = 0.0005)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def _token_distribution(target, prompt, index, temperature=1.0, top_k=None, top_p=None):
    """Exact P(generated token ``index``) under the target's processed sampling distribution."""

    def probs(ids):
        logits = target(torch.tensor([ids])).logits[0, -1:].float() / temperature
        if top_k is not None:
            kth = logits.topk(top_k, -1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p is not None:
            sl, order = logits.sort(-1, descending=True)
            p = sl.softmax(-1)
            sl = sl.masked_fill(p.cumsum(-1) - p >= top_p, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sl)
        return logits.softmax(-1)[0]

    def marginal(prefix, weight, depth):
        p = probs(prefix)
        if depth == index:
            return weight * p
        return sum(
            marginal(prefix + [x], weight * p[x], depth + 1) for x in p.nonzero().flatten().tolist()
        )

    with torch.no_grad():
        return marginal(list(prompt), 1.0, 0)


@pytest.mark.parametrize(
    "method, budget, top_k, top_p",
    [("ddtree", 15, None, None), ("dflash", 0, None, None), ("ddtree", 64, 8, 0.9)],
)
def test_sampling_matches_target_distribution(tmp_path, method, budget, top_k, top_p):
    # A small vocabulary with soft logits, so that many tokens are likely.
    target = make_target(seed=5, vocab=12, hidden=16, layers=2)
    with torch.no_grad():
        target.lm_head.weight.div_(20)
    drafter = make_drafter(target, tmp_path, seed=6, block_size=4)
    prompt = [1, 2, 3]
    n = 500
    runs = [
        generate(
            target,
            drafter,
            prompt,
            method,
            budget=budget,
            max_new_tokens=3,
            temperature=1.0,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        ).tokens
        for seed in range(n)
    ]
    # Token 1 is the root's sample; token 2 is sampled at a depth-1 node when it was accepted.
    for index in (1, 2):
        exact = _token_distribution(target, prompt, index, 1.0, top_k, top_p)
        counts = torch.bincount(torch.tensor([r[index] for r in runs]), minlength=12).float()
        _assert_chi2(counts, exact * n)


def _assert_chi2(counts: torch.Tensor, expected: torch.Tensor) -> None:
    keep = expected >= 5  # pool the rare tokens into one cell
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    expected = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if expected[-1] < 1e-9:
        assert observed[-1] == 0
        observed, expected = observed[:-1], expected[:-1]
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_critical(len(expected) - 1), (chi2, counts.tolist(), expected.tolist())


def test_sampling_seed_is_reproducible(pair):
    target, drafter = pair
    a = generate(
        target, drafter, [5, 6], "ddtree", budget=32, temperature=0.8, seed=3, max_new_tokens=20
    )
    b = generate(
        target, drafter, [5, 6], "ddtree", budget=32, temperature=0.8, seed=3, max_new_tokens=20
    )
    assert a.tokens == b.tokens


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "beam"}, "method must be one of"),
        ({"method": "ddtree", "budget": -1}, "budget must be an int >= 0"),
        ({"method": "ddtree", "max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"method": "ddtree", "temperature": -0.5}, "temperature must be >= 0"),
        ({"method": "ddtree", "top_k": 0}, "top_k must be >= 1"),
        ({"method": "ddtree", "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_generate_rejects_bad_arguments(pair, kwargs, message):
    target, drafter = pair
    with pytest.raises(ValueError, match=message):
        generate(target, drafter, [1, 2], **kwargs)


def test_generate_needs_a_drafter(pair):
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(pair[0], None, [1], "ddtree")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key == "dflash_config":
            cfg[key].update(value)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": 64, "head_dim": 16}, "hidden_size 64 != target hidden_size 32"),
        ({"vocab_size": 100}, "vocab_size 100 != target vocab_size 96"),
        ({"dflash_config": {"mask_token_id": 96}}, "mask_token_id 96 is not in the target"),
        ({"dflash_config": {"target_layer_ids": [0, 4]}}, r"target_layer_ids \[4\] out of range"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "lack DFlashDraftModel"),
        ({"block_size": 1}, "block_size must be an int >= 2"),
        ({"dflash_config": {"target_layer_ids": [1, 1]}}, r"target_layer_ids \[1, 1\] repeat"),
    ],
)
def test_loader_rejects_mismatches(pair, tmp_path, changes, message):
    target, drafter = pair
    save_drafter(drafter, tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(DFlashConfigError, match=message):
        load_drafter(tmp_path, target.config)


def test_loader_missing_files(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(DFlashConfigError, match="no config.json"):
        load_drafter(tmp_path, target.config)
    save_drafter(drafter, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(DFlashConfigError, match="no model.safetensors"):
        load_drafter(tmp_path, target.config)


def test_loader_default_layer_ids(pair, tmp_path):
    target, drafter = pair
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["num_target_layers"] = 12
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_drafter(tmp_path)
    assert loaded.settings.target_layer_ids == [1, 9]  # evenly from 1 to L-3 for 2 layers
    assert torch.equal(loaded.fc.weight, drafter.fc.weight)
