"""KV compaction of every layer and request in one Triton launch; torch reference:
:func:`ddtree.vllm_plugin.attention.flash.copy_slots` (applied to each layer in turn).

The accepted path's K/V moves from cache slot ``src`` to ``dst`` in every layer. A request's moves
may overlap (slot context+3 -> context+2 while context+5 -> context+3), so, like ``copy_slots``,
every move of a request is read before any is written: one program per (layer, request) loads a
tile of all its moves, waits at a barrier, then stores. Requests never share slots (padding moves
copy vLLM's null slot 0 onto itself, which is harmless).

Layers are addressed from the first layer's tensor plus per-layer element offsets
(:class:`KVLayers`, built once, outside any CUDA graph), so one launch covers all of them. Cache
layouts: vLLM 0.26 FlashAttention's logical view ``[num_blocks, kv_heads, block_size,
2 * head_dim]`` (K and V packed in the last dim) and the older ``[2, num_blocks, block_size,
kv_heads, head_dim]``; any strides with a contiguous last dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ddtree.kernels._common import next_pow2


@triton.jit
def _compact_kv_kernel(
    cache_ptr, layer_offsets_ptr, src_ptr, dst_ptr, num_moves, block_size,
    s_part, s_block, s_head, s_offset,
    PARTS: tl.constexpr, HEADS: tl.constexpr, WIDTH: tl.constexpr, MP: tl.constexpr,
    CW: tl.constexpr,
):  # fmt: skip
    layer = tl.program_id(0)
    req = tl.program_id(1)
    base = cache_ptr + tl.load(layer_offsets_ptr + layer)
    move = tl.arange(0, MP)
    ok = move < num_moves
    src = tl.load(src_ptr + req * num_moves + move, mask=ok, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + req * num_moves + move, mask=ok, other=0).to(tl.int64)
    # A slot onto itself moves nothing: the accepted path's prefix on the forced chain (most
    # accepted nodes) and the padding moves cost no memory traffic.
    ok = ok & (src != dst)
    src_at = (src // block_size) * s_block + (src % block_size) * s_offset  # [MP]
    dst_at = (dst // block_size) * s_block + (dst % block_size) * s_offset
    for part in tl.static_range(PARTS):
        for head in range(HEADS):
            for c0 in tl.static_range(0, WIDTH, CW):
                col = c0 + tl.arange(0, CW)
                tile = ok[:, None] & (col < WIDTH)[None, :]
                inner = part * s_part + head * s_head + col  # [CW]
                rows = tl.load(base + src_at[:, None] + inner[None, :], mask=tile)
                tl.debug_barrier()  # all moves of this tile read before any is written
                tl.store(base + dst_at[:, None] + inner[None, :], rows, mask=tile)


class KVLayers:
    """The KV caches of the layers that share one slot mapping (one KV-cache group), a list or a
    stacked tensor, for :func:`compact_kv`. Build it once, outside CUDA graphs (it copies a small
    offset table to the device)."""

    def __init__(self, caches: Sequence[torch.Tensor] | torch.Tensor):
        if isinstance(caches, torch.Tensor):  # stacked: [layers, ...one layer's shape]
            caches = list(caches.unbind(0))
        if not caches:
            raise ValueError("KVLayers: no caches")
        first = caches[0]
        for t in caches:
            if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
                raise ValueError("KVLayers: all layers must share shape, strides and dtype")
            if t.device != first.device:
                raise ValueError("KVLayers: all layers must be on one device")
        if first.stride(-1) != 1:
            raise ValueError("KVLayers: the cache's last dimension must be contiguous")
        size = first.element_size()
        gaps = [t.data_ptr() - first.data_ptr() for t in caches]
        if any(g % size for g in gaps):
            raise ValueError("KVLayers: layer storage is not aligned to the element size")
        self.first = first
        self.offsets = torch.tensor([g // size for g in gaps], dtype=torch.long)
        self.offsets = self.offsets.to(first.device)  # [layers]: element offset from layer 0
        if first.dim() == 4:  # [num_blocks, kv_heads, block_size, 2 * head_dim]
            self.parts, self.s_part = 1, 0
            self.block_size = first.shape[2]
            self.heads, self.width = first.shape[1], first.shape[3]
            self.s_block, self.s_head, self.s_offset = (first.stride(i) for i in (0, 1, 2))
        elif first.dim() == 5 and first.shape[0] == 2:  # [2, num_blocks, block_size, kvh, hd]
            self.parts, self.s_part = 2, first.stride(0)
            self.block_size = first.shape[2]
            self.heads, self.width = first.shape[3], first.shape[4]
            self.s_block, self.s_offset, self.s_head = (first.stride(i) for i in (1, 2, 3))
        else:
            raise ValueError(f"KVLayers: unknown cache layout {tuple(first.shape)}")

    def __len__(self) -> int:
        return self.offsets.shape[0]


def compact_kv(layers: KVLayers, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy K/V of cache slots ``src`` to ``dst`` (``[R, P]`` per request, or ``[M]`` as one
    group) in every layer, all moves of a row read before any of them is written."""
    if src.shape != dst.shape:
        raise ValueError(f"compact_kv: src {tuple(src.shape)} and dst {tuple(dst.shape)} differ")
    if src.dim() == 1:
        src, dst = src[None], dst[None]
    src, dst = src.contiguous(), dst.contiguous()
    num_reqs, num_moves = src.shape
    if num_reqs == 0 or num_moves == 0:
        return
    moves = next_pow2(num_moves)
    col_width = min(next_pow2(layers.width), max(16, 4096 // moves))
    _compact_kv_kernel[(len(layers), num_reqs)](
        layers.first, layers.offsets, src, dst, num_moves, layers.block_size,
        layers.s_part, layers.s_block, layers.s_head, layers.s_offset,
        PARTS=layers.parts, HEADS=layers.heads, WIDTH=layers.width, MP=moves, CW=col_width,
        num_warps=4,
    )  # fmt: skip
