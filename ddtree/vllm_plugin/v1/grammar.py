"""Structured output on the V1 runner: a grammar bitmask per tree node.

vLLM's scheduler fills one bitmask row per scheduled draft, advancing the request's grammar
through the drafts as a chain, and cuts the drafts at the first one the grammar rejects. A
DDTree request's drafts are tree nodes (slot order, a parent before its children): node s may
only emit what the grammar allows after the tokens on its own root path. So, for DDTree
engines:

- the drafts are kept whole (``Scheduler.update_draft_token_ids`` without the chain check): a
  node the grammar rejects is never accepted, because its token is masked out of its parent's
  row, where the target draws the token it is compared with;
- row s of a request's bitmask is the grammar's mask after its root path, ``tree_grammar_bitmask``:
  the tree is walked depth first, the grammar advanced one token on the way down and rolled
  back on the way up (one advance per node, as vLLM's per draft of a chain);
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


def _fill_tree_rows(manager, grammar, req_id, row, drafts, parents, apply, reasoning) -> None:
    """Bitmask rows ``row + s`` of one request's drafts ``s``, depth first from the root: the
    grammar moves one token per node (accepted on the way down, rolled back on the way up), as
    vLLM advances it once per draft of a chain. A node's row is its path's grammar mask; no
    mask (any token) where the path is still reasoning, holds a placeholder (-1), or leaves
    the grammar (such a node is never accepted: its token is masked out of its parent's row).
    ``apply``: the grammar applies from the root; else ``reasoning`` = (parser, tokens so far)
    while the request reasons, None when nothing gates (its rows take no mask)."""
    children: list[list[int]] = [[] for _ in range(len(drafts) + 1)]
    for slot, parent in enumerate(parents[: len(drafts)], start=1):
        if not 0 <= parent < slot:
            raise RuntimeError(f"ddtree: draft {slot} has parent {parent}, not an earlier slot")
        children[parent].append(slot)
    usable = not grammar.is_terminated()

    def visit(slot: int, mode: str, path: list[int]) -> None:
        # mode: "grammar" (the grammar is at the parent's state), "reasoning", "free" (no mask)
        token = drafts[slot - 1]
        path = path + [token] if mode == "reasoning" else path
        accepted = False
        if token == -1 or mode == "free":
            mode = "free"
        elif mode == "reasoning":
            reasoner, history = reasoning
            if reasoner.is_reasoning_end_streaming(history + path, [token]):
                mode = "grammar" if usable else "free"  # the grammar applies from here on
        elif usable and len(grammar.validate_tokens([token])) == 1:
            # validate first: accept_tokens logs an ERROR ("Failed to advance FSM") for every
            # token it rejects, and a tree holds many nodes the grammar rejects
            grammar.accept_tokens(req_id, [token])
            accepted = True
        else:
            mode = "free"
        manager._fill_bitmasks(((grammar, row + slot, mode == "grammar"),))
        for child in children[slot]:
            visit(child, mode, path)
        if accepted:
            grammar.rollback(1)

    start = "grammar" if apply and usable else "reasoning" if reasoning else "free"
    for child in children[0]:
        visit(child, start, [])


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
            reasoning = None  # while the request reasons: (its parser, its tokens so far)
            if not apply:
                reasoner = manager._get_reasoner(request)
                if reasoner is not None and not manager.enable_in_reasoning:
                    reasoning = (reasoner, list(request.all_token_ids))
            _fill_tree_rows(manager, grammar, req_id, row, drafts, parents, apply, reasoning)
        row += 1 + len(drafts)
    return manager._grammar_bitmask[:row].numpy()
