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
  request's state, then rolled back), ``tree_grammar_bitmask``;
- with a reasoning parser, while the request is still reasoning, each path is gated as vLLM
  gates a chain of drafts: rows are unconstrained up to the path's end-of-reasoning token, and
  from it on constrained by the grammar advanced through the tokens after it.

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


def reasoning_ends(reasoner, history: list[int], tokens: list[int], parents: list[int]):
    """Per draft ``s``: the index on its root path of the token that ends reasoning (the
    first such), or None while the path is still reasoning; the parser's streaming check as
    vLLM's scheduler runs it on a chain, over the node's own path."""
    ends: list[int | None] = [None]  # the root: still reasoning
    paths: list[list[int]] = [[]]
    for token, parent in zip(tokens, parents, strict=False):
        path = paths[parent] + [token]
        paths.append(path)
        if ends[parent] is not None:
            ends.append(ends[parent])
        elif token != -1 and reasoner.is_reasoning_end_streaming(history + path, [token]):
            ends.append(len(path) - 1)
        else:
            ends.append(None)
    return ends[1:]


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
            # Where each path's grammar content starts: at the root while the grammar applies;
            # while reasoning, after the path's end-of-reasoning token (None: not on it).
            starts: list[int | None] = [0] * len(drafts)
            if not apply:
                reasoner = manager._get_reasoner(request)
                starts = [None] * len(drafts)
                if reasoner is not None and not manager.enable_in_reasoning:
                    ends = reasoning_ends(reasoner, list(request.all_token_ids), drafts, parents)
                    starts = [None if e is None else e + 1 for e in ends]
            for slot, path in enumerate(root_paths(drafts, parents), start=1):
                start = starts[slot - 1]
                if start is None:  # still reasoning along this path: no mask
                    manager._fill_bitmasks(((grammar, row + slot, False),))
                    continue
                content = path[start:]
                # validate_tokens first: accept_tokens logs an ERROR ("Failed to advance FSM")
                # for every token it rejects, and a tree holds many nodes the grammar rejects.
                known = -1 not in path and not grammar.is_terminated()
                valid = known and len(grammar.validate_tokens(content)) == len(content)
                if valid and content:
                    grammar.accept_tokens(req_id, content)
                manager._fill_bitmasks(((grammar, row + slot, valid),))
                if valid and content:
                    grammar.rollback(len(content))
        row += 1 + len(drafts)
    return manager._grammar_bitmask[:row].numpy()
