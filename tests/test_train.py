"""Training recipes: data split, packed drafter batches, a tiny end-to-end run, resuming."""

import json
import logging
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.cli import TINY_DEFAULTS, main
from ddtree.dflash import load_drafter
from ddtree.generate import generate
from ddtree.train.data import HELD_OUT_MODULES, stdlib_files, stdlib_root
from ddtree.train.recipes import DrafterRecipe, drafter_batch


def test_held_out_modules_never_in_training_set():
    train, held = stdlib_files(), stdlib_files(held_out=True)
    assert not set(train) & set(held)
    root = stdlib_root()
    names = {p.relative_to(root).parts[0].removesuffix(".py") for p in held}
    assert names == set(HELD_OUT_MODULES)
    assert train == sorted(train)  # deterministic order


def test_drafter_batch_blocks_see_only_the_past():
    from models import make_target

    target = make_target(seed=0)
    tokens = torch.randint(0, 90, (2, 40))
    recipe = DrafterRecipe(block_size=4, anchors=3, target_layer_ids=[0, 2])
    feats, pos, ids, block_pos, mask, labels = drafter_batch(
        target, tokens, recipe, 95, torch.Generator().manual_seed(0)
    )
    assert feats.shape == (2, 40, 64) and ids.shape == (2, 12) and mask.shape == (2, 1, 12, 52)
    for b in range(2):
        for a in range(3):
            anchor = int(block_pos[b, a * 4])
            assert 1 <= anchor <= 40 - 4
            assert (
                ids[b, a * 4] == tokens[b, anchor] and (ids[b, a * 4 + 1 : a * 4 + 4] == 95).all()
            )
            assert labels[b, a].tolist() == tokens[b, anchor + 1 : anchor + 4].tolist()
            for q in range(a * 4, a * 4 + 4):
                row = mask[b, 0, q]
                assert row[:40].tolist() == [j < anchor for j in range(40)]
                assert row[40:].tolist() == [a * 4 <= j < a * 4 + 4 for j in range(12)]


def test_tiny_end_to_end_is_fast_and_resumes(tmp_path):
    """``train all --tiny`` with no other flag: every stage, in seconds, loadable models."""
    out = tmp_path / "m"
    argv = ["train", "all", "--out", str(out), "--tiny"]
    warnings = _TransformersWarnings()
    logging.getLogger("transformers").addHandler(warnings)
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process warnings
    try:
        started = time.monotonic()
        assert main(argv) == 0
        seconds = time.monotonic() - started
    finally:
        logging.getLogger("transformers").removeHandler(warnings)
    assert seconds < 90, f"train all --tiny took {seconds:.0f} s"
    assert not [m for m in warnings.messages if "attention mask" in m.lower()], warnings.messages
    tok = AutoTokenizer.from_pretrained(out / "target")
    assert len(tok) == TINY_DEFAULTS["vocab_size"]
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"):
        assert tok.convert_tokens_to_ids(special) != tok.unk_token_id
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
    drafter = load_drafter(out / "drafter", target.config, dtype=torch.float32)
    assert drafter.settings.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    ids = tok("def f(x):\n    return", add_special_tokens=False)["input_ids"]
    want = generate(target, None, ids, "ar", max_new_tokens=12).tokens
    assert generate(target, drafter, ids, "ddtree", budget=32, max_new_tokens=12).tokens == want
    steps = TINY_DEFAULTS["target_steps"]
    log = json.loads((out / "target" / "training_log.json").read_text())
    assert log["loss_history"][-1][0] == steps
    log = json.loads((out / "drafter" / "training_log.json").read_text())
    assert log["loss_history"][-1][0] == TINY_DEFAULTS["drafter_steps"]

    # Resume: the checkpoint holds the last step; asking for 3 more trains 3 more.
    assert main(["train", "target", *argv[2:], "--target-steps", str(steps + 3)]) == 0
    log = json.loads((out / "target" / "training_log.json").read_text())
    assert [s for s, _ in log["loss_history"]] == [steps, steps + 3]


class _TransformersWarnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_hybrid_target_has_qwen36s_layout():
    """``--arch qwen3_5``: every 4th layer full attention, the rest Gated DeltaNet, M-RoPE
    sections splitting half the rotary dims (Qwen3.6-27B: head 256 -> [11, 11, 10])."""
    from ddtree.train.recipes import TargetRecipe, target_config

    tokenizer = type("Tok", (), {"eos_token_id": 0, "__len__": lambda self: 512})()
    recipe = TargetRecipe(arch="qwen3_5", hidden_size=1024, num_heads=4, num_layers=8)
    config = target_config(recipe, tokenizer)
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
    text = config.get_text_config()
    assert text.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert text.rope_parameters["mrope_section"] == [11, 11, 10]
    assert text.vocab_size == 512
    with pytest.raises(ValueError, match="arch must be one of"):
        target_config(TargetRecipe(arch="llama"), tokenizer)
