"""Tree-masked attention over vLLM's paged FlashAttention KV cache (GPU), and KV compaction.

vLLM 0.26's ``FLASH_ATTN`` backend hands each layer its cache as the logical view
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K in the first ``head_size``
channels, V in the rest; the memory order underneath is the backend's business, indexing the
view is layout-agnostic). FlashAttention knows causal masks only, so for a DDTree verify step
each tree request's attention is redone here: its K/V read back from the cache, one SDPA with
the mask "the whole context + the node's ancestors".

This is the correctness path (per-request, eager, outside CUDA graphs; vLLM's piecewise graphs
keep attention eager). The fused, graph-captured kernel is issue 6's work.
"""

from __future__ import annotations

import torch

from ddtree.vllm_plugin import cpu_tree_attention


def read_paged_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[seq_len, num_kv_heads, head_size]`` of one request.

    ``kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]`` (logical view);
    ``block_table [max_blocks]`` lists the request's blocks in order.
    """
    _, num_kv_heads, block_size, width = kv_cache.shape
    used = -(-seq_len // block_size)
    blocks = block_table[:used].to(kv_cache.device, torch.long)
    rows = kv_cache[blocks].permute(0, 2, 1, 3).reshape(used * block_size, num_kv_heads, width)
    rows = rows[:seq_len]
    return rows[..., : width // 2], rows[..., width // 2 :]


def tree_attention(query, kv_cache, block_table, seq_len, tree_mask, scale) -> torch.Tensor:
    """``cpu_tree_attention.tree_attention`` over this layout (same arguments and result)."""
    return cpu_tree_attention.tree_attention(
        query, kv_cache, block_table, seq_len, tree_mask, scale, read=read_paged_kv
    )


def compact_paged_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, start: int, path: torch.Tensor
) -> None:
    """Move the K/V of tree slots ``start + path[k]`` to ``start + k`` (k = 0..len(path)-1).

    ``path`` (long ``[n]``, increasing, ``path[k] >= k``) is the accepted path from the root.
    The source rows are gathered (a copy) before any row is written.
    """
    block_size = kv_cache.shape[2]
    table = block_table.to(kv_cache.device, torch.long)
    src = start + path.to(kv_cache.device, torch.long)
    dst = start + torch.arange(path.numel(), device=kv_cache.device)
    rows = kv_cache[table[src // block_size], :, src % block_size]  # [n, kvh, 2*hd], a copy
    kv_cache[table[dst // block_size], :, dst % block_size] = rows
