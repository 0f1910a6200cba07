"""Compile every ddtree.kernels kernel for a GPU target without a GPU (Triton + ptxas only) and
report registers, spills, shared memory and compile time: catches what Triton's CPU interpreter
accepts but a real GPU rejects (shapes, shared memory, dtypes).

    python benchmarks/compile_kernels.py --arch 90 --budgets 16,64,255,1024 --vocab 151936
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ddtree.kernels import ancestry, build, gdn_tree, kv_compact, tree_build, vocab_topk, walk
from ddtree.kernels._common import next_pow2, sort_size

PTX_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_one(name, fn, signature, constexprs, num_warps, arch) -> dict:
    """Compile ``fn`` and read its resource usage from the cubin."""
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    t0 = time.perf_counter()
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps},
    )
    seconds = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [str(PTX_BIN / "cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))  # per-thread frame: spills
    row = {
        "kernel": name,
        "warps": num_warps,
        "registers": regs,
        "stack_bytes": stack,
        "shared_bytes": kernel.metadata.shared,
        "compile_s": round(seconds, 1),
    }
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return row


def kernels_for(batch: int, depth: int, vocab: int, budget: int, dtype: str, arch: int):
    """Compile the kernels of one build + walk + ancestry at these shapes."""
    k = min(budget, vocab)
    segment, num_seg, chunk, cap_small, cap = vocab_topk._plan(vocab, k)
    n_chunks = num_seg * (segment // chunk)
    tag = f"V={vocab} B={budget} {dtype}"
    compile_one(
        f"vocab._segment_kernel {tag}",
        vocab_topk._segment_kernel,
        {"logits_ptr": f"*{dtype}", "s_b": "i32", "s_d": "i32", "depth": "i32", "vocab": "i32",
         "stats_ptr": "*fp32", "chunks_ptr": "*i32"},
        {"SEGMENT": segment, "CHUNK": chunk, "PDL": True},
        8, arch,
    )  # fmt: skip
    compile_one(
        f"vocab._threshold_kernel {tag}",
        vocab_topk._threshold_kernel,
        {"stats_ptr": "*fp32", "chunks_ptr": "*i32", "lse_ptr": "*fp32", "thresh_ptr": "*i32",
         "count_ptr": "*i32", "num_seg": "i32", "n_chunks": "i32", "k": "i32", "slack": "i32"},
        {"NK": next_pow2(n_chunks), "SEG_P": next_pow2(num_seg), "PDL": True},
        vocab_topk.threshold_num_warps(n_chunks), arch,
    )  # fmt: skip
    compile_one(
        f"vocab._compact_kernel {tag}",
        vocab_topk._compact_kernel,
        {"logits_ptr": f"*{dtype}", "s_b": "i32", "s_d": "i32", "depth": "i32", "vocab": "i32",
         "thresh_ptr": "*i32", "count_ptr": "*i32", "buf_ptr": "*i64", "chunks_ptr": "*i32"},
        {"CAP": cap, "SEGMENT": segment, "CHUNK": chunk,
         "TILE_CH": min(segment // chunk, 2048 // chunk), "PDL": True},
        8, arch,
    )  # fmt: skip
    compile_one(
        f"vocab._select_kernel {tag}",
        vocab_topk._select_kernel,
        {"logits_ptr": f"*{dtype}", "s_b": "i32", "s_d": "i32", "depth": "i32", "vocab": "i32",
         "thresh_ptr": "*i32", "count_ptr": "*i32", "lse_ptr": "*fp32", "buf_ptr": "*i64",
         "picked_ptr": "*i64", "logprobs_ptr": "*fp32", "ids_ptr": "*i64", "k": "i32",
         "floor": "fp32"},
        {"CAP_SMALL": cap_small, "CAP": cap, "KP": sort_size(k), "TILE": min(segment, 4096),
         "PDL": True},
        vocab_topk.select_num_warps(cap), arch,
    )  # fmt: skip
    beam = sort_size(budget)
    for chain in (False, True):
        compile_one(
            f"tree._tree_kernel B={budget} k={k} chain={chain}",
            tree_build._tree_kernel,
            {"lp_ptr": "*fp32", "ids_ptr": "*i64", "k": "i32", "budget": "i32", "depth": "i32",
             "list_score_ptr": "*fp32", "list_parent_ptr": "*i32", "list_rank_ptr": "*i32",
             "list_slot_ptr": "*i32",
             "tokens_ptr": "*i64", "parents_ptr": "*i64", "depths_ptr": "*i64",
             "scores_ptr": "*fp32", "num_nodes_ptr": "*i64"},
            {"CHAIN": chain, "BP": beam, "LOG2_BP": beam.bit_length() - 1, "KP": next_pow2(k),
             "LOG2_KP": next_pow2(k).bit_length() - 1, "DP": next_pow2(depth),
             "NP": next_pow2(budget + 1), "S1": min(64, beam), "S2": min(256, beam), "PDL": True},
            build.tree_num_warps(budget), arch,
        )  # fmt: skip
    n_slots = budget + 1
    rows = ancestry.rows_per_program(n_slots)
    compile_one(
        f"ancestry._ancestry_kernel B={budget}",
        ancestry._ancestry_kernel,
        {"parents_ptr": "*i64", "ancestors_ptr": "*i64", "bits_ptr": "*i32", "mask_ptr": "*u8",
         "n_slots": "i32", "depth": "i32", "n_words": "i32"},
        {"ROWS": rows, "WP": next_pow2(-(-n_slots // 32)),
         "GROUP": min(4, next_pow2(-(-n_slots // 32))), "MASK": False, "PDL": True},
        4, arch,
    )  # fmt: skip
    compile_one(
        f"walk._walk_kernel B={budget}",
        walk._walk_kernel,
        {"tokens_ptr": "*i64", "parents_ptr": "*i64", "depths_ptr": "*i64",
         "ancestors_ptr": "*i64", "target_ptr": "*i64", "path_ptr": "*i64",
         "num_accepted_ptr": "*i64", "bonus_ptr": "*i64", "emitted_ptr": "*i64",
         "accepted_ptr": "*u8", "n_slots": "i32", "depth": "i32"},
        {"NP": next_pow2(n_slots), "D1P": next_pow2(depth + 1)},
        4 if n_slots <= 256 else 8, arch,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--budgets", default="16,64,255,1024")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--dtypes", default="bf16,fp32")
    args = parser.parse_args()
    print(f"# {' '.join(sys.argv)}; triton {triton.__version__}, target sm_{args.arch}")
    for budget in (int(b) for b in args.budgets.split(",")):
        for dtype in args.dtypes.split(","):
            kernels_for(1, args.depth, args.vocab, budget, dtype, args.arch)
    for parts, width in ((1, 256), (2, 128)):  # vLLM 0.26 FlashAttention / older layout
        compile_one(
            f"kv._compact_kv_kernel parts={parts} width={width}",
            kv_compact._compact_kv_kernel,
            {"cache_ptr": "*bf16", "layer_offsets_ptr": "*i64", "src_ptr": "*i64",
             "dst_ptr": "*i64", "num_moves": "i32", "block_size": "i32", "s_part": "i64",
             "s_block": "i64", "s_head": "i64", "s_offset": "i64"},
            {"PARTS": parts, "HEADS": 8, "WIDTH": width, "MP": 16,
             "CW": min(width, 4096 // 16)},
            4, args.arch,
        )  # fmt: skip

    for dtype in args.dtypes.split(","):
        gdn_kernels(dtype, args.arch)
    v2_glue_kernels(args.arch)


def gdn_kernels(dtype: str, arch: int) -> None:
    """The tree GDN kernels (recurrence, path replay, conv) at Qwen3.6-27B shapes (K = V = 128)."""
    ints = ("n_slots", "n_runs", "run_nodes", "ratio", "dim_v", *(f"s_{x}" for x in (
        "qb", "qn", "qh", "kb", "kn", "kh", "vb", "vn", "vh", "gb", "gn",
        "sb", "sh", "sv", "ab", "an", "rb", "wb", "ob", "on", "oh")))  # fmt: skip
    for token_rows in (False, True):  # [b, N] float32 outputs / into vLLM's [T] rows
        compile_one(
            f"gdn._tree_gdn_kernel K=128 BV=32 token_rows={token_rows} {dtype}",
            gdn_tree._tree_gdn_kernel,
            {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
             "g_ptr": "*fp32", "beta_ptr": "*fp32", "state_ptr": "*fp32", "slots_ptr": "*i64",
             "ancestors_ptr": "*i64", "chain_ptr": "*i32", "order_ptr": "*i32",
             "branch_ptr": "*i32", "length_ptr": "*i32",
             "out_ptr": f"*{dtype}" if token_rows else "*fp32", "rows_ptr": "*i64",
             **{name: "i32" for name in ints}, "scale": "fp32", "eps": "fp32"},
            {"K": 128, "BK": 128, "BV": 32, "L2NORM": True, "SLOTS": True,
             "TOKEN_ROWS": token_rows},
            4, arch,
        )  # fmt: skip
    conv_ints = ("n_slots", "channels", "max_depth", *(f"s_{x}" for x in (
        "xb", "xn", "cs", "cc", "ct", "ab", "an", "db", "ob", "on")))  # fmt: skip
    compile_one(
        f"gdn._tree_conv_kernel W=4 BC=256 {dtype}",
        gdn_tree._tree_conv_kernel,
        {"x_ptr": f"*{dtype}", "conv_ptr": f"*{dtype}", "slots_ptr": "*i64",
         "ancestors_ptr": "*i64", "depths_ptr": "*i64", "weight_ptr": f"*{dtype}",
         "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
         **{name: "i32" for name in conv_ints}},
        {"W": 4, "BC": 256, "HAS_BIAS": False, "SILU": True},
        4, arch,
    )  # fmt: skip
    strides = [f"s_{x}" for x in ("kb", "kn", "kh", "vb", "vn", "vh", "gb", "gn", "ss", "sh",
                                   "sv", "pb", "ab")]  # fmt: skip
    compile_one(
        f"gdn._replay_path_kernel K=128 BV=32 gate_at {dtype}",
        gdn_tree._replay_path_kernel,
        {"k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "g_ptr": "*fp32", "beta_ptr": "*fp32",
         "state_ptr": "*fp32", "slots_ptr": "*i64", "path_ptr": "*i64", "gate_ptr": "*i64",
         **{name: "i32" for name in ("path_len", "ratio", "dim_v", *strides)},
         "eps": "fp32"},
        {"K": 128, "BK": 128, "BV": 32, "L2NORM": True, "GATE_AT": True},
        4, arch,
    )  # fmt: skip
    compile_one(
        f"gdn._stash_kernel BC=1024 {dtype}",
        gdn_tree._stash_kernel,
        {"mixed_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}",
         "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "rows_ptr": "*i64", "x_ptr": f"*{dtype}",
         "g_ptr": "*fp32", "beta_ptr": "*fp32",
         **{name: "i32" for name in ("channels", "heads_v", "s_mt", "s_at", "s_bt", "s_xn",
                                     "s_gn")}},
        {"BC": 1024, "BH": 64},
        4, arch,
    )  # fmt: skip
    compile_one(
        f"gdn._path_conv_kernel W=4 BC=256 {dtype}",
        gdn_tree._path_conv_kernel,
        {"x_ptr": f"*{dtype}", "conv_ptr": f"*{dtype}", "cells_ptr": "*i64", "path_ptr": "*i64",
         "lengths_ptr": "*i64", "weight_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}",
         "out_ptr": f"*{dtype}", **{name: "i32" for name in ("channels", "s_xb", "s_xn", "s_cs",
                                                             "s_cc", "s_ct", "s_pb", "s_ob",
                                                             "s_ot")}},
        {"W": 4, "BC": 256, "HAS_BIAS": False, "SILU": True},
        4, arch,
    )  # fmt: skip


def v2_glue_kernels(arch: int) -> None:
    """The V2 runner glue's kernels and the paged tree attention, with the dtypes vLLM 0.26's
    V2 buffers have (request indices and token ids int32, tree tokens int64, tree tables
    int32)."""
    from ddtree.vllm_plugin.attention import paged_tree_kernel
    from ddtree.vllm_plugin.v2 import bad_words, kernels, penalties

    int32 = ("qsl_ptr", "seq_lens_ptr", "table_ptr", "tree_rows_ptr", "depths_ptr",
             "ancestors_ptr")  # fmt: skip
    scalars = ("group", "cache_block", "max_depth", "first_slot", "s_qt", "s_qh", "s_ot",
               "s_oh", "s_cb", "s_ch", "s_ct", "s_tr", "s_dr", "s_ar", "s_aq", "s_xt", "s_xh",
               "s_lt", "s_lh", "s_pt", "s_ph", "s_ps", "s_mt", "s_mh")  # fmt: skip
    for splits, given in ((1, False), (4, False), (1, True)):
        compile_one(
            f"attention._paged_tree_attention_kernel hd=128 group=4 bf16 splits={splits} "
            f"context_given={given}",
            paged_tree_kernel._paged_tree_attention_kernel,
            {"query_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*bf16",
             **dict.fromkeys(int32, "*i32"), "ctx_out_ptr": "*bf16", "ctx_lse_ptr": "*fp32",
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale": "fp32",
             **dict.fromkeys(scalars, "i32")},
            {"HEAD_DIM": 128, "BLOCK_Q": 16, "GROUP_PAD": 4, "BLOCK_N": 32,
             "CONTEXT_GIVEN": given, "SPLITS": splits}, 4, arch,
        )  # fmt: skip
    compile_one(
        "attention._merge_splits_kernel hd=128 group=4 splits=4",
        paged_tree_kernel._merge_splits_kernel,
        {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qsl_ptr": "*i32",
         "tree_rows_ptr": "*i32",
         **dict.fromkeys(("group", "first_slot", "s_ot", "s_oh", "s_pt", "s_ph", "s_ps", "s_mt",
                          "s_mh"), "i32")},
        {"HEAD_DIM": 128, "BLOCK_Q": 4, "GROUP_PAD": 4, "SPLITS": 4}, 4, arch,
    )  # fmt: skip

    tree = {"tokens_ptr": "*i64", "tokens_stride": "i32", "ancestors_ptr": "*i32",
            "ancestors_stride0": "i32", "ancestors_stride1": "i32", "depths_ptr": "*i32",
            "depths_stride": "i32"}  # fmt: skip
    rows = {"logits_ptr": "*fp32", "logits_stride": "i32", "state_of_row_ptr": "*i32",
            "slot_of_row_ptr": "*i32"}  # fmt: skip
    compile_one(
        "v2._tree_bad_words_kernel", bad_words._tree_bad_words_kernel,
        {**rows, "words_ptr": "*i32", "words_stride": "i32", "offsets_ptr": "*i32",
         "offsets_stride": "i32", "num_words_ptr": "*i32", "all_tokens_ptr": "*i32",
         "all_tokens_stride": "i32", "prompt_len_ptr": "*i32", "total_len_ptr": "*i32", **tree},
        {}, 4, arch,
    )  # fmt: skip
    compile_one(
        "v2._tree_penalties_kernel BLOCK=8192", penalties._tree_penalties_kernel,
        {**rows, "repetition_ptr": "*fp32", "frequency_ptr": "*fp32", "presence_ptr": "*fp32",
         "prompt_bits_ptr": "*i32", "prompt_bits_stride": "i32", "counts_ptr": "*i32",
         "counts_stride": "i32", **tree, "vocab": "i32"},
        {"BLOCK": 8192}, 8, arch,
    )  # fmt: skip
    for find, at_depth in ((True, True), (False, False), (False, True)):
        compile_one(
            f"v2._tree_positions_kernel find={find} depth={at_depth}",
            kernels._tree_positions_kernel,
            {"tree_rows_ptr": "*i32", "positions_ptr": "*i64", "qsl_ptr": "*i32",
             "cu_logits_ptr": "*i32", "idx_mapping_ptr": "*i32", "depths_ptr": "*i32",
             "depths_stride": "i32", "num_reqs": "i32"},
            {"FIND_TREES": find, "AT_DEPTH": at_depth, "BLOCK": 128}, 4, arch,
        )  # fmt: skip
    compile_one(
        "v2._tail_inputs_kernel BLOCK=256", kernels._tail_inputs_kernel,
        {"target_ptr": "*i64", **dict.fromkeys(("cu_logits_ptr", "seq_lens_ptr",
         "prefill_len_ptr", "idx_mapping_ptr", "qsl_ptr", "tree_rows_ptr"), "*i32"),
         **dict.fromkeys(("node_target_ptr", "num_logits_ptr", "chunk_ptr", "start_ptr"),
                         "*i64"),
         "active_ptr": "*i1", "num_reqs": "i32", "width": "i32"},
        {"BLOCK": 256}, 4, arch,
    )  # fmt: skip


if __name__ == "__main__":
    main()
