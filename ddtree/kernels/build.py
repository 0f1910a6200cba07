"""Public entry points of the fused tree step: build (vocabulary stage + tree stage + ancestry)
and walk, each a few Triton launches with fixed shapes and no host sync (CUDA-graph capturable).

They take CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``, for tests) and raise
:class:`FusedUnavailable` otherwise: the engine picks the torch path (:mod:`ddtree.tree`,
:mod:`ddtree.verify`) then. Outputs can be preallocated (``out=``) so a CUDA graph reuses them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ddtree.kernels._common import next_pow2, pdl_args, sort_size
from ddtree.kernels.ancestry import ancestry
from ddtree.kernels.tree_build import _tree_kernel
from ddtree.kernels.vocab_topk import VocabWorkspace, draft_topk_fused, vocab_workspace
from ddtree.kernels.walk import _walk_kernel
from ddtree.tree import MAX_BUDGET, DraftTree, _check_inputs, _root_only
from ddtree.verify import Acceptance
from ddtree.verify import _check_inputs as _check_walk_inputs

MAX_FUSED_BUDGET = 1024  # the tree kernel's bitonic networks are sized for budgets up to this
assert MAX_FUSED_BUDGET <= MAX_BUDGET


class FusedUnavailable(RuntimeError):
    """The fused kernels cannot run these tensors (not on CUDA, or a budget above 1024)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Raise :class:`FusedUnavailable` unless every tensor can take the Triton path."""
    for t in tensors:
        if not (t.is_cuda or (_interpreting() and t.device.type == "cpu")):
            raise FusedUnavailable(
                f"ddtree.kernels needs CUDA tensors (got {t.device}); use ddtree.build_tree / "
                "ddtree.walk (torch) there, or set TRITON_INTERPRET=1 for the CPU interpreter"
            )


@dataclass
class TreeBuffers:
    """Outputs and scratch of :func:`build_tree_fused` for one (batch, depth, vocab, budget)."""

    tree: DraftTree  # the outputs, ancestor_bits included (mask None without with_mask)
    logprobs: torch.Tensor  # float32 [b, D, k]: the vocabulary stage's ranked log-probs
    token_ids: torch.Tensor  # long [b, D, k]
    vocab: VocabWorkspace | None  # the vocabulary stage's scratch (None: ranked inputs only)
    list_score: torch.Tensor  # float32 [b, D, BP]: per depth, the kept prefixes (sorted)
    list_parent: torch.Tensor  # int32 [b, D, BP]: their parent's position
    list_rank: torch.Tensor  # int32 [b, D, BP]: their token rank
    list_slot: torch.Tensor  # int32 [b, D, BP]: the tree slot of each chosen one


def tree_buffers(
    batch: int,
    depth: int,
    vocab: int,
    budget: int,
    device: torch.device | str,
    *,
    with_vocab_stage: bool = True,
    with_mask: bool = True,
) -> TreeBuffers:
    """Preallocated outputs and scratch; ``with_mask=False``: no bool ``[b, 1+B, 1+B]`` mask
    (``tree.mask`` None), for readers of the ancestors or the packed bits."""
    k = min(budget, vocab)
    n_slots = budget + 1
    beam = sort_size(budget)

    def empty(*shape, dtype=torch.long):
        return torch.empty(*shape, dtype=dtype, device=device)

    tree = DraftTree(
        tokens=empty(batch, n_slots),
        parents=empty(batch, n_slots),
        depths=empty(batch, n_slots),
        mask=empty(batch, n_slots, n_slots, dtype=torch.bool) if with_mask else None,
        scores=empty(batch, n_slots, dtype=torch.float32),
        ancestors=empty(batch, n_slots, depth + 1),
        num_nodes=empty(batch),
        ancestor_bits=empty(batch, n_slots, -(-n_slots // 32), dtype=torch.int32),
    )
    return TreeBuffers(
        tree=tree,
        logprobs=empty(batch, depth, k, dtype=torch.float32),
        token_ids=empty(batch, depth, k),
        vocab=vocab_workspace(batch, depth, vocab, k, device) if with_vocab_stage else None,
        list_score=empty(batch, depth, beam, dtype=torch.float32),
        list_parent=empty(batch, depth, beam, dtype=torch.int32),
        list_rank=empty(batch, depth, beam, dtype=torch.int32),
        list_slot=empty(batch, depth, beam, dtype=torch.int32),
    )


def _check_budget(budget: int) -> None:
    if budget > MAX_FUSED_BUDGET:
        raise FusedUnavailable(f"fused tree build supports budgets <= {MAX_FUSED_BUDGET}")


def tree_num_warps(budget: int) -> int:
    """Warps of the tree kernel: its beam-sized vectors are 4..16 elements per thread."""
    beam = sort_size(budget)
    return 4 if beam <= 64 else (8 if beam <= 256 else 16)


def tree_from_ranked_fused(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    budget: int,
    *,
    chain_seed: bool = False,
    buffers: TreeBuffers | None = None,
) -> DraftTree:
    """:func:`ddtree.tree.tree_from_ranked` in two launches (tree kernel + ancestry), from the
    ranked ``logprobs`` float32 and ``token_ids`` long ``[b, D, k]``, ``k = min(budget, V)``."""
    check_device(logprobs, token_ids)
    _check_budget(budget)
    batch, depth, k = logprobs.shape
    if budget < 1 or k > budget or token_ids.shape != logprobs.shape:
        raise ValueError("tree_from_ranked_fused: needs budget >= 1 and [b, D, k<=budget] inputs")
    logprobs = logprobs.float().contiguous()
    token_ids = token_ids.long().contiguous()
    if buffers is None:
        buffers = tree_buffers(batch, depth, k, budget, logprobs.device, with_vocab_stage=False)
    tree = buffers.tree
    beam = sort_size(budget)
    _tree_kernel[(batch,)](
        logprobs, token_ids, k, budget, depth,
        buffers.list_score, buffers.list_parent, buffers.list_rank, buffers.list_slot,
        tree.tokens, tree.parents, tree.depths, tree.scores, tree.num_nodes,
        CHAIN=chain_seed, BP=beam, LOG2_BP=beam.bit_length() - 1, KP=next_pow2(k),
        LOG2_KP=next_pow2(k).bit_length() - 1, DP=next_pow2(depth), NP=next_pow2(budget + 1),
        S1=min(64, beam), S2=min(256, beam), **pdl_args(logprobs.device),
        num_warps=tree_num_warps(budget),
    )  # fmt: skip
    ancestry(tree.parents, depth, tree.ancestors, tree.ancestor_bits, tree.mask)
    return tree


def build_tree_fused(
    draft_logits: torch.Tensor,
    budget: int,
    *,
    chain_seed: bool = False,
    buffers: TreeBuffers | None = None,
) -> DraftTree:
    """:func:`ddtree.build_tree` on the GPU in six launches (vocabulary stage 4, tree 1,
    ancestry 1). ``draft_logits [b, D, V]`` bf16/fp16/fp32 with a contiguous last dim; budget
    <= 1024. Values are not checked (no host sync): pass finite logits. Pass ``buffers`` from
    :func:`tree_buffers` to reuse preallocated outputs (e.g. inside a CUDA graph)."""
    _check_inputs(draft_logits, budget, check_values=False)
    check_device(draft_logits)
    _check_budget(budget)
    batch, depth, vocab = draft_logits.shape
    if budget == 0:
        return _root_only(batch, depth, draft_logits.device)
    k = min(budget, vocab)
    if buffers is None:
        buffers = tree_buffers(batch, depth, vocab, budget, draft_logits.device)
    draft_topk_fused(
        draft_logits, k, out=(buffers.logprobs, buffers.token_ids), workspace=buffers.vocab
    )
    return tree_from_ranked_fused(
        buffers.logprobs, buffers.token_ids, budget, chain_seed=chain_seed, buffers=buffers
    )


def acceptance_buffers(batch: int, depth: int, n_slots: int, device) -> Acceptance:
    """Preallocated outputs of :func:`walk_fused`."""
    return Acceptance(
        path=torch.empty(batch, depth + 1, dtype=torch.long, device=device),
        num_accepted=torch.empty(batch, dtype=torch.long, device=device),
        bonus=torch.empty(batch, dtype=torch.long, device=device),
        emitted=torch.empty(batch, depth + 1, dtype=torch.long, device=device),
        accepted=torch.empty(batch, n_slots, dtype=torch.bool, device=device),
    )


def walk_fused(
    tree: DraftTree, target_tokens: torch.Tensor, *, out: Acceptance | None = None
) -> Acceptance:
    """:func:`ddtree.walk` in one launch over all requests (reads ``tree.ancestors``)."""
    _check_walk_inputs(tree, target_tokens)
    check_device(target_tokens)
    batch, n_slots = tree.tokens.shape
    depth = tree.max_depth
    acc = out or acceptance_buffers(batch, depth, n_slots, target_tokens.device)
    _walk_kernel[(batch,)](
        tree.tokens.contiguous(), tree.parents.contiguous(), tree.depths.contiguous(),
        tree.ancestors.contiguous(), target_tokens.contiguous(),
        acc.path, acc.num_accepted, acc.bonus, acc.emitted, acc.accepted.view(torch.uint8),
        n_slots, depth, NP=next_pow2(n_slots), D1P=next_pow2(depth + 1),
        num_warps=4 if n_slots <= 256 else 8,
    )  # fmt: skip
    return acc
