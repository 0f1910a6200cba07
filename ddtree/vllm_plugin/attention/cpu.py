"""Tree-masked attention over vLLM's paged CPU KV cache, and KV compaction of accepted paths.

vLLM's CPU attention kernel (``CPU_ATTN``) knows causal and non-causal masks only. For a
DDTree verify step (``attention.tree_attention``) the part over the cached context is computed here:
each request's K/V read back out of the paged cache, one SDPA per request (the CPU is the
correctness host, not the fast one). ``copy_slots`` moves accepted K/V within the cache.

Cache layout (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``) for the ``vec`` and
``vec16`` kernel variants: per (block, kv head), the first ``block_size * head_size`` values
hold K column-major (``[head_size, block_size]``), the rest V row-major
(``[block_size, head_size]``). The ``amx`` variant packs tiles differently and is refused.
"""

from __future__ import annotations

import torch

from ddtree.vllm_plugin.attention.merge import attend_with_lse

SUPPORTED_ISAS = ("vec", "vec16")


def check_isa(isa: str) -> None:
    if isa not in SUPPORTED_ISAS:
        raise NotImplementedError(
            f"ddtree: CPU tree attention supports the {SUPPORTED_ISAS} KV layouts, not {isa!r} "
            "(the AMX layout is chosen for bfloat16 with a block size that is a multiple of 32: "
            "use dtype float32 or another block_size)"
        )


def _key_value_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the cache as K ``[blocks, kvh, hd, block]`` and V ``[blocks, kvh, block, hd]``."""
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    head_size = width // 2
    raw = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_size)
    keys = raw[:, :, 0].view(num_blocks, num_kv_heads, head_size, block_size)
    values = raw[:, :, 1].view(num_blocks, num_kv_heads, block_size, head_size)
    return keys, values


def read_paged_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[seq_len, num_kv_heads, head_size]`` of one request.

    ``kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]``; ``block_table [max_blocks]``
    lists the request's blocks in order.
    """
    _, num_kv_heads, block_size, width = kv_cache.shape
    used = -(-seq_len // block_size)
    blocks = block_table[:used].long()
    all_keys, all_values = _key_value_views(kv_cache)
    keys = all_keys[blocks].permute(0, 3, 1, 2)  # [used, block, kvh, hd]
    values = all_values[blocks].permute(0, 2, 1, 3)  # [used, block, kvh, hd]
    keys = keys.reshape(used * block_size, num_kv_heads, width // 2)[:seq_len]
    values = values.reshape(used * block_size, num_kv_heads, width // 2)[:seq_len]
    return keys, values


def prefix_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context: list[int],
    counts: list[int],
    scale: float,
    read=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tree slot over its request's cached context: float32 ``out [N, H, hd]``, ``lse
    [N, H]``. ``query [N, H, hd]`` holds ``counts[r]`` rows per request r (in order),
    ``block_tables [R, max_blocks]``, ``context[r]`` cached tokens. One SDPA per request over
    K/V read back from the cache with ``read`` (default: this module's layout)."""
    read = read or read_paged_kv
    outs, lses, first = [], [], 0
    for r, (seq_len, count) in enumerate(zip(context, counts, strict=True)):
        keys, values = read(kv_cache, block_tables[r], seq_len)
        out, lse = attend_with_lse(query[first : first + count], keys, values, scale)
        outs.append(out)
        lses.append(lse)
        first += count
    return torch.cat(outs), torch.cat(lses)


def copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, isa: str) -> None:
    """K/V of cache slots ``src [M]`` to slots ``dst [M]`` (all read before any is written)."""
    from vllm import _custom_ops as ops

    check_isa(isa)
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    keys, values = _key_value_views(kv_cache)
    block, offset = src // block_size, src % block_size
    src_keys = keys[block, :, :, offset]  # [M, kvh, hd] (a copy)
    src_values = values[block, :, offset]  # [M, kvh, hd]
    view = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, width // 2)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(src_keys, src_values, key_cache, value_cache, dst, isa)
