"""Build the DDTree draft tree on the device: batched, fixed shapes, no host sync.

The tree holds the ``budget`` highest-scoring prefixes of draft tokens, where a prefix's score
is the sum of the drafter's log-probabilities along it (the paper's best-first heap gives the
same set). On the device this is a beam search of width ``budget`` over the depths followed by a
global top-``budget`` over all beams: a prefix in the global top set has its parent in the
previous depth's top set, so nothing is lost by keeping ``budget`` prefixes per depth.

Total order (how ties are broken, identically in :mod:`ddtree.reference`):

* the tokens of one depth are ranked by (logit descending, token id ascending);
* prefixes of one depth are ordered by (score descending, parent's position in its depth's
  order ascending, token rank ascending);
* prefixes of different depths by (score descending, depth ascending, position in depth).

Scores are float32 and summed parent-first, ``score(child) = score(parent) + logprob``. A parent
never comes after its child and an earlier sibling never after a later one, so the ``budget``
first prefixes of this order are prefix-closed and are exactly what the heap pops.

Every tie-break is encoded in one int64 sort key per candidate (for log-prob scores <= 0:
``(2**31 - 1 - index) - (bits of |score| << 31)``), so that ``topk``, which is not stable,
returns one deterministic order on every device. Log-probs are clamped at ``LOGPROB_FLOOR`` so
that -inf marks absent prefixes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_INDEX_BITS = 31
_INDEX_MASK = (1 << _INDEX_BITS) - 1
_FORCED_KEY = 1 << 62  # added to a _logprob_key: above every unforced key
LOGPROB_FLOOR = -1e30  # log-probs are clamped here so that every real prefix scores > -inf
MAX_BUDGET = 1 << 14  # keeps D * budget well inside the key's index field


@dataclass
class DraftTree:
    """A batch of draft trees, ``N = 1 + budget`` slots each, slot 0 the root.

    Nodes are in the global order of the prefixes (score descending, then depth, then position
    in their depth), with ``chain_seed``'s forced chain first: a parent precedes its children,
    and the first ``1 + K`` slots of a budget-B tree are exactly its budget-K tree for every
    K <= B (the best K prefixes are the best K of the best B), so a scheduler may verify any
    prefix of the slots. Padding slots (only when fewer than ``budget`` prefixes exist) come
    last, with token -1, parent -1, depth 0, and a mask row holding only themselves.
    """

    tokens: torch.Tensor  # long [b, N]: draft token per node; -1 at the root and padding
    parents: torch.Tensor  # long [b, N]: parent slot, -1 for the root and padding
    depths: torch.Tensor  # long [b, N]: 0 for root and padding, 1..D for nodes
    # bool [b, N, N]: row i is true at i and its ancestors (None from ddtree.kernels built
    # without it: ancestors and ancestor_bits say the same)
    mask: torch.Tensor | None
    scores: torch.Tensor  # float32 [b, N]: sum of draft logprobs (0 root, -inf padding)
    ancestors: torch.Tensor  # long [b, N, D+1]: k-th ancestor of each slot, saturating at 0
    num_nodes: torch.Tensor  # long [b]: real (non-root, non-padding) nodes
    # int32 [b, N, ceil(N/32)]: bit j of word w of row i set iff slot 32w+j is i or an ancestor
    # of i (the mask packed for attention kernels); filled by ddtree.kernels, None here.
    ancestor_bits: torch.Tensor | None = None

    @property
    def budget(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def max_depth(self) -> int:
        return self.ancestors.shape[2] - 1


def _order_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 [same shape] ordered like the float32 values of ``x`` (-0.0 folded into +0.0)."""
    bits = (x.float() + 0.0).view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()


