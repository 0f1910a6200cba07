"""The paged tree attention kernel (for full CUDA graphs) against a per-slot reference, run with
Triton's CPU interpreter: tree requests with full and clipped trees, a prefill request and a
padded request that it must leave alone, grouped-query heads (also a group that is not a power
of two), the cache in FlashAttention's logical view over NHD memory; rows before
``first_slot`` (a forced chain, computed by the backend) left alone; the context part given
(FlashAttention's output and log-sum-exp) instead of read by the kernel; programs past a
request's slots (the grid covers the step's longest query, a prefill's in a mixed step) read
nothing."""

import pytest
import torch

import ddtree
from ddtree.vllm_plugin.attention.merge import attend_with_lse

from helpers import run_interpreted

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def test_kernel_equals_the_reference():
    """Runs this file's checks under Triton's interpreter (``helpers.run_interpreted``)."""
    pytest.importorskip("triton")
    run_interpreted(__file__)


def test_context_splits_are_refused_with_a_given_context():
    from ddtree.vllm_plugin.attention.paged_tree_kernel import paged_tree_attention

    t = torch.zeros(4, 2, 16)
    cache = torch.zeros(2, 1, 16, 32)
    ints = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="context_splits 2"):
        paged_tree_attention(
            t, cache, t, ints, ints[:1], ints[None], ints[:1], ints[None], ints[None, :, None],
            0.25, 4, context_splits=2, context_out=t, context_lse=t[:, :, 0],
        )  # fmt: skip
    with pytest.raises(ValueError, match="context_splits 0"):
        paged_tree_attention(
            t, cache, t, ints, ints[:1], ints[None], ints[:1], ints[None], ints[None, :, None],
            0.25, 4, context_splits=0,
        )  # fmt: skip


