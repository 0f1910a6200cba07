"""Walk a draft tree with the target's tokens on the device: fixed shapes, no host sync.

Node i is accepted iff its parent is accepted and ``tokens[i] == target_tokens[parent[i]]``.
Siblings carry distinct tokens, so the accepted nodes form one path from the root; the bonus
token is the target's token at the deepest accepted node. With ``target_tokens`` the target's
argmax (greedy) or a sample from its processed distribution at every node, the emitted tokens
(accepted + bonus) follow the target exactly: the walk is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree import DraftTree


@dataclass
class Acceptance:
    """Result of walking a batch of trees; ``D`` is the tree's draft horizon."""

    path: torch.Tensor  # long [b, D+1]: slots from the root (0) along the accepted path, -1 pad
    num_accepted: torch.Tensor  # long [b]: accepted non-root nodes
    bonus: torch.Tensor  # long [b]: target token at the deepest accepted node
    emitted: torch.Tensor  # long [b, D+1]: accepted draft tokens then the bonus, -1 pad
    accepted: torch.Tensor  # bool [b, N]: accepted slots (the root included)


def _check_inputs(tree: DraftTree, target_tokens: torch.Tensor) -> None:
    if not isinstance(target_tokens, torch.Tensor):
        raise ValueError(
            f"target_tokens must be a torch.Tensor, got {type(target_tokens).__name__}"
        )
    if target_tokens.shape != tree.tokens.shape:
        raise ValueError(
            f"target_tokens must have shape {tuple(tree.tokens.shape)} (one token per tree slot), "
            f"got {tuple(target_tokens.shape)}"
        )
    if target_tokens.dtype != torch.long:
        raise ValueError(f"target_tokens must be torch.long, got {target_tokens.dtype}")
    if target_tokens.device != tree.tokens.device:
        raise ValueError(
            f"target_tokens is on {target_tokens.device} but the tree is on {tree.tokens.device}"
        )


def walk(tree: DraftTree, target_tokens: torch.Tensor) -> Acceptance:
    """Accept the longest tree path that the target's tokens agree with."""
    _check_inputs(tree, target_tokens)
    batch, n_slots = tree.tokens.shape
    max_depth = tree.max_depth
    slot = torch.arange(n_slots, device=target_tokens.device).expand(batch, n_slots)
    parent = torch.where(tree.parents >= 0, tree.parents, slot)  # [b, N]
    target_at_parent = target_tokens.gather(1, parent)  # [b, N]
    matches = (tree.tokens == target_at_parent) & (tree.tokens >= 0)  # [b, N]
    matches[:, 0] = True  # the root is always accepted
    ancestors = tree.ancestors.flatten(1)  # [b, N*(D+1)]
    accepted = matches.gather(1, ancestors).view(batch, n_slots, max_depth + 1).all(-1)  # [b, N]

    # Deepest accepted slot (the first one if two tied, the root if none): an amax over
    # depth * N + (N - 1 - slot). (argmax here is miscompiled by inductor on the CPU in 2.11.)
    key = torch.where(accepted, tree.depths * n_slots + (n_slots - 1 - slot), n_slots - 1)
    deepest = (n_slots - 1) - key.amax(1, keepdim=True) % n_slots  # [b, 1]
    num_accepted = tree.depths.gather(1, deepest)  # [b, 1]
    bonus = target_tokens.gather(1, deepest)  # [b, 1]

    step = torch.arange(max_depth + 1, device=target_tokens.device)  # [D+1]
    up = (num_accepted - step).clamp(min=0)  # [b, D+1]: ancestor level of path step j
    on_path = step <= num_accepted  # [b, D+1]
    path_ancestors = tree.ancestors.gather(
        1, deepest.unsqueeze(2).expand(batch, 1, max_depth + 1)
    ).squeeze(1)  # [b, D+1]
    path = torch.where(on_path, path_ancestors.gather(1, up), -1)  # [b, D+1]

    next_slot = torch.cat([path[:, 1:], path[:, :1]], 1).clamp(min=0)  # [b, D+1]
    draft_tokens = tree.tokens.gather(1, next_slot)
    emitted = torch.where(step < num_accepted, draft_tokens, -1)
    emitted = torch.where(step == num_accepted, bonus, emitted)
    return Acceptance(
        path=path,
        num_accepted=num_accepted.squeeze(1),
        bonus=bonus.squeeze(1),
        emitted=emitted,
        accepted=accepted,
    )