def _sort_key(order: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 key: larger ``order`` first, then smaller ``index`` first."""
    return (order << _INDEX_BITS) | (_INDEX_MASK - index)


def _logprob_key(score: torch.Tensor, tiebreak: torch.Tensor) -> torch.Tensor:
    """int64 key for scores <= 0: higher score first, then higher ``tiebreak``.

    For float32 x <= 0 the bits of |x| grow as x falls, so the key is ``tiebreak - (|x| bits <<
    31)`` (|-0.0| folds into +0.0; -inf, the absent prefix, gets the lowest key).
    """
    magnitude = score.abs().view(torch.int32).long()
    return tiebreak - (magnitude << _INDEX_BITS)


def _check_inputs(draft_logits: torch.Tensor, budget: int, check_values: bool) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if budget > MAX_BUDGET:
        raise ValueError(f"budget must be <= {MAX_BUDGET}, got {budget}")
    if not isinstance(draft_logits, torch.Tensor):
        raise ValueError(f"draft_logits must be a torch.Tensor, got {type(draft_logits).__name__}")
    if draft_logits.dim() != 3:
        raise ValueError(
            f"draft_logits must be 3-D [batch, depth, vocab], got shape {tuple(draft_logits.shape)}"
        )
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be floating point, got {draft_logits.dtype}")
    if min(draft_logits.shape) == 0:
        raise ValueError(f"draft_logits must be non-empty, got shape {tuple(draft_logits.shape)}")
    if draft_logits.shape[2] > 1 << 24:  # token ids must be exact in float32
        raise ValueError(f"draft_logits vocabulary too large: {draft_logits.shape[2]}")
    if check_values and not _in_capture():
        if not bool(torch.isfinite(draft_logits).all()):
            raise ValueError("draft_logits contains NaN or inf")


def _in_capture() -> bool:
    """Inside torch.compile tracing or CUDA-graph capture a value check would need a host sync."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def draft_topk(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` tokens per depth in rank order and their float32 log-probabilities.

    Returns ``(logprobs [b, D, k] float32, token_ids [b, D, k] long)``, ranked by (logit
    descending, token id ascending). Only the top-``k`` log-softmax values are formed:
    ``logit - logsumexp(logits)``, clamped at ``LOGPROB_FLOOR``.

    A float ``topk`` picks the set, but it may take any of the tokens tied at the k-th value
    and order ties freely. So the tokens strictly above the k-th value are kept, the slots left
    are refilled with the smallest ids tied at it (a second float ``topk``, over minus the ids
    of the tied tokens), and the k winners are sorted by an exact int64 key.
    """
    logits = draft_logits.float() + 0.0  # [b, D, V], -0.0 folded into +0.0
    top_values, top_ids = logits.topk(k, dim=-1)  # [b, D, k], descending
    kth = top_values[..., k - 1 :]  # [b, D, 1]
    num_above = (top_values > kth).sum(-1, keepdim=True)  # [b, D, 1] (< k)
    vocab_ids = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.float32)
    minus_tied_ids = torch.where(logits == kth, -vocab_ids, -float(logits.shape[-1]))  # [b, D, V]
    tied_ids = (-minus_tied_ids.topk(k, dim=-1).values).long()  # [b, D, k]: smallest first
    slot = torch.arange(k, device=logits.device)  # [k]
    from_tied = tied_ids.gather(-1, (slot - num_above).clamp(min=0))  # [b, D, k]
    ids = torch.where(slot < num_above, top_ids, from_tied)  # [b, D, k]
    values = logits.gather(-1, ids)
    key = _sort_key(_order_bits(values), ids)
    order = key.sort(dim=-1, descending=True).indices  # [b, D, k]
    ids = ids.gather(-1, order)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [b, D, 1]
    logprobs = (values.gather(-1, order) - lse).clamp(min=LOGPROB_FLOOR)
    return logprobs, ids


def _pruned_candidates(
    budget: int, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent position, rank) pairs that can reach the top-``budget`` of a depth.

    The child of the i-th parent (0-based) at rank r is beaten by the (i+1)(r+1)-1 children of
    parents <= i at ranks <= r, so it can be among the best ``budget`` only if (i+1)(r+1) <=
    budget. Pairs are laid out in (parent, rank) order, which is the tie-break order.
    Returns ``(parent_pos [M], rank [M])``, M ~ budget * ln(budget).
    """
    parent = torch.arange(budget, device=device)
    counts = torch.clamp(budget // (parent + 1), max=k)  # [budget]
    num = sum(min(k, budget // (i + 1)) for i in range(budget))
    cand_parent = torch.repeat_interleave(parent, counts, output_size=num)  # [M]
    starts = torch.cumsum(counts, 0) - counts  # [budget]
    cand_rank = torch.arange(num, device=device) - starts[cand_parent]  # [M]
    return cand_parent, cand_rank


def build_tree(
    draft_logits: torch.Tensor,
    budget: int,
    *,
    chain_seed: bool = False,
    check_values: bool = True,
) -> DraftTree:
    """Build the DDTree of the ``budget`` best prefixes for each request.

    Args:
        draft_logits: float ``[b, D, V]`` drafter logits for depths 1..D.
        budget: number of non-root nodes B (>= 0); the verify width is 1 + B.
        chain_seed: force the drafter's argmax chain (depths 1..min(D, B)) into the tree,
            displacing the lowest-ranked other nodes, so acceptance is never below the chain's.
        check_values: reject NaN/inf logits. This reads a value on the host (a sync); it is
            skipped inside torch.compile tracing and CUDA-graph capture, and engines pass False
            in their per-step path.
    """
    _check_inputs(draft_logits, budget, check_values)
    batch, depth, vocab = draft_logits.shape
    if budget == 0:
        return _root_only(batch, depth, draft_logits.device)
    logprobs, token_ids = draft_topk(draft_logits, min(budget, vocab))  # [b, D, k] each
    return tree_from_ranked(logprobs, token_ids, budget, chain_seed=chain_seed)


def tree_from_ranked(
    logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int, *, chain_seed: bool = False
) -> DraftTree:
    """The tree stage of :func:`build_tree`, from ``draft_topk``'s ranked ``logprobs`` float32
    and ``token_ids`` long, both ``[b, D, k]`` with ``k = min(budget, vocab)``, budget >= 1.

    It depends on nothing but these small tensors and ``budget``: engines capture it in a CUDA
    graph per (batch, budget) shape, while the vocabulary stage stays outside.
    """
    batch, depth, k = logprobs.shape
    device = logprobs.device
    n_slots = 1 + budget
    # Depth 1: the k ranked tokens, then -inf (absent) up to the beam width.
    beam_score = torch.nn.functional.pad(logprobs[:, 0], (0, budget - k), value=float("-inf"))
    scores, picks = [beam_score], []  # per depth: [b, B] scores, [b, B] candidate picked

    cand_parent, cand_rank = _pruned_candidates(budget, k, device)  # [M] each
    cand_tiebreak = _INDEX_MASK - torch.arange(cand_parent.shape[0], device=device)  # [M]
    cand_logprobs = logprobs[:, :, cand_rank]  # [b, D, M]
    for d in range(1, depth):
        cand_score = beam_score[:, cand_parent] + cand_logprobs[:, d]  # [b, M]
        pick = _logprob_key(cand_score, cand_tiebreak).topk(budget, dim=-1).indices  # [b, B]
        beam_score = cand_score.gather(1, pick)
        scores.append(beam_score)
        picks.append(pick)

    # Per depth and beam position: parent position in the previous beam and token rank.
    position = torch.arange(budget, device=device).expand(batch, 1, budget)
    if picks:
        pick = torch.stack(picks, 1)  # [b, D-1, B]
        beam_parent = torch.cat([torch.zeros_like(position), cand_parent[pick]], 1)  # [b, D, B]
        beam_rank = torch.cat([position, cand_rank[pick]], 1)  # [b, D, B]
    else:
        beam_parent, beam_rank = torch.zeros_like(position), position

    # Global top-B over the D beams, flat index = depth_index * B + position.
    flat_score = torch.stack(scores, 1).flatten(1)  # [b, D*B]
    flat_valid = flat_score > float("-inf")  # real prefixes; absent ones are -inf
    flat_index = torch.arange(depth * budget, device=device)  # [D*B]
    key = _logprob_key(flat_score, _INDEX_MASK - flat_index)
    if chain_seed:  # the argmax chain is position 0 of every beam
        key = torch.where(flat_index % budget == 0, key + _FORCED_KEY, key)
    # Slot order = key order (topk sorts): forced chain, then score, depth, position; absent
    # prefixes (-inf) last. Every prefix of it is a tree (a child scores <= its parent and
    # sits deeper).
    node_flat = key.topk(budget, dim=-1).indices  # [b, B]
    node_valid = flat_valid.gather(1, node_flat)  # [b, B]

    node_depth = node_flat // budget + 1  # [b, B]
    node_parent_pos = beam_parent.flatten(1).gather(1, node_flat)  # [b, B]
    parent_flat = (node_depth - 2) * budget + node_parent_pos  # [b, B]
    node_rank = beam_rank.flatten(1).gather(1, node_flat).clamp(max=k - 1)  # [b, B]
    node_token = token_ids.flatten(1).gather(1, (node_depth - 1) * k + node_rank)  # [b, B]
    slot_of_flat = torch.full((batch, depth * budget), -1, dtype=torch.long, device=device)
    slots = torch.arange(1, n_slots, device=device).expand(batch, budget)
    slot_of_flat.scatter_(1, node_flat, slots)
    node_parent = torch.where(node_depth == 1, 0, slot_of_flat.gather(1, parent_flat.clamp(min=0)))

    root_long = torch.zeros(batch, 1, dtype=torch.long, device=device)
    tree_tokens = torch.cat([root_long - 1, torch.where(node_valid, node_token, -1)], 1)
    tree_parents = torch.cat([root_long - 1, torch.where(node_valid, node_parent, -1)], 1)
    tree_depths = torch.cat([root_long, torch.where(node_valid, node_depth, 0)], 1)
    tree_scores = torch.cat(
        [
            torch.zeros(batch, 1, device=device),
            torch.where(node_valid, flat_score.gather(1, node_flat), float("-inf")),
        ],
        1,
    )
    ancestors, mask = _ancestry(tree_parents, depth)
    return DraftTree(
        tokens=tree_tokens,
        parents=tree_parents,
        depths=tree_depths,
        mask=mask,
        scores=tree_scores,
        ancestors=ancestors,
        num_nodes=node_valid.sum(1),
    )


def _ancestry(parents: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k-th ancestors ``[b, N, D+1]`` (root and padding point at themselves) and the mask."""
    batch, n_slots = parents.shape
    slot = torch.arange(n_slots, device=parents.device).expand(batch, n_slots)
    step = torch.where(parents >= 0, parents, slot)  # [b, N]: parent, self for root/padding
    chain = [slot]
    for _ in range(depth):
        chain.append(step.gather(1, chain[-1]))
    ancestors = torch.stack(chain, 2)  # [b, N, D+1]
    mask = torch.zeros(batch, n_slots, n_slots, dtype=torch.bool, device=parents.device)
    mask.scatter_(2, ancestors, True)
    return ancestors, mask


def _root_only(batch: int, depth: int, device: torch.device) -> DraftTree:
    zeros = torch.zeros(batch, 1, dtype=torch.long, device=device)
    return DraftTree(
        tokens=zeros - 1,
        parents=zeros - 1,
        depths=zeros.clone(),
        mask=torch.ones(batch, 1, 1, dtype=torch.bool, device=device),
        scores=torch.zeros(batch, 1, device=device),
        ancestors=torch.zeros(batch, 1, depth + 1, dtype=torch.long, device=device),
        num_nodes=torch.zeros(batch, dtype=torch.long, device=device),
    )


def chain_tree(draft_tokens: torch.Tensor, max_depth: int | None = None) -> DraftTree:
    """The plain DFlash chain as a tree: node d holds ``draft_tokens[:, d-1]``, parent d-1.

    ``draft_tokens`` long ``[b, K]`` (e.g. the drafter's argmax per depth). ``ancestors`` has
    ``max_depth + 1`` columns (default K + 1). With ``chain_seed``, :func:`build_tree` at a
    budget K <= D gives this tree (the argmax chain, ties to the lower id).
    """
    batch, depth = draft_tokens.shape
    device = draft_tokens.device
    slot = torch.arange(depth + 1, device=device)
    slots = slot.expand(batch, depth + 1)
    root = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    tokens = torch.cat([root, draft_tokens.long()], 1)
    # A chain's k-th ancestor of slot j is slot j - k, the root past it: a few launches (the
    # V2 drafter builds this inside its graphs at large batches), not D rounds of gathers.
    lag = torch.arange(max(depth, max_depth or 0) + 1, device=device)
    ancestors = (slot[:, None] - lag[None, :]).clamp(min=0).expand(batch, -1, -1).contiguous()
    mask = (slot[None, :] <= slot[:, None]).expand(batch, -1, -1).contiguous()
    return DraftTree(
        tokens=tokens,
        parents=slots - 1,
        depths=slots.clone(),
        mask=mask,
        scores=torch.zeros(batch, depth + 1, device=device),
        ancestors=ancestors,
        num_nodes=torch.full((batch,), depth, dtype=torch.long, device=device),
    )
