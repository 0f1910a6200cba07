"""Tree-masked attention over vLLM's paged CPU KV cache, and KV compaction of accepted paths.

vLLM's CPU attention kernel (``CPU_ATTN``) knows causal and non-causal masks only. For a
DDTree verify step a request's queries are ``[root, node 1..B]`` and node i may see the whole
context plus its ancestors in the tree. This module reads the request's K/V back out of the
paged cache and runs one SDPA with that mask.

Cache layout (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``) for the ``vec`` and
``vec16`` kernel variants: per (block, kv head), the first ``block_size * head_size`` values
hold K column-major (``[head_size, block_size]``), the rest V row-major
(``[block_size, head_size]``). The ``amx`` variant packs tiles differently and is refused.
"""

from __future__ import annotations

import torch

SUPPORTED_ISAS = ("vec", "vec16")


def check_isa(isa: str) -> None:
    if isa not in SUPPORTED_ISAS:
        raise NotImplementedError(
            f"ddtree: CPU tree attention supports the {SUPPORTED_ISAS} KV layouts, not {isa!r} "
            "(the AMX layout is chosen for bfloat16 with a block size that is a multiple of 32: "
            "use dtype float32 or another block_size)"
        )


def read_paged_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[seq_len, num_kv_heads, head_size]`` of one request.

    ``kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]``; ``block_table [max_blocks]``
    lists the request's blocks in order.
    """
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    head_size = width // 2
    used = -(-seq_len // block_size)
    blocks = block_table[:used].long()
    raw = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_size)[blocks]  # [n, h, 2, .]
    keys = raw[:, :, 0].view(used, num_kv_heads, head_size, block_size).permute(0, 3, 1, 2)
    values = raw[:, :, 1].view(used, num_kv_heads, block_size, head_size).permute(0, 2, 1, 3)
    keys = keys.reshape(used * block_size, num_kv_heads, head_size)[:seq_len]
    values = values.reshape(used * block_size, num_kv_heads, head_size)[:seq_len]
    return keys, values


def tree_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    tree_mask: torch.Tensor,
    scale: float,
    read=read_paged_kv,
) -> torch.Tensor:
    """Attention of one request's ``query [q, num_heads, head_size]`` (its last q tokens).

    Every query sees the first ``seq_len - q`` cached tokens; among the q new ones, query i
    sees j iff ``tree_mask[i, j]`` (bool ``[q, q]``). Returns ``[q, num_heads, head_size]``.
    ``read`` gets K/V out of the cache's layout (this module's: the CPU one).
    """
    keys, values = read(kv_cache, block_table, seq_len)  # [L, kvh, hd]
    return attend(query, keys, values, tree_mask, scale)


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``query [q, heads, hd]`` over ``keys/values [L, kv_heads, hd]`` whose last q rows are
    the queries' own tokens: all earlier rows are seen, the last q as ``tree_mask [q, q]`` says."""
    num_queries, num_heads, _ = query.shape
    context = keys.shape[0] - num_queries
    seen = torch.ones(num_queries, context, dtype=torch.bool, device=query.device)
    mask = torch.cat([seen, tree_mask.to(query.device, torch.bool)], 1)  # [q, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).to(keys.dtype),  # [heads, q, hd]
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != keys.shape[1],
    )
    return out.transpose(0, 1).to(query.dtype)


def compact_paged_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    path: torch.Tensor,
    isa: str,
) -> None:
    """Move the K/V of tree slots ``start + path[k]`` to ``start + k`` (k = 0..len(path)-1).

    ``path`` (long ``[n]``, increasing, ``path[k] >= k``) is the accepted path from the root;
    after this the accepted tokens sit where a chain would have put them. All rows are read
    before any is written.
    """
    from vllm import _custom_ops as ops

    check_isa(isa)
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    keys, values = read_paged_kv(kv_cache, block_table, start + int(path[-1]) + 1)
    src = start + path.long()
    dst = start + torch.arange(path.numel(), device=path.device)
    slots = block_table[dst // block_size].long() * block_size + dst % block_size
    view = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, width // 2)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys[src].contiguous(), values[src].contiguous(), key_cache, value_cache, slots, isa
    )
