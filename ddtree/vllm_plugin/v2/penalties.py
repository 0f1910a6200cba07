"""Presence, frequency and repetition penalties per tree node on the V2 model runner.

vLLM's V2 sampler penalises a draft row with the request's output so far plus the drafts of the
rows before it: a chain's history. A tree node's history is its root path instead: its own
token and its ancestors' up to the root (the root's token is the last sampled one, already in
the request's output counts). :func:`apply_tree_penalties` applies vLLM's three penalties with
that history, read from the tree tables (``TreeTables``: tokens, depths, k-th ancestors, by
request-state row): repetition scales the logit of every token of the prompt or the history
(divides a positive logit, multiplies a negative one), frequency subtracts the token's count,
presence a constant for each token seen. The tree sampler puts it in place of the penalty step
of vLLM's sampler; a row at slot 0 (a bonus or prefill row) gets exactly vLLM's own result.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 8192  # vocabulary entries per program


@triton.jit
def _tree_penalties_kernel(
    logits_ptr, logits_stride, state_of_row_ptr, slot_of_row_ptr,
    repetition_ptr, frequency_ptr, presence_ptr,
    prompt_bits_ptr, prompt_bits_stride, counts_ptr, counts_stride,
    tokens_ptr, tokens_stride, ancestors_ptr, ancestors_stride0, ancestors_stride1,
    depths_ptr, depths_stride, vocab,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    state = tl.load(state_of_row_ptr + row).to(tl.int64)
    repetition = tl.load(repetition_ptr + state)
    frequency = tl.load(frequency_ptr + state)
    presence = tl.load(presence_ptr + state)
    if (repetition == 1.0) & (frequency == 0.0) & (presence == 0.0):
        return
    part = tl.program_id(1)
    ids = part * BLOCK + tl.arange(0, BLOCK)
    inside = ids < vocab
    logit = tl.load(logits_ptr + row * logits_stride + ids, mask=inside).to(tl.float32)
    count = tl.load(counts_ptr + state * counts_stride + ids, mask=inside, other=0)
    # The node's root path below the root: k-th ancestors for k = 0 (itself) .. depth - 1.
    slot = tl.load(slot_of_row_ptr + row).to(tl.int64)
    depth = tl.load(depths_ptr + state * depths_stride + slot)
    for k in range(depth):
        node = tl.load(ancestors_ptr + state * ancestors_stride0 + slot * ancestors_stride1 + k)
        token = tl.load(tokens_ptr + state * tokens_stride + node)
        count += (ids == token).to(tl.int32)
    seen = count > 0
    if repetition != 1.0:
        words = part * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        bits = tl.load(
            prompt_bits_ptr + state * prompt_bits_stride + words,
            mask=words < tl.cdiv(vocab, 32),
            other=0,
        )
        in_prompt = ((bits[:, None] >> tl.arange(0, 32)[None, :]) & 1).reshape(BLOCK) != 0
        scale = tl.where(in_prompt | seen, repetition, 1.0)
        logit *= tl.where(logit > 0, 1.0 / scale, scale)
    logit -= frequency * count
    logit -= presence * seen
    tl.store(logits_ptr + row * logits_stride + ids, logit, mask=inside)


def apply_tree_penalties(
    state,
    tables,
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    idx_mapping_np: np.ndarray,
    input_ids: torch.Tensor,
    expanded_local_pos: torch.Tensor,
) -> None:
    """vLLM's ``PenaltiesState.apply_penalties`` with each row's history along its tree path:
    ``state`` (the sampler's ``PenaltiesState``: per-request penalties, prompt bit masks,
    output counts), ``tables`` (``TreeTables``), ``logits [rows, V]`` float32 in place,
    ``expanded_idx_mapping [rows]`` (request-state row of each logits row),
    ``expanded_local_pos [rows]`` (its slot in the request's tree). ``input_ids`` is unused
    (the tables hold the node tokens); ``idx_mapping_np`` skips the launch when no request of
    the step has a penalty, as vLLM does."""
    del input_ids
    if not np.any(state.use_penalty[idx_mapping_np]):
        return
    rows, vocab = logits.shape
    _tree_penalties_kernel[(rows, triton.cdiv(vocab, BLOCK))](
        logits, logits.stride(0), expanded_idx_mapping, expanded_local_pos,
        state.repetition_penalty.gpu, state.frequency_penalty.gpu, state.presence_penalty.gpu,
        state.prompt_bin_mask, state.prompt_bin_mask.stride(0),
        state.output_bin_counts, state.output_bin_counts.stride(0),
        tables.tokens, tables.tokens.stride(0),
        tables.ancestors, tables.ancestors.stride(0), tables.ancestors.stride(1),
        tables.depths, tables.depths.stride(0), vocab,
        BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
