"""The paper's best-first heap and tree walk in plain Python: the oracle for the device code.

One request at a time. The heap pops prefixes in the total order documented in
:mod:`ddtree.tree` (score descending, then depth, then position within the depth); each pop
pushes the popped prefix's next sibling and first child. Scores are float32 sums, parent first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from ddtree.tree import LOGPROB_FLOOR


@dataclass
class ReferenceTree:
    """Nodes in pop order; index 0 is the root."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    scores: list[float] = field(default_factory=lambda: [0.0])

    def paths(self) -> dict[tuple[int, ...], float]:
        """Root-to-node token path of every non-root node -> its score."""
        out: dict[tuple[int, ...], float] = {}
        for i in range(1, len(self.tokens)):
            path, node = [], i
            while node > 0:
                path.append(self.tokens[node])
                node = self.parents[node]
            out[tuple(reversed(path))] = self.scores[i]
        return out


def ranked_logprobs(
    draft_logits: torch.Tensor, k: int
) -> tuple[list[list[np.float32]], list[list[int]]]:
    """Per depth, the top-``k`` tokens by (logit desc, id asc) and their float32 log-softmax
    (clamped at ``LOGPROB_FLOOR``, as on the device)."""
    logits = draft_logits.float() + 0.0
    logprobs = (logits - torch.logsumexp(logits, dim=-1, keepdim=True)).clamp(min=LOGPROB_FLOOR)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    lp_rows = [[np.float32(v) for v in logprobs[d, order[d]].tolist()] for d in range(len(order))]
    return lp_rows, order.tolist()


def build_tree_reference(
    draft_logits: torch.Tensor, budget: int, chain_seed: bool = False
) -> ReferenceTree:
    """The ``budget`` best prefixes of one request's ``draft_logits [D, V]``, by a heap."""
    depth, vocab = draft_logits.shape
    tree = ReferenceTree()
    if budget == 0:
        return tree
    logprobs, token_ids = ranked_logprobs(draft_logits, min(budget, vocab))
    width = len(token_ids[0])

    # A prefix is its tuple of ranks. Heap item: (-score, depth, order_key, ranks, score) where
    # order_key orders the prefixes of one depth: (-score, parent's order_key, last rank).
    def child(ranks: tuple[int, ...], score: np.float32, key: tuple, rank: int) -> tuple:
        child_score = np.float32(score + logprobs[len(ranks)][rank])
        return (
            -float(child_score),
            len(ranks) + 1,
            (-float(child_score), key, rank),
            ranks + (rank,),
            child_score,
        )

    chosen: dict[tuple[int, ...], tuple] = {}  # ranks -> (order_key, score)
    parent_of: dict[tuple[int, ...], tuple] = {(): ((), np.float32(0.0))}
    if chain_seed:  # the argmax chain: rank 0 at every depth
        ranks, score, key = (), np.float32(0.0), ()
        for _ in range(min(depth, budget)):
            _, _, key, ranks, score = child(ranks, score, key, 0)
            chosen[ranks] = (key, score)
    num_forced = len(chosen)

    heap = [child((), np.float32(0.0), (), 0)]
    num_others = 0
    while heap and num_others < budget - num_forced:
        _, d, key, ranks, score = heapq.heappop(heap)
        parent_of[ranks] = (key, score)
        if ranks not in chosen:
            chosen[ranks] = (key, score)
            num_others += 1
        if ranks[-1] + 1 < width:  # next sibling
            parent_key, parent_score = parent_of[ranks[:-1]]
            heapq.heappush(heap, child(ranks[:-1], parent_score, parent_key, ranks[-1] + 1))
        if d < depth:  # first child
            heapq.heappush(heap, child(ranks, score, key, 0))

    # Slots in the global order (score desc, depth, within-depth order), the forced chain
    # first: a parent precedes its children.
    forced = set(list(chosen)[:num_forced])

    def slot_order(r: tuple[int, ...]) -> tuple:
        return (r not in forced, -float(chosen[r][1]), len(r), chosen[r][0])

    slot_of: dict[tuple[int, ...], int] = {(): 0}
    for ranks in sorted(chosen, key=slot_order):
        slot_of[ranks] = len(tree.tokens)
        tree.tokens.append(token_ids[len(ranks) - 1][ranks[-1]])
        tree.parents.append(slot_of[ranks[:-1]])
        tree.depths.append(len(ranks))
        tree.scores.append(float(chosen[ranks][1]))
    return tree


def walk_reference(
    tokens: list[int], parents: list[int], target_tokens: list[int]
) -> tuple[list[int], int]:
    """Follow the target's tokens from the root: (accepted path of slots, bonus token)."""
    children: dict[int, list[int]] = {}
    for slot in range(1, len(tokens)):
        if parents[slot] >= 0:
            children.setdefault(parents[slot], []).append(slot)
    path = [0]
    while True:
        wanted = target_tokens[path[-1]]
        nxt = [c for c in children.get(path[-1], []) if tokens[c] == wanted]
        if not nxt:
            return path, wanted
        path.append(nxt[0])
