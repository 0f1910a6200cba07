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


def _over_context(
    impl, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_queries: torch.Tensor, context: torch.Tensor, max_queries: int, max_context: int,
    **extra,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One non-causal FlashAttention call: each request's query rows (``cu_queries``) over its
    first ``context`` cached tokens, K/V viewed as vLLM's backend views them. ``extra``:
    more ``flash_attn_varlen_func`` arguments. Returns ``out [N, H, hd]`` and ``lse``
    ``[N, H]``-indexed (FlashAttention's dtypes)."""
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    # as vLLM's backend does: size-1 dims (one KV head per rank) get TMA-aligned strides
    key_cache = canonicalize_singleton_dim_strides(key_cache)
    value_cache = canonicalize_singleton_dim_strides(value_cache)
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
        **extra,
    )
    if lse.shape[0] != query.shape[0]:  # FlashAttention's varlen lse is [H, N]
        lse = lse.transpose(0, 1)
    return out, lse


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
    out, lse = _over_context(
        impl, query, kv_cache, block_tables, cu_queries, context, max_queries, max_context
    )
    return out.float(), lse.float()


def context_attention(
    impl, query: torch.Tensor, kv_cache: torch.Tensor, metadata, context: torch.Tensor,
    out: torch.Tensor,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The V2 runner's ``DDTREE_TREE_ATTENTION=flash``: every row of the step over its request's
    cached context (the step's own slots excluded), one non-causal FlashAttention call on the
    backend's metadata, so that the context part rounds as vLLM's own attention does.

    ``query [T, H, hd]``; ``context`` int32 ``[>= R]`` and ``out [>= T, H, hd]`` persistent
    buffers (written here). Returns ``paged_tree_attention``'s ``context_out`` / ``context_lse``
    (lse ``[T, H]``-indexed, float32). ``num_splits=1``: FlashAttention's split heuristic is
    not CUDA-graph safe (vLLM's backend bounds it for graphs; one split needs no workspace).
    """
    qsl = metadata.query_start_loc  # [R + 1]
    num_reqs, num_rows = qsl.shape[0] - 1, query.shape[0]
    cached = context[:num_reqs]
    torch.sub(metadata.seq_lens[:num_reqs], qsl[1:], out=cached)  # seq_len - (end - start)
    cached.add_(qsl[:-1]).clamp_(min=0)  # padding rows: 0
    _, lse = _over_context(
        impl, query, kv_cache, metadata.block_table, qsl, cached, metadata.max_query_len,
        metadata.max_seq_len, out=out[:num_rows], num_splits=1,
    )  # fmt: skip
    return {"context_out": out[:num_rows], "context_lse": lse}


def copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """K/V of cache slots ``src [M]`` to slots ``dst [M]`` (gathered, a copy, before writing)."""
    block_size = kv_cache.shape[2]
    rows = kv_cache[src // block_size, :, src % block_size]  # [M, kvh, 2*hd]
    kv_cache[dst // block_size, :, dst % block_size] = rows
