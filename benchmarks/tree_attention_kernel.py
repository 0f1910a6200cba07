"""Per-call time of the one-kernel tree attention (Triton) at Qwen3-8B attention shapes.

    python benchmarks/tree_attention_kernel.py      # on a CUDA machine; torch + triton only

Wall microseconds per call (host launch included; mean of 200 calls after warm-up, one sync
at the end), for R requests of Q tree slots over C cached tokens, 32 heads / 8 KV heads / 128.
"""

import json
import time

import torch

import ddtree
from ddtree.vllm_plugin.attention.triton_kernel import tree_attention

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16


def case(num_reqs: int, budget: int, context: int) -> float:
    q = 1 + budget
    trees = ddtree.build_tree(torch.randn(num_reqs, 15, 151936, device="cuda"), budget)
    blocks = num_reqs * (-(-(context + q) // BLOCK))
    kv_cache = torch.randn(blocks, BLOCK, KV_HEADS, 2 * HEAD, device="cuda").bfloat16()
    kv_cache = kv_cache.permute(0, 2, 1, 3)
    tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(num_reqs, -1)
    rows = torch.arange(num_reqs * q, device="cuda").view(num_reqs, q)
    query = torch.randn(num_reqs * q, HEADS, HEAD, device="cuda").bfloat16()
    key = torch.randn(num_reqs * q, KV_HEADS, HEAD, device="cuda").bfloat16()
    output = torch.empty_like(query)
    counts = torch.full((num_reqs,), q, dtype=torch.int32, device="cuda")
    contexts = torch.full((num_reqs,), context, dtype=torch.int32, device="cuda")
    args = (query, key, key, kv_cache, output, rows, counts, trees.mask, contexts, tables, 0.088)
    for _ in range(5):
        tree_attention(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        tree_attention(*args)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / 200


if __name__ == "__main__":
    rows = []
    for num_reqs, budget, context in [
        (1, 64, 1024),
        (1, 255, 1024),
        (1, 511, 1024),
        (8, 64, 1024),
        (32, 15, 1024),
        (1, 64, 8192),
    ]:
        us = case(num_reqs, budget, context)
        rows.append(
            {
                "requests": num_reqs,
                "budget": budget,
                "context": context,
                "us_per_call": round(us, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
