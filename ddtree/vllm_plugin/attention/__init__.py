"""Tree-masked attention and KV moves per vLLM attention backend.

- ``cpu``: vLLM's CPU attention cache layout (SDPA over K/V read back; the reference);
- ``flash``: FlashAttention's cache layout (context part via FlashAttention, KV moves);
- ``triton_kernel``: one Triton kernel per layer over FlashAttention's layout (GPU default);
- ``merge``: the dense tree part and the log-sum-exp merge of two attention parts.
"""

from __future__ import annotations

import torch

from ddtree.vllm_plugin.attention import cpu, flash
from ddtree.vllm_plugin.attention.merge import merge, suffix_attention
from ddtree.vllm_plugin.debug import sync_checked

# The attention implementations whose KV layout the tree path reads and compacts.
SUPPORTED_IMPLS = ("CPUAttentionBackendImpl", "FlashAttentionImpl")


def check_impl(layer_name: str, impl) -> None:
    name = type(impl).__name__
    if name not in SUPPORTED_IMPLS:
        raise NotImplementedError(
            f"ddtree: target layer {layer_name} uses {name}; the tree mask is wired into "
            f"{SUPPORTED_IMPLS} only (on the GPU: attention_backend=FLASH_ATTN)"
        )


def _is_cpu(impl) -> bool:
    return hasattr(impl, "isa")  # vLLM's CPU attention


@sync_checked
def tree_attention(engine, impl, query, key, value, kv_cache, output, group: int) -> None:
    """The tree requests' rows of ``output``: each slot over the cached context and its
    ancestors. ``engine.batch`` describes the step's trees; ``group`` is the layer's KV group."""
    with engine.attention_span():
        tb = engine.batch
        if engine.settings.tree_attention != "merge" and not _is_cpu(impl):
            from ddtree.vllm_plugin.attention import triton_kernel

            triton_kernel.tree_attention(
                query,
                key,
                value,
                kv_cache,
                output.view(query.shape),
                tb.rows,
                tb.counts,
                tb.tree.mask,
                tb.context_i32,
                tb.block_tables[group],
                impl.scale,
            )
            return
        query_flat = query.index_select(0, tb.flat_rows)  # [N, H, hd]
        if _is_cpu(impl):
            out_p, lse_p = cpu.prefix_attention(
                query_flat,
                kv_cache,
                tb.block_tables[group],
                tb.context_cpu,
                tb.counts_cpu,
                impl.scale,
            )
        else:
            out_p, lse_p = flash.prefix_attention(
                impl,
                query_flat,
                kv_cache,
                tb.block_tables[group],
                tb.cu_queries,
                tb.context_i32,
                tb.rows.shape[1],
                tb.max_context,
            )
        out_s, lse_s = suffix_attention(query, key, value, tb.rows, tb.tree.mask, impl.scale)
        out_s, lse_s = out_s.index_select(0, tb.flat_slots), lse_s.index_select(0, tb.flat_slots)
        merged = merge(out_p, lse_p, out_s, lse_s).view((-1,) + output.shape[1:])
        output.index_copy_(0, tb.flat_rows, merged.to(output.dtype))


def copy_slots(impl, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """K/V of cache slots ``src [M]`` to ``dst [M]`` in one layer's cache (reads first)."""
    if _is_cpu(impl):
        cpu.copy_slots(kv_cache, src, dst, impl.isa)
    else:
        flash.copy_slots(kv_cache, src, dst)
