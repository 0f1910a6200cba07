"""Structured output on the V2 runner: the tree shapes the scheduler's grammar needs.

The grammar runs in the scheduler (``v1/grammar.py``, shared by both runners): it fills one
bitmask row per tree node from the grammar state after the node's root path, and vLLM's V2
``StructuredOutputsWorker`` maps a request's rows onto its logits rows in slot order. On the V2
runner the drafts reach the scheduler through ``DraftTokensHandler`` (an asynchronous host copy,
made only in steps with structured-output requests); the parent slot of each draft rides along
on the same copy stream, and the scheduler gets them as ``TreeDraftTokenIds``.
"""

from __future__ import annotations

import numpy as np
import torch

from ddtree.vllm_plugin.v1.grammar import TreeDraftTokenIds


def copy_parents(handler, engine, input_batch) -> np.ndarray:
    """Start the host copy of this step's trees' parents ``[R, B]`` (draft s's parent slot,
    batch order) on the handler's copy stream, after the drafter stored the trees; the
    handler's event now also covers it."""
    from vllm.v1.worker.gpu.async_utils import async_copy_to_np

    rows = input_batch.idx_mapping.long()  # the trees are filed under request-state rows
    parents = engine.tables.parents.index_select(0, rows)[:, 1:]  # [R, B]
    stream = handler.copy_stream
    stream.wait_stream(torch.cuda.current_stream(handler.device))
    with torch.cuda.stream(stream):
        host = async_copy_to_np(parents)
        parents.record_stream(stream)
        handler.copy_event.record()
    return host


def with_parents(drafts, parents: np.ndarray) -> TreeDraftTokenIds:
    """vLLM's ``DraftTokenIds`` of the step with every request's draft parents."""
    rows = parents.tolist()
    return TreeDraftTokenIds(
        drafts.req_ids,
        drafts.draft_token_ids,
        {req_id: rows[i] for i, req_id in enumerate(drafts.req_ids)},
    )
