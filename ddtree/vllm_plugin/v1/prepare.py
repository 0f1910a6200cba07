"""Stage 1: this step's tree requests as a :class:`TreeBatch`, and their depth positions.

Runs after ``GPUModelRunner._prepare_inputs``: vLLM has laid out the step's token rows
(root, then the B node tokens it was given as drafts) with sequential positions and KV slots.
RoPE must see ``context + depth`` instead, so the positions are rewritten in place (the model
reads a view of the runner's persistent buffer); the KV slots stay sequential.
"""

from __future__ import annotations

import torch

from ddtree.vllm_plugin import attention, gdn
from ddtree.vllm_plugin.debug import sync_checked
from ddtree.vllm_plugin.state import (
    EngineState,
    LayerBinding,
    TreeBatch,
    gather_tree,
    pad_tree,
    padding_tree,
)


def target_layers(runner, linear: bool = False):
    """(KV-cache group, name, layer) of every attention layer of the target (not the drafter);
    ``linear``: of its linear-attention (mamba-style state) layers instead."""
    from vllm.v1.kv_cache_interface import MambaSpec

    drafter_layers = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
    context = runner.compilation_config.static_forward_context
    for group, spec in enumerate(runner.kv_cache_config.kv_cache_groups):
        if isinstance(spec.kv_cache_spec, MambaSpec) != linear:
            continue
        for name in spec.layer_names:
            if name not in drafter_layers:
                yield group, name, context[name]


def bind_layers(engine: EngineState, runner) -> None:
    """Once: check every target layer's attention backend and bind it to this engine."""
    for group, name, layer in target_layers(runner):
        attention.check_impl(name, layer.impl)
        layer.impl.ddtree_binding = LayerBinding(engine, group)
        engine.layer_groups[name] = group
    for _, name, layer in target_layers(runner, linear=True):
        gdn.check_layer(name, layer)
        layer.ddtree_engine = engine


def to_device(host: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host index tensors to the device in one copy (pinned, asynchronous on CUDA)."""
    packed = torch.cat([h.long().flatten() for h in host])
    if device.type == "cuda":
        packed = packed.pin_memory()
    return list(packed.to(device, non_blocking=True).split([h.numel() for h in host]))


@sync_checked
def prepare_step(engine: EngineState, runner, scheduler_output) -> None:
    """Collect this step's tree requests into ``engine.batch``; write their depth positions."""
    engine.mark("prepare")
    proposal, proposed = engine.begin_step()
    engine.gdn_pending.clear()  # a forward without a tree sample leaves nothing to commit
    if not engine.layer_groups:
        bind_layers(engine, runner)
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    spec = scheduler_output.scheduled_spec_decode_tokens
    members = [
        (i, req_id, len(spec[req_id]))
        for i, req_id in enumerate(batch.req_ids[:num_reqs])
        if spec.get(req_id)
    ]
    engine.attention_active = bool(members)
    if not members:
        engine.mark("forward")
        return
    device = runner.positions.device
    widest = 1 + max(n for _, _, n in members)
    if proposal is None:
        proposal = padding_tree(1, widest, engine.depth, device)
    if widest > proposal.tokens.shape[1]:
        # A request vLLM scheduled with B placeholder drafts (a new 1-token request padded to
        # the uniform decode width) while the step budget was lower.
        proposal = pad_tree(proposal, widest)
    num_slots = proposal.tokens.shape[1]
    padding_row = proposal.tokens.shape[0] - 1

    # Host-side index arithmetic, then one copy to the device.
    starts_all = runner.query_start_loc.cpu[: num_reqs + 1]
    index = torch.tensor([i for i, _, _ in members])
    counts = torch.tensor([1 + n for _, _, n in members])
    context = batch.num_computed_tokens_cpu_tensor[index].long()  # host
    source = torch.tensor([proposed.get(req_id, padding_row) for _, req_id, _ in members])
    slot = torch.arange(num_slots)
    scheduled = slot < counts[:, None]  # [R, Q]
    rows = starts_all[index].long()[:, None] + torch.where(scheduled, slot, 0)
    flat_slots = scheduled.flatten().nonzero().squeeze(1)
    cu_queries = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    parts = [index, rows, flat_slots, context, cu_queries, source, scheduled]
    index_d, rows_d, flat_d, context_d, cu_d, source_d, scheduled_d = to_device(parts, device)
    rows_d = rows_d.view(rows.shape)
    tree = gather_tree(proposal, source_d)
    tree.tokens = torch.where(scheduled_d.view(rows.shape).bool(), tree.tokens, -1)
    flat_rows = rows_d.flatten().index_select(0, flat_d)
    depth_positions = (context_d[:, None] + tree.depths).flatten().index_select(0, flat_d)
    runner.positions.index_copy_(0, flat_rows, depth_positions.to(runner.positions.dtype))
    if runner.uses_mrope:  # the model reads M-RoPE positions [3, T]: the root's + depth
        mrope = runner.mrope_positions.gpu
        roots = rows_d[:, :1].expand(rows.shape).flatten().index_select(0, flat_d)
        depths = tree.depths.flatten().index_select(0, flat_d).to(mrope.dtype)
        mrope.index_copy_(1, flat_rows, mrope.index_select(1, roots) + depths)
    tables = [
        bt.get_device_tensor(num_reqs).index_select(0, index_d)
        for bt in batch.block_table.block_tables
    ]
    engine.batch = TreeBatch(
        batch_index=index_d,
        tree=tree,
        rows=rows_d,
        flat_slots=flat_d,
        flat_rows=flat_rows,
        context=context_d,
        context_i32=context_d.int(),
        cu_queries=cu_d.int(),
        counts=(cu_d[1:] - cu_d[:-1]).int(),
        block_tables=tables,
        context_cpu=context.tolist(),
        max_context=int(context.max()),
        counts_cpu=counts.tolist(),
        covers_step=int(counts.sum()) == int(starts_all[num_reqs]),
    )
    engine.mark("forward")
