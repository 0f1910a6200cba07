"""Tiny random-weight targets and DFlash drafters for tests, and known-acceptance pairs."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ddtree.dflash import DFlashDraftModel, load_drafter, save_drafter


def target_config(vocab: int = 96, hidden: int = 32, layers: int = 4) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def make_target(seed: int = 0, **kw) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(target_config(**kw)).eval()
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties
        model.lm_head.weight.mul_(20)
    return model


def drafter_config(target: Qwen3ForCausalLM, layers: int = 2, block_size: int = 16, **dflash):
    tc = target.config
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=tc.hidden_size // 4,
        max_position_embeddings=512,
    )
    cfg.block_size = block_size
    cfg.num_target_layers = tc.num_hidden_layers
    cfg.dflash_config = {"mask_token_id": tc.vocab_size - 1, **dflash}
    return cfg


def make_drafter(target, tmp: Path, seed: int = 1, **kw) -> DFlashDraftModel:
    """A random drafter, written to ``tmp`` in the z-lab format and loaded back."""
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(drafter_config(target, **kw))
    save_drafter(drafter, tmp)
    return load_drafter(tmp, target.config)


def known_pair(tmp: Path, target_next, draft_token: int, vocab: int = 32, block_size: int = 16):
    """Target whose argmax after token x is ``target_next(x)`` whatever the context; drafter that
    proposes ``draft_token`` at every depth. Attention and MLP outputs are zeroed, so the last
    hidden state is the current token's embedding (a scaled one-hot)."""
    target = make_target(vocab=vocab, hidden=vocab, layers=2)  # hidden = vocab: one-hot states
    drafter = make_drafter(target, tmp, block_size=block_size, target_layer_ids=[0, 1])
    with torch.no_grad():
        for model in (target.model, drafter):
            for layer in model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.norm.weight.fill_(1.0)
        target.model.embed_tokens.weight.copy_(torch.eye(vocab))
        head = torch.zeros(vocab, vocab)
        for x in range(vocab):
            head[target_next(x), x] = 1.0
        # The drafter reads the MASK embedding through the same head: make it say draft_token.
        mask_id = drafter.settings.mask_token_id
        head[:, mask_id] = 0.0
        head[draft_token, mask_id] = 1.0
        target.lm_head.weight.copy_(head)
    return target, drafter


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer over words w0, w1, ... with <unk> and <eos>."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(vocab_size - 2)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)


def make_hybrid_pair(out: Path, seed: int = 0, decay: float = 0.02) -> tuple[Path, Path]:
    """``out/target``: a random tiny Qwen3.5 over 32 words (sharp head: it falls into loops);
    ``out/drafter``: a 1-layer DFlash drafter distilled from its greedy continuations (~15 s on
    2 cores), so that DDTree accepts paths several nodes deep, off the first branch too."""
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from ddtree.train.recipes import (
        DrafterRecipe,
        TargetRecipe,
        distill_stream,
        target_config,
        train_drafter,
    )

    vocab = 32
    save_word_tokenizer(out / "target", vocab)
    # ``ddtree train --arch qwen3_5``'s layout: 2 x (3 GDN + 1 attention) layers, interleaved
    # M-RoPE; heads of 32 as vLLM's CPU kernels want.
    shapes = TargetRecipe(
        arch="qwen3_5", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=8,
        intermediate_size=128,
    )  # fmt: skip
    config = target_config(shapes, AutoTokenizer.from_pretrained(out / "target"))
    torch.manual_seed(seed)
    target = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(20)
        for layer in target.model.language_model.layers:
            if hasattr(layer, "linear_attn"):  # slow decay: states remember many tokens, so
                layer.linear_attn.A_log.fill_(math.log(decay))  # a wrong state shows in outputs
    target.save_pretrained(out / "target")
    cpu = torch.device("cpu")
    prompts = torch.randint(2, vocab - 1, (20000,), generator=torch.Generator().manual_seed(seed))
    stream = distill_stream(
        target, prompts, 6000, prompt_len=8, length=96, batch=64, eos_id=1, device=cpu,
        greedy_fraction=1.0,
    )  # fmt: skip
    recipe = DrafterRecipe(
        num_layers=1, target_layer_ids=[1, 3, 6], seq_len=96, batch=16, anchors=8, steps=400,
        lr=3e-3, warmup=10, seed=seed,
    )  # fmt: skip
    train_drafter(stream, target, out / "drafter", recipe, mask_token_id=vocab - 1, device=cpu)
    return out / "target", out / "drafter"
