"""DFlash block-diffusion drafter in PyTorch, loading z-lab checkpoints as they are.

The drafter sees the target's hidden states at ``target_layer_ids`` (outputs of those decoder
layers, HF ``hidden_states[id + 1]``), concatenated, fused by ``fc`` + ``hidden_norm`` and fed as
extra K/V rows to every draft layer. One non-causal forward over ``[last token, MASK x
(block_size - 1)]`` (embedded by the target's embedding) gives, through the target's LM head, a
distribution for each of the next ``block_size - 1`` positions.

Checkpoint: ``config.json`` (a Qwen3 config plus ``architectures: ["DFlashDraftModel"]``,
``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``)
and ``model.safetensors`` with ``fc``, ``hidden_norm``, ``norm`` and ``layers.N.*``: no
embedding and no LM head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)


class DFlashConfigError(ValueError):
    """A drafter checkpoint that does not fit its target."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced target layers from 1 to L-3 (the middle layer for a one-layer drafter);
    for small targets the range grows towards L-1 so that the layers stay distinct."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first = max(min(1, num_target_layers - num_draft_layers), 0)
    last = min(max(num_target_layers - 3, first + num_draft_layers - 1), num_target_layers - 1)
    step = (last - first) / (num_draft_layers - 1)
    return [int(round(first + i * step)) for i in range(num_draft_layers)]


@dataclass
class DFlashSettings:
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]


def read_settings(config: Qwen3Config) -> DFlashSettings:
    """The DFlash fields of a drafter config, with the documented defaults."""
    dflash = getattr(config, "dflash_config", None) or {}
    if "mask_token_id" not in dflash:
        raise DFlashConfigError("drafter config.json has no dflash_config.mask_token_id")
    block_size = getattr(config, "block_size", None)
    if not isinstance(block_size, int) or block_size < 2:
        raise DFlashConfigError(f"drafter block_size must be an int >= 2, got {block_size!r}")
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        num_target = getattr(config, "num_target_layers", None)
        if num_target is None:
            raise DFlashConfigError(
                "drafter config.json has neither dflash_config.target_layer_ids "
                "nor num_target_layers"
            )
        layer_ids = default_target_layer_ids(num_target, config.num_hidden_layers)
    layer_ids = [int(i) for i in layer_ids]
    if len(set(layer_ids)) != len(layer_ids):
        raise DFlashConfigError(
            f"target_layer_ids {layer_ids} repeat a layer (engines capture each layer once): "
            "set dflash_config.target_layer_ids explicitly"
        )
    return DFlashSettings(block_size, int(dflash["mask_token_id"]), layer_ids)


