"""Recipes: a small Qwen3 target trained from scratch, and a DFlash drafter for it.

The drafter follows the DFlash recipe: the target is frozen and lends its embedding and LM
head; each training sequence gets random anchor positions; block ``[token at anchor, MASK x
(block_size - 1)]`` sees the target's features of the positions before the anchor (and its own
block, non-causally); the loss is cross-entropy at block position k = 1..block_size-1 (the
token at anchor + k), weighted ``exp(-(k - 1) / gamma)``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ddtree.dflash import DFlashDraftModel, save_drafter
from ddtree.train.data import sample_windows
from ddtree.train.loop import autocast, seed_everything, train_loop

ARCHS = ("qwen3", "qwen3_5")


@dataclass
class TargetRecipe:
    arch: str = "qwen3"  # qwen3: dense; qwen3_5: hybrid (Gated DeltaNet + every 4th attention)
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    seq_len: int = 512
    batch: int = 64
    steps: int = 1200
    lr: float = 2e-3
    warmup: int = 100
    seed: int = 0


@dataclass
class DrafterRecipe:
    num_layers: int = 3
    intermediate_size: int | None = None  # None: the target's
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 2, 4])
    seq_len: int = 512
    batch: int = 32
    anchors: int = 32
    gamma: float = 7.0
    steps: int = 3000
    lr: float = 1e-3
    warmup: int = 100
    seed: int = 0
    time_limit: float | None = None  # seconds; stop early (after a checkpoint) once passed


def target_config(recipe: TargetRecipe, tokenizer):
    """The target's config: a Qwen3 (dense), or a Qwen3.5 in the layout of Qwen3.6-27B, i.e.
    ``Qwen3_5ForConditionalGeneration`` with every 4th layer full attention and the others
    Gated DeltaNet, interleaved M-RoPE on a quarter of each head, and a one-block vision tower
    (the checkpoint vLLM loads as Qwen3.6; text prompts never run the tower)."""
    if recipe.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {recipe.arch!r}")
    head_dim = recipe.hidden_size // recipe.num_heads
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    if recipe.arch == "qwen3":
        return Qwen3Config(**text, tie_word_embeddings=True)
    from transformers import Qwen3_5Config

    half_rotary = max(1, head_dim // 8)  # rotary on head_dim / 4, M-RoPE splits its half
    sections = [half_rotary // 3 + (i < half_rotary % 3) for i in range(3)]
    text.update(
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(recipe.num_layers)
        ],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=recipe.num_kv_heads,
        linear_num_value_heads=recipe.num_heads,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": sections,
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=recipe.hidden_size,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
    )
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def load_target(path: Path, dtype=torch.float32):
    """A target saved by :func:`train_target`, either architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    if AutoConfig.from_pretrained(path).model_type == "qwen3_5":
        return Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def train_target(stream, tokenizer, out: Path, recipe: TargetRecipe, device):
    """Train a target (``recipe.arch``) on the token ``stream``; save it (bf16) with
    ``tokenizer``."""
    gen = seed_everything(recipe.seed)
    config = target_config(recipe, tokenizer)
    if recipe.arch == "qwen3":
        model = Qwen3ForCausalLM(config)
    else:
        from transformers import Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration(config)
    model = model.to(device).train()

    def loss_fn(step: int) -> torch.Tensor:
        batch = sample_windows(stream, recipe.batch, recipe.seq_len + 1, gen).to(device)
        with autocast(device):
            logits = model(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), batch[:, 1:].flatten()
        )

    t0 = time.time()
    history = train_loop(
        model,
        loss_fn,
        steps=recipe.steps,
        lr=recipe.lr,
        warmup=recipe.warmup,
        checkpoint=out.parent / f".{out.name}.ckpt",
        desc="target",
    )
    model.eval().to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_log(out, recipe, history, time.time() - t0, model)
    return model


@torch.no_grad()
def distill_stream(
    target,
    stream: torch.Tensor,
    num_tokens: int,
    *,
    prompt_len: int = 64,
    length: int = 512,
    batch: int = 256,
    eos_id: int,
    device,
    seed: int = 0,
    greedy_fraction: float = 0.5,
) -> torch.Tensor:
    """The target's own continuations of random training prompts, joined by ``eos_id``.

    A drafter must predict what the target will say, not what the data says: DFlash trains
    on target outputs. A ``greedy_fraction`` of the batches is greedy, the rest sampled at
    T=0.8.
    """
    if not 0.0 <= greedy_fraction <= 1.0:
        raise ValueError(f"greedy_fraction must be in [0, 1], got {greedy_fraction}")
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed)
    target = target.to(device).eval()
    pieces: list[torch.Tensor] = []
    total = 0
    bar = tqdm(total=num_tokens, desc="distill", mininterval=5)
    step = 0
    while total < num_tokens:
        prompts = sample_windows(stream, batch, prompt_len, gen).to(device)
        greedy = (step + 1) * greedy_fraction // 1 > step * greedy_fraction // 1
        with autocast(device):
            out = target.generate(
                prompts,
                # All ones: a prompt is a window of the stream, never padded; its EOS tokens
                # separate documents and are attended to. As pad == EOS, transformers cannot
                # infer that, warns, and falls back to these same ones.
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=length - prompt_len,
                min_new_tokens=length - prompt_len,
                do_sample=not greedy,
                temperature=None if greedy else 0.8,
                top_k=None,
                top_p=None,
                pad_token_id=eos_id,
            )
        eos = torch.full((out.shape[0], 1), eos_id, device=out.device)
        pieces.append(torch.cat([out, eos], 1).flatten().cpu())
        total += out.numel()
        bar.update(out.numel())
        step += 1
    bar.close()
    return torch.cat(pieces)


