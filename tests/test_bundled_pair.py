"""The trained pair in models/: loads, fits, stays small, and DDTree on it is lossless."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.bench.tau import held_out_prompts
from ddtree.dflash import load_drafter
from ddtree.generate import generate

MODELS = Path(__file__).resolve().parent.parent / "models"


@pytest.fixture(scope="module")
def bundled():
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "target")
    target = AutoModelForCausalLM.from_pretrained(MODELS / "target", dtype=torch.float32).eval()
    drafter = load_drafter(MODELS / "drafter", target.config, dtype=torch.float32)
    return tokenizer, target, drafter


def test_bundle_is_small():
    size = sum(p.stat().st_size for p in MODELS.rglob("*") if p.is_file())
    assert size <= 20 * 2**20, f"models/ is {size / 2**20:.1f} MiB, the limit is 20 MiB"


def test_greedy_ddtree_equals_ar_on_held_out_prompts(bundled):
    tokenizer, target, drafter = bundled
    for prompt in held_out_prompts(tokenizer, count=2, length=48):
        want = generate(target, None, prompt, "ar", max_new_tokens=48).tokens
        for method, budget in (("dflash", 0), ("ddtree", 15), ("ddtree", 64), ("ddtree", 255)):
            got = generate(target, drafter, prompt, method, budget=budget, max_new_tokens=48)
            assert got.tokens == want, (method, budget)
            assert got.tau > 1.0  # the trained drafter gets tokens accepted