class DFlashAttention(nn.Module):
    """Non-causal attention of the block over [context features, block]."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        sliding = layer_types is not None and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (normed, rotated) and V ``[b, kv_heads, n, head_dim]`` of rows ``x [b, n, H]``."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, x, cos, sin, ctx_k, ctx_v, positions, ctx_positions, mask=None):
        """``mask`` (bool ``[b, 1, n, ctx+n]``, True = attend) restricts what the block sees."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        k = torch.cat([ctx_k, k], 2)
        v = torch.cat([ctx_v, v], 2)
        if self.sliding_window is not None:
            key_positions = torch.cat([ctx_positions, positions], -1)  # [b, ctx+n]
            window = (positions[:, None, :, None] - key_positions[:, None, None, :]) < (
                self.sliding_window
            )
            mask = window if mask is None else mask & window
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, positions, ctx_positions, mask=None):
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, ctx_k, ctx_v, positions, ctx_positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftContext:
    """Per-request drafter cache: the context K/V of every draft layer and their positions."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # long [b, ctx]

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]


class DFlashDraftModel(nn.Module):
    """The z-lab DFlash drafter: ``fc`` + ``hidden_norm``, Qwen3-style layers, final ``norm``."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.settings = read_settings(config)
        width = len(self.settings.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    def new_context(self) -> DraftContext:
        return DraftContext(len(self.layers))

    def extend_context(
        self, ctx: DraftContext, target_features: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Append target features ``[b, n, len(ids) * H]`` at ``positions [b, n]`` to ``ctx``."""
        rows = self.hidden_norm(self.fc(target_features))
        cos, sin = self.rotary_emb(rows, positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(rows, cos, sin)
            if ctx.keys[i] is not None:
                k, v = torch.cat([ctx.keys[i], k], 2), torch.cat([ctx.values[i], v], 2)
            ctx.keys[i], ctx.values[i] = k, v
        ctx.positions = (
            positions if ctx.positions is None else torch.cat([ctx.positions, positions], 1)
        )

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx: DraftContext,
        mask: torch.Tensor | None = None,
    ):
        """Hidden states ``[b, n, H]`` of the block tokens ``block_embeds`` at ``positions``.

        Without ``mask`` every block token sees the whole context and the whole block; training
        packs several blocks and passes a bool ``mask [b, 1, n, ctx+n]``.
        """
        if ctx.positions is None:
            raise ValueError("the drafter needs target context: call extend_context first")
        cos, sin = self.rotary_emb(block_embeds, positions)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx.keys[i], ctx.values[i], positions, ctx.positions, mask)
        return self.norm(x)


def check_pair(drafter_config: Qwen3Config, target_config) -> None:
    """Raise DFlashConfigError if a drafter with ``drafter_config`` cannot serve this target."""
    cfg, s = drafter_config, read_settings(drafter_config)
    if hasattr(target_config, "get_text_config"):  # a multimodal target (Qwen3.5): its text model
        target_config = target_config.get_text_config()
    if cfg.hidden_size != target_config.hidden_size:
        raise DFlashConfigError(
            f"drafter hidden_size {cfg.hidden_size} != target hidden_size "
            f"{target_config.hidden_size}"
        )
    if cfg.vocab_size != target_config.vocab_size:
        raise DFlashConfigError(
            f"drafter vocab_size {cfg.vocab_size} != target vocab_size {target_config.vocab_size}"
        )
    if not 0 <= s.mask_token_id < target_config.vocab_size:
        raise DFlashConfigError(
            f"mask_token_id {s.mask_token_id} is not in the target's vocabulary "
            f"(size {target_config.vocab_size})"
        )
    num_layers = target_config.num_hidden_layers
    bad = [i for i in s.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise DFlashConfigError(
            f"target_layer_ids {bad} out of range for a target with {num_layers} layers"
        )


def read_config(config_path: Path) -> Qwen3Config:
    """A drafter's config.json as a Qwen3Config carrying the DFlash fields."""
    raw = json.loads(config_path.read_text())
    archs = raw.get("architectures") or []
    if "DFlashDraftModel" not in archs:
        raise DFlashConfigError(f"{config_path}: architectures {archs} lack DFlashDraftModel")
    config = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    for key in ("block_size", "dflash_config", "num_target_layers"):
        if key in raw:
            setattr(config, key, raw[key])
    return config


def load_drafter(
    path: str | Path,
    target_config=None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> DFlashDraftModel:
    """Load a z-lab format drafter; with ``target_config``, check that it fits the target."""
    from safetensors.torch import load_file

    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise DFlashConfigError(f"no config.json in drafter directory {path}")
    config = read_config(config_path)
    drafter = DFlashDraftModel(config)
    if target_config is not None:
        check_pair(config, target_config)
    weights_path = path / "model.safetensors"
    if not weights_path.is_file():
        raise DFlashConfigError(f"no model.safetensors in drafter directory {path}")
    state = load_file(str(weights_path))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise DFlashConfigError(
            f"drafter weights do not match the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return drafter.to(device=device, dtype=dtype).eval()


def save_drafter(drafter: DFlashDraftModel, path: str | Path) -> None:
    """Write ``drafter`` in the z-lab format (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = drafter.config.to_dict()
    config["architectures"] = ["DFlashDraftModel"]
    s = drafter.settings
    config["block_size"] = s.block_size
    config["dflash_config"] = {
        "mask_token_id": s.mask_token_id,
        "target_layer_ids": s.target_layer_ids,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    state = {k: v.contiguous() for k, v in drafter.state_dict().items() if "rotary_emb" not in k}
    save_file(state, str(path / "model.safetensors"))
