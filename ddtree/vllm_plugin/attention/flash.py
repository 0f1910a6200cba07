"""vLLM 0.26's FlashAttention KV cache (GPU): the context part of tree attention and KV moves.

The ``FLASH_ATTN`` backend hands each layer its cache as the logical view
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K in the first ``head_size``
channels, V in the rest; indexing the view is independent of the memory order underneath).
FlashAttention knows causal masks only, so the tree's context part is one non-causal
FlashAttention call for all tree requests with ``seqused_k`` = each request's cached length;
the part over the tree's own slots is dense (``merge.suffix_attention``).
"""

from __future__ import annotations

import torch


def read_paged_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[seq_len, num_kv_heads, head_size]`` of one request (the reference reader).

    ``kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]`` (logical view);
    ``block_table [max_blocks]`` lists the request's blocks in order.
    """
    _, num_kv_heads, block_size, width = kv_cache.shape
    used = -(-seq_len // block_size)
    blocks = block_table[:used].to(kv_cache.device, torch.long)
    rows = kv_cache[blocks].permute(0, 2, 1, 3).reshape(used * block_size, num_kv_heads, width)
    rows = rows[:seq_len]
    return rows[..., : width // 2], rows[..., width // 2 :]


def prefix_attention(
    impl,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_queries: torch.Tensor,
    context: torch.Tensor,
    max_queries: int,
    max_context: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tree slot over its request's cached context, one FlashAttention call.

    ``query [N, H, hd]`` (``cu_queries`` int32 ``[R + 1]`` offsets per request),
    ``block_tables`` int32 ``[R, max_blocks]``, ``context`` int32 ``[R]`` cached tokens.
    Returns ``out [N, H, hd]`` and ``lse [N, H]`` (float32).
    """
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    out, lse = flash_attn_varlen_func(
        q=query,
        k=key_cache,
        v=value_cache,
        cu_seqlens_q=cu_queries,
        max_seqlen_q=max_queries,
        seqused_k=context,
        max_seqlen_k=max_context,
        softmax_scale=impl.scale,
        causal=False,
        block_table=block_tables,
        return_softmax_lse=True,
        fa_version=impl.vllm_flash_attn_version,
    )
    if lse.shape[0] != query.shape[0]:  # FlashAttention's varlen lse is [H, N]
        lse = lse.transpose(0, 1)
    return out.float(), lse.float()


def copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """K/V of cache slots ``src [M]`` to slots ``dst [M]`` (gathered, a copy, before writing)."""
    block_size = kv_cache.shape[2]
    rows = kv_cache[src // block_size, :, src % block_size]  # [M, kvh, 2*hd]
    kv_cache[dst // block_size, :, dst % block_size] = rows