def test_timing_script_runs_its_smoke_case(tmp_path):
    """benchmarks/paged_tree_time.py (GPU time is scarce: a crash there costs a lease) on
    tiny shapes under the interpreter: its three launch shapes (the default, one with warps and
    stages given, one with the context in two shares), the engine's auto shares and the default
    on a mixed step's grid write the same rows, JSON and table."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "paged_tree_time.py"
    out = tmp_path / "t.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == [
        "rpp64/n32/wd/sd/k1", "rpp16/n16/w8/s1/k1", "rpp64/n32/wd/sd/k2", "engine_auto",
        "mixed_grid",
    ]  # fmt: skip
    assert all(r["max_abs_diff_vs_default"] < 1e-4 for r in rows)
    # the engine's auto shares for 2 trees of 23 slots, 2 KV heads, on 132 SMs (no GPU here)
    assert rows[3]["context_splits"] == 4
    table = out.with_suffix(".md").read_text()
    assert "| 2 | 23 | 20 |" in table and "| mixed grid us |" in table
    assert out.with_suffix(".png").stat().st_size > 0


def check(
    heads: int,
    kv_heads: int,
    head: int = 16,
    block: int = 16,
    first_slot: int = 0,
    context_given: bool = False,
    splits: int = 1,
    block_n: int = 32,
    scratch_shares: int = 0,
) -> None:
    from ddtree.vllm_plugin.attention.paged_tree_kernel import paged_tree_attention, split_scratch

    gen = torch.Generator().manual_seed(heads)
    budget, depth = 23, 4
    trees = ddtree.build_tree(torch.randn(3, depth, 12, generator=gen) * 2, budget)
    num_slots = budget + 1
    # Requests: tree (all slots), prefill (no tree), tree clipped to 9 slots, padding.
    counts, contexts = [num_slots, 7, 9, 0], [37, 5, 70, 0]
    tree_rows = torch.tensor([2, -1, 0, -1], dtype=torch.int32)  # rows of the tree tables
    qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(
        [c + n for c, n in zip(contexts, counts, strict=True)], dtype=torch.int32
    )
    num_blocks = 24
    tables = torch.randperm(num_blocks, generator=gen)[: 4 * 6].view(4, 6).int()
    memory = torch.randn(num_blocks, block, kv_heads, 2 * head, generator=gen)
    kv_cache = memory.permute(0, 2, 1, 3)  # the logical view vLLM passes (NHD memory)
    num_rows = int(qsl[-1])
    query = torch.randn(num_rows, heads, head, generator=gen)
    poison = 1234.5
    output = torch.full_like(query, poison)
    depths = trees.depths.int().contiguous()
    ancestors = trees.ancestors.int().contiguous()

    def cached(r, positions):
        pos = torch.tensor(positions, dtype=torch.long)
        rows = kv_cache[tables[r, pos // block].long(), :, pos % block]  # [n, kvh, 2hd]
        return rows[..., :head], rows[..., head:]

    given = {}
    if context_given:  # every row over its request's context, as FlashAttention returns it
        context_out = torch.full_like(query, float("nan"))
        lse_heads_first = torch.full((heads, num_rows), float("nan"))  # FlashAttention's [H, T]
        for r in range(4):
            rows = slice(int(qsl[r]), int(qsl[r + 1]))
            out, lse = attend_with_lse(query[rows], *cached(r, range(contexts[r])), head**-0.5)
            context_out[rows], lse_heads_first[:, rows] = out, lse.T
        given = dict(context_out=context_out, context_lse=lse_heads_first.T)
    if scratch_shares:  # the engine's scratch is as wide as the most shares: a slice of it
        wide = split_scratch(num_rows, heads, scratch_shares, head, "cpu")
        given = dict(partials=(wide[0][:, :, :splits], wide[1][:, :, :splits]))
    paged_tree_attention(
        query,
        kv_cache,
        output,
        qsl,
        seq_lens,
        tables,
        tree_rows,
        depths,
        ancestors,
        head**-0.5,
        max(counts),
        rows_per_program=16,
        block_n=block_n,
        first_slot=first_slot,
        context_splits=splits,
        **given,
    )

    group = heads // kv_heads
    for r in range(4):
        rows = range(int(qsl[r]), int(qsl[r + 1]))
        if tree_rows[r] < 0:
            assert (output[list(rows)] == poison).all(), r
            continue
        tree = int(tree_rows[r])
        for i, row in enumerate(rows):
            if i < first_slot:  # left to the backend's causal pass
                assert (output[row] == poison).all(), (r, i)
                continue
            seen = [j for j in range(counts[r]) if trees.mask[tree, i, j]]
            keys, values = cached(r, list(range(contexts[r])) + [contexts[r] + j for j in seen])
            want, _ = attend_with_lse(query[row : row + 1], keys, values, head**-0.5)
            torch.testing.assert_close(output[row], want[0], atol=2e-5, rtol=2e-5)
        assert group >= 1


def check_programs_past_the_slots_read_nothing(splits: int) -> None:
    """A mixed step's grid covers its longest query (a prefill's): the programs of a tree
    request past its slots must not walk the context (their rows are none). Counted: the
    kernel's paged K/V reads for one tree request, launched for its own 24 slots and for 240."""
    from ddtree.vllm_plugin.attention import paged_tree_kernel as ptk

    kernel_globals = ptk._paged_tree_attention_kernel.fn.__globals__
    original = kernel_globals["_paged_kv"]
    reads = []

    class Counted:  # the interpreter calls the helper through the kernel's globals
        def __getattr__(self, name):
            return getattr(original, name)

        def __call__(self, *args, **kwargs):
            reads.append(1)
            return original(*args, **kwargs)

    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head, block = 4, 2, 16, 16
    trees = ddtree.build_tree(torch.randn(1, 4, 12, generator=gen) * 2, 23)
    qsl = torch.tensor([0, 24], dtype=torch.int32)
    seq_lens = torch.tensor([24 + 70], dtype=torch.int32)
    tables = torch.arange(8, dtype=torch.int32).view(1, 8)
    kv_cache = torch.randn(8, block, kv_heads, 2 * head, generator=gen).permute(0, 2, 1, 3)
    query = torch.randn(24, heads, head, generator=gen)
    outputs, counts = [], []
    kernel_globals["_paged_kv"] = Counted()
    try:
        for max_query_len in (24, 240):
            reads.clear()
            outputs.append(torch.zeros_like(query))
            ptk.paged_tree_attention(
                query, kv_cache, outputs[-1], qsl, seq_lens, tables,
                torch.zeros(1, dtype=torch.int32), trees.depths.int().contiguous(),
                trees.ancestors.int().contiguous(), head**-0.5, max_query_len,
                rows_per_program=16, context_splits=splits,
            )  # fmt: skip
            counts.append(len(reads))
    finally:
        kernel_globals["_paged_kv"] = original
    assert counts[0] > 0 and counts[1] == counts[0], counts
    torch.testing.assert_close(outputs[1], outputs[0], atol=0, rtol=0)


if __name__ == "__main__":
    check(heads=4, kv_heads=2)
    check(heads=6, kv_heads=2)  # a group of 3: padded to 4 rows per slot
    check(heads=2, kv_heads=2)
    check(heads=4, kv_heads=2, first_slot=5)  # a forced chain of 4 after the root
    check(heads=4, kv_heads=2, first_slot=24)  # the whole tree is chain: nothing written
    # The context part given (FlashAttention's output and log-sum-exp), only the tree read here;
    # the padded request's context is empty (lse -inf), the prefill's rows are not touched.
    check(heads=4, kv_heads=2, context_given=True)
    check(heads=6, kv_heads=2, first_slot=5, context_given=True)
    # The context in shares merged by log-sum-exp: shares of whole key blocks (contexts 37 and
    # 70: some shares partial, some empty, the last one also holding the tree's slots).
    check(heads=4, kv_heads=2, splits=3)
    check(heads=6, kv_heads=2, first_slot=5, splits=4, block_n=16)
    check(heads=4, kv_heads=2, splits=8, block_n=16)
    check(heads=4, kv_heads=2, splits=2, scratch_shares=4)
    check_programs_past_the_slots_read_nothing(splits=1)
    check_programs_past_the_slots_read_nothing(splits=2)
