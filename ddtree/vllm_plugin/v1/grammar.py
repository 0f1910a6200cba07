"""Structured output on the V1 runner: a grammar bitmask per tree node.

vLLM's scheduler fills one bitmask row per scheduled draft, advancing the request's grammar
through the drafts as a chain, and cuts the drafts at the first one the grammar rejects. A
DDTree request's drafts are tree nodes (slot order, a parent before its children): node s may
only emit what the grammar allows after the tokens on its own root path. So, for DDTree
engines:

- the drafts are kept whole (``Scheduler.update_draft_token_ids`` without the chain check): a
  node the grammar rejects is never accepted, because its token is masked out of its parent's
  row, where the target draws the token it is compared with;
- row s of a request's bitmask is the grammar's mask after its root path (advanced from the
  request's state, then rolled back), ``tree_grammar_bitmask``.

The scheduler learns each node's parent from the proposer: the runner's draft tokens go to the
scheduler as a ``TreeDraftTokenIds`` (vLLM's ``DraftTokenIds`` plus the parents of the
structured-output requests' drafts), through whatever carries them between the worker and the
engine core processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.outputs import DraftTokenIds


@dataclass
class TreeDraftTokenIds(DraftTokenIds):
    """vLLM's draft tokens of a step, with each structured-output request's tree shape."""

    ddtree_parents: dict[str, list[int]] = field(default_factory=dict)


def root_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Per draft ``s`` (``tokens[s - 1]``, parent slot ``parents[s - 1]``; slot 0 is the root):
    the draft tokens from the root down to ``s``."""
    paths: list[list[int]] = [[]]
    for slot, (token, parent) in enumerate(zip(tokens, parents, strict=False), start=1):
        if not 0 <= parent < slot:
            raise RuntimeError(f"ddtree: draft {slot} has parent {parent}, not an earlier slot")
        paths.append(paths[parent] + [token])
    return paths[1:]


def tree_grammar_bitmask(manager, requests, request_ids, spec_tokens, tree_parents):
    """``StructuredOutputManager.grammar_bitmask`` for a DDTree engine: the bitmask rows of
    every structured request, root row then one per scheduled draft (vLLM's layout, which
    ``apply_grammar_bitmask`` maps onto the logits rows in the same order)."""
    if not request_ids:
        return None
    if manager._grammar_bitmask is None:
        max_rows = manager.vllm_config.scheduler_config.max_num_seqs * (
            1 + manager.vllm_config.num_speculative_tokens
        )
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(max_rows)
    row = 0
    for req_id in request_ids:
        request = requests[req_id]
        grammar = request.structured_output_request.grammar
        apply = manager.should_fill_bitmask(request)
        manager._fill_bitmasks(((grammar, row, apply),))  # the root: the request's state
        drafts = list(spec_tokens.get(req_id, ()))
        if drafts:
            parents = tree_parents.get(req_id)
            if parents is None and all(token == -1 for token in drafts):
                # Drafts not known to the scheduler (async placeholders): vLLM leaves their
                # rows unmasked, and so does this (every path holds a -1).
                parents = list(range(len(drafts)))
            if parents is None or len(parents) < len(drafts):
                raise RuntimeError(
                    f"ddtree: no tree shape reached the scheduler for structured-output "
                    f"request {req_id}"
                )
            for slot, path in enumerate(root_paths(drafts, parents), start=1):
                # validate_tokens first: accept_tokens logs an ERROR ("Failed to advance FSM")
                # for every token it rejects, and a tree holds many nodes the grammar rejects.
                known = -1 not in path and not grammar.is_terminated()
                accepted = grammar.validate_tokens(path) if known else []
                valid = len(accepted) == len(path)
                if valid:
                    grammar.accept_tokens(req_id, path)
                manager._fill_bitmasks(((grammar, row + slot, apply and valid),))
                if valid:
                    grammar.rollback(len(path))
        row += 1 + len(drafts)
    return manager._grammar_bitmask[:row].numpy()
