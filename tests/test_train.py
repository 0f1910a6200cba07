"""Training recipes: data split, packed drafter batches, a tiny end-to-end run, resuming."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.cli import main
from ddtree.dflash import load_drafter
from ddtree.generate import generate
from ddtree.train.data import HELD_OUT_MODULES, stdlib_files, stdlib_root
from ddtree.train.recipes import DrafterRecipe, drafter_batch

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


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


def test_tiny_end_to_end_and_resume(tmp_path):
    out = tmp_path / "m"
    argv = [
        "train",
        "all",
        "--out",
        str(out),
        "--tiny",
        "--vocab-size",
        "400",
        "--target-steps",
        "6",
        "--drafter-steps",
        "4",
        "--distill-tokens",
        "300",
    ]
    assert main(argv) == 0
    tok = AutoTokenizer.from_pretrained(out / "target")
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
    log = json.loads((out / "target" / "training_log.json").read_text())
    assert log["loss_history"][-1][0] == 6

    # Resume: the checkpoint holds step 6; asking for 9 steps trains 3 more.
    argv[argv.index("--target-steps") + 1] = "9"
    assert main(["train", "target", *argv[2:]]) == 0
    log = json.loads((out / "target" / "training_log.json").read_text())
    assert [s for s, _ in log["loss_history"]] == [6, 9]
