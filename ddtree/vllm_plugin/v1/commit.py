"""Stage 4: the accepted paths' K/V moved to the slots right after the context.

vLLM wrote the step's K/V at sequential slots ``context + slot``; the accepted path's nodes
sit at arbitrary slots. Every target layer gets ``context + path[k] -> context + k`` (k >= 1;
the others copy onto themselves), so that vLLM's ``num_computed_tokens -= num_rejected`` leaves
exactly the accepted tokens in the cache. All requests' moves over all layers are one graph
replay on the GPU.
"""

from __future__ import annotations

import torch

from ddtree.vllm_plugin import attention, graphs
from ddtree.vllm_plugin.state import EngineState, TreeBatch


def commit_kv(engine: EngineState, runner, tb: TreeBatch, path: torch.Tensor) -> None:
    """Moves of all requests, padded to a bucket of requests with copies of slot 0 (vLLM's null
    block) onto itself, so the graph's shapes repeat."""
    width = min(path.shape[1], tb.rows.shape[1])
    path = path[:, 1:width]  # [R, P]
    dst_rows = tb.rows[:, 1:width]
    src_rows = torch.where(path >= 0, tb.rows.gather(1, path.clamp(min=0)), dst_rows)
    num_reqs, num_moves = path.shape
    padding = (graphs.bucket(num_reqs) - num_reqs) * num_moves
    tables = runner.input_batch.block_table.block_tables
    moves = []
    for group in range(len(tables)):
        slots = tables[group].slot_mapping.gpu
        for rows in (src_rows, dst_rows):
            moves.append(torch.nn.functional.pad(slots[rows.flatten()], (0, padding)))
    layer_commit(engine, runner)(*moves)


def layer_commit(engine: EngineState, runner) -> graphs.GraphCache:
    """``commit(src_0, dst_0, src_1, dst_1, ...)``: per KV group, cache slots ``src [M]`` ->
    ``dst [M]`` in every target layer of the group (made once per engine)."""
    if engine.commit is not None:
        return engine.commit
    from ddtree.vllm_plugin.v1.prepare import target_layers

    layers = []
    for group, _, layer in target_layers(runner):
        kv_cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
        layers.append((group, kv_cache, layer.impl))

    def commit(*moves: torch.Tensor) -> None:
        for group, kv_cache, impl in layers:
            attention.copy_slots(impl, kv_cache, moves[2 * group], moves[2 * group + 1])

    # Warm-up before capture: dst onto itself (moving twice would not be harmless).
    engine.commit = graphs.GraphCache(
        commit,
        warmup=lambda *m: [m[i | 1] for i in range(len(m))],
        pool=engine.graph_pool,
        enabled=engine.settings.cuda_graphs,
    )
    return engine.commit