def drafter_batch(target, tokens, recipe: DrafterRecipe, mask_token_id: int, gen):
    """Packed training blocks for ``tokens [b, L]``: features, block ids/positions, mask, labels.

    Returns ``(features [b, L, F], positions [b, L], block_ids [b, A*bs], block_positions
    [b, A*bs], mask [b, 1, A*bs, L + A*bs], labels [b, A, bs-1])``.
    """
    b, length = tokens.shape
    bs, num = recipe.block_size, recipe.anchors
    device = tokens.device
    with torch.no_grad():
        hidden = target(input_ids=tokens, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1] for i in recipe.target_layer_ids], -1)
    # Distinct random anchors in [1, L - bs]: each block has context and a full label window.
    scores = torch.rand(b, length - bs, generator=gen).to(device)
    anchors = scores.topk(num, dim=-1).indices + 1  # [b, A]
    offsets = torch.arange(bs, device=device)
    block_positions = (anchors[:, :, None] + offsets).flatten(1)  # [b, A*bs]
    block_ids = torch.full_like(block_positions, mask_token_id)
    block_ids.view(b, num, bs)[:, :, 0] = tokens.gather(1, anchors)
    labels = tokens.gather(1, (anchors[:, :, None] + offsets[1:]).flatten(1)).view(b, num, bs - 1)
    positions = torch.arange(length, device=device).expand(b, length)
    see_context = positions[:, None, :] < anchors.repeat_interleave(bs, 1)[:, :, None]
    block_of = torch.arange(num, device=device).repeat_interleave(bs)
    see_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    mask = torch.cat([see_context, see_block], -1).unsqueeze(1)
    return features, positions, block_ids, block_positions, mask, labels


def train_drafter(stream, target, out: Path, recipe: DrafterRecipe, mask_token_id: int, device):
    """Train a DFlash drafter for the frozen ``target`` on ``stream`` and save it (bf16)."""
    gen = seed_everything(recipe.seed)
    tc = target.config.get_text_config()  # a multimodal target (Qwen3.5): its text model
    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=recipe.intermediate_size or tc.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps,
    )
    config.block_size = recipe.block_size
    config.num_target_layers = tc.num_hidden_layers
    config.dflash_config = {
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(recipe.target_layer_ids),
    }
    drafter = DFlashDraftModel(config).to(device).train()
    target = target.to(device).float().eval().requires_grad_(False)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    weights = torch.exp(-torch.arange(recipe.block_size - 1, device=device) / recipe.gamma)

    def loss_fn(step: int) -> torch.Tensor:
        tokens = sample_windows(stream, recipe.batch, recipe.seq_len, gen).to(device)
        with autocast(device):
            feats, pos, ids, block_pos, mask, labels = drafter_batch(
                target, tokens, recipe, mask_token_id, gen
            )
            ctx = drafter.new_context()
            drafter.extend_context(ctx, feats, pos)
            hidden = drafter(embed(ids), block_pos, ctx, mask)  # [b, A*bs, H]
            b = tokens.shape[0]
            hidden = hidden.view(b, recipe.anchors, recipe.block_size, -1)[:, :, 1:]
            logits = head(hidden).float()  # [b, A, bs-1, V]
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 2), labels.flatten(), reduction="none"
        ).view_as(labels)
        return (loss * weights).sum(-1).mean() / weights.sum()

    t0 = time.time()
    history = train_loop(
        drafter,
        loss_fn,
        steps=recipe.steps,
        lr=recipe.lr,
        warmup=recipe.warmup,
        checkpoint=out.parent / f".{out.name}.ckpt",
        desc="drafter",
        time_limit=recipe.time_limit,
    )
    drafter.eval().to(torch.bfloat16)
    drafter.config.dtype = "bfloat16"
    save_drafter(drafter, out)
    _write_log(out, recipe, history, time.time() - t0, drafter)
    return drafter


def _write_log(out: Path, recipe, history, seconds: float, model: torch.nn.Module) -> None:
    log = {
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(seconds, 1),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "loss_history": history,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
