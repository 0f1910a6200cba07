"""The one-kernel tree attention (Triton) equals the merged path, run with Triton's CPU
interpreter on FlashAttention's cache layout: 2 requests (one with unscheduled slots) inside a
step with other rows, grouped-query heads."""

import pytest
import torch

import ddtree
from ddtree.vllm_plugin.attention.cpu import prefix_attention
from ddtree.vllm_plugin.attention.flash import read_paged_kv
from ddtree.vllm_plugin.attention.merge import merge, suffix_attention

from helpers import run_interpreted

HEADS, KV_HEADS, HEAD, BLOCK = 4, 2, 16, 16


pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def test_kernel_equals_the_merged_path():
    """Runs this file's checks under Triton's interpreter (``helpers.run_interpreted``)."""
    pytest.importorskip("triton")
    run_interpreted(__file__)


def check():
    from ddtree.vllm_plugin.attention import triton_kernel as kernel_module

    gen = torch.Generator().manual_seed(0)
    num_slots = 20
    trees = ddtree.build_tree(torch.randn(2, 4, 12, generator=gen) * 2, num_slots - 1)
    contexts, counts = [37, 70], [20, 9]
    num_blocks = 16
    memory = torch.randn(num_blocks, BLOCK, KV_HEADS, 2 * HEAD, generator=gen)
    kv_cache = memory.permute(0, 2, 1, 3)  # the logical view vLLM passes (NHD memory)
    tables = torch.tensor([[3, 7, 1, 0, 0], [9, 2, 12, 5, 14]], dtype=torch.int32)
    num_rows = 3 + sum(counts)
    query = torch.randn(num_rows, HEADS, HEAD, generator=gen)
    key = torch.randn(num_rows, KV_HEADS, HEAD, generator=gen)
    value = torch.randn(num_rows, KV_HEADS, HEAD, generator=gen)
    # Step rows: 2 unrelated, request 0 (20 rows), 1 unrelated, request 1 (9 of 20 scheduled).
    rows = torch.zeros(2, num_slots, dtype=torch.long)
    rows[0] = torch.arange(2, 22)
    rows[1] = 23
    rows[1, :9] = torch.arange(23, 32)
    scheduled = torch.arange(num_slots) < torch.tensor(counts)[:, None]
    flat_slots = scheduled.flatten().nonzero().squeeze(1)
    flat_rows = rows.flatten()[flat_slots]
    scale = HEAD**-0.5

    out_p, lse_p = prefix_attention(
        query[flat_rows], kv_cache, tables, contexts, counts, scale, read=read_paged_kv
    )
    out_s, lse_s = suffix_attention(query, key, value, rows, trees.mask, scale)
    want = merge(out_p, lse_p, out_s[flat_slots], lse_s[flat_slots])

    output = torch.full_like(query, 7.0)
    kernel_module.tree_attention(
        query,
        key,
        value,
        kv_cache,
        output,
        rows,
        torch.tensor(counts, dtype=torch.int32),
        trees.mask,
        torch.tensor(contexts, dtype=torch.int32),
        tables,
        scale,
    )
    torch.testing.assert_close(output[flat_rows], want, atol=1e-4, rtol=1e-4)
    others = torch.ones(num_rows, dtype=torch.bool)
    others[flat_rows] = False
    assert (output[others] == 7.0).all()  # rows of other requests untouched


if __name__ == "__main__":
    check()
