"""Real model shapes with dummy weights for ``ddtree bench --dummy-shapes`` and
``benchmarks/profile_step.py``: config.json-only checkpoints of a target and a DFlash drafter
(vLLM's ``load_format="dummy"`` fills random weights)."""

from __future__ import annotations

import json
from pathlib import Path

# Qwen3-8B's shapes, and a DFlash drafter of z-lab's Qwen3-8B-DFlash-b16 shapes (5 layers).
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=151643,
    eos_token_id=151645,
    attention_bias=False,
    attention_dropout=0.0,
)
DFLASH_8B = dict(
    QWEN3_8B,
    architectures=["DFlashDraftModel"],
    num_hidden_layers=5,
    block_size=16,
    num_target_layers=36,
    dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
)

# Qwen3.6-27B's shapes (vLLM loads it as Qwen3_5ForConditionalGeneration, text only here):
# 64 layers, every 4th full attention (24 query / 4 KV heads of 256, gated, M-RoPE on a quarter
# of each head), the other 48 Gated DeltaNet (16 key / 48 value heads of 128, conv width 4),
# one MTP layer (vLLM's "mtp" method). The attention and MLP shapes follow the public Qwen3.5-27B
# recipe, the GDN heads issue 21; the vision tower is a stub (never run: language_model_only).
QWEN36_27B_TEXT = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attn_output_gate=True,
    mtp_num_hidden_layers=1,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    bos_token_id=248044,
    eos_token_id=248044,
)
QWEN36_27B = dict(
    architectures=["Qwen3_5ForConditionalGeneration"],
    model_type="qwen3_5",
    text_config=QWEN36_27B_TEXT,
    vision_config=dict(
        depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=5120,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
    ),
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)  # fmt: skip
# A DFlash drafter of z-lab's Qwen3.6 drafter's published outline (5 layers reading target
# layers 1, 16, 31, 46, 61); its head counts and sliding window are assumptions.
DFLASH_27B = dict(
    QWEN3_8B,
    architectures=["DFlashDraftModel"],
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    layer_types=["sliding_attention"] * 4 + ["full_attention"],
    sliding_window=2048,
    block_size=16,
    num_target_layers=64,
    # The window goes in dflash_config: transformers' Qwen3Config drops a top-level
    # sliding_window unless use_sliding_window, and vLLM then refuses the sliding layers.
    dflash_config={
        "mask_token_id": 248077,
        "target_layer_ids": [1, 16, 31, 46, 61],
        "swa_window_size": 2048,
    },
    bos_token_id=248044,
    eos_token_id=248044,
)
DUMMY_SHAPES = {
    "qwen3-8b": ("qwen3_8b_shapes", QWEN3_8B, "dflash_8b_shapes", DFLASH_8B),
    "qwen3.6-27b": ("qwen3_6_27b_shapes", QWEN36_27B, "dflash_27b_shapes", DFLASH_27B),
}


def write_dummy_shapes(out: Path, shapes: str = "qwen3-8b") -> tuple[Path, Path]:
    """config.json-only checkpoints (vLLM's ``load_format="dummy"`` fills random weights)."""
    target_name, target_config, draft_name, draft_config = DUMMY_SHAPES[shapes]
    target, drafter = out / target_name, out / draft_name
    for path, config in ((target, target_config), (drafter, draft_config)):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return target, drafter
