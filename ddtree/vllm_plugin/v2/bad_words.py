"""Bad words per tree node on the V2 model runner.

A bad word ``[w1, ..., wn]`` bans ``wn`` as the next token of a sequence that ends with
``w1 .. w(n-1)``. For a tree node the sequence is the request's output so far (the root's
token, the last sampled one, included) followed by the tokens of the node's root path below
the root (its ancestors', then its own). vLLM's V2 sampler reads the drafts of the rows
before a row instead (a chain); :func:`apply_tree_bad_words` reads the path from the tree
tables (``TreeTables``: tokens, depths, k-th ancestors, by request-state row). The tree
sampler puts it in place of the bad-words step of vLLM's sampler; a row at slot 0 (a bonus or
prefill row) gets no-spec's result: the output alone.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _tree_bad_words_kernel(
    logits_ptr, logits_stride, state_of_row_ptr, slot_of_row_ptr,
    words_ptr, words_stride, offsets_ptr, offsets_stride, num_words_ptr,
    all_tokens_ptr, all_tokens_stride, prompt_len_ptr, total_len_ptr,
    tokens_ptr, tokens_stride, ancestors_ptr, ancestors_stride0, ancestors_stride1,
    depths_ptr, depths_stride,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    word = tl.program_id(1)
    state = tl.load(state_of_row_ptr + row).to(tl.int64)
    if word >= tl.load(num_words_ptr + state):
        return
    slot = tl.load(slot_of_row_ptr + row).to(tl.int64)
    depth = tl.load(depths_ptr + state * depths_stride + slot)
    prompt_len = tl.load(prompt_len_ptr + state)
    output_len = tl.load(total_len_ptr + state) - prompt_len
    first = tl.load(offsets_ptr + state * offsets_stride + word)
    last = tl.load(offsets_ptr + state * offsets_stride + word + 1) - 1  # the banned token
    prefix = last - first
    length = output_len + depth  # the node's sequence: output, then its path below the root
    if prefix <= length:
        match = tl.full([], 1, tl.int1)
        for i in range(prefix):
            at = length - prefix + i  # position in the node's sequence
            if at >= output_len:  # on the path: the node at depth at - output_len + 1
                k = depth - 1 - (at - output_len)  # its ancestor index from the node
                node = tl.load(
                    ancestors_ptr + state * ancestors_stride0 + slot * ancestors_stride1 + k
                )
                actual = tl.load(tokens_ptr + state * tokens_stride + node).to(tl.int64)
            else:
                actual = tl.load(all_tokens_ptr + state * all_tokens_stride + prompt_len + at).to(
                    tl.int64
                )
            match = match & (actual == tl.load(words_ptr + state * words_stride + first + i))
        if match:
            banned = tl.load(words_ptr + state * words_stride + last)
            tl.store(logits_ptr + row * logits_stride + banned, float("-inf"))


def apply_tree_bad_words(
    state,
    tables,
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    idx_mapping_np: np.ndarray,
    input_ids: torch.Tensor,
    expanded_local_pos: torch.Tensor,
) -> None:
    """vLLM's ``BadWordsState.apply_bad_words`` with each row's sequence along its tree path:
    ``state`` (the sampler's ``BadWordsState``: flattened words, offsets, counts, and the
    request states' token history), ``tables`` (``TreeTables``), ``logits [rows, V]`` in
    place, ``expanded_idx_mapping [rows]`` (request-state row of each logits row),
    ``expanded_local_pos [rows]`` (its slot in the request's tree). ``input_ids`` is unused
    (the tables hold the node tokens); the launch is skipped when no request of the step has
    bad words, as vLLM does (one host read of a host array)."""
    del input_ids
    most = int(state.num_bad_words.np[idx_mapping_np].max(initial=0))
    if most == 0:
        return
    requests = state.req_states
    words, offsets = state.bad_word_token_ids.gpu, state.bad_word_offsets.gpu
    all_tokens = requests.all_token_ids.gpu
    _tree_bad_words_kernel[(logits.shape[0], most)](
        logits, logits.stride(0), expanded_idx_mapping, expanded_local_pos,
        words, words.stride(0), offsets, offsets.stride(0), state.num_bad_words.gpu,
        all_tokens, all_tokens.stride(0), requests.prompt_len.gpu, requests.total_len.gpu,
        tables.tokens, tables.tokens.stride(0),
        tables.ancestors, tables.ancestors.stride(0), tables.ancestors.stride(1),
        tables.depths, tables.depths.stride(0),
    )  # fmt: skip
