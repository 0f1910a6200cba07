"""The scheduler's structured-output work per step for DDTree trees (host, CPU): the grammar
bitmask rows of 16 requests' trees with vLLM's xgrammar backend on the bundled tokenizer,
``v1/grammar.tree_grammar_bitmask`` (depth first: one grammar advance per node) vs a per-path
reference (each node's whole root path validated, accepted and rolled back), rows compared.

    python benchmarks/grammar_tree.py --budgets 15,63 --requests 16
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
# Code-like text, so that most drafted tokens keep the grammar alive (the costly case).
ALPHABET = "abcdefghijklmnopqrstuvwxyz =(),.:_0123456789\n"
REGEX = r"[a-z =(),.:_0-9\n]{0,400}"


def per_path_rows(manager, requests, request_ids, spec_tokens, tree_parents):
    """Reference: row s = the grammar's mask after draft s's whole root path."""
    row = 0
    for req_id in request_ids:
        grammar = requests[req_id].structured_output_request.grammar
        manager._fill_bitmasks(((grammar, row, True),))
        drafts, parents = spec_tokens[req_id], tree_parents[req_id]
        paths: list[list[int]] = [[]]
        for slot, (token, parent) in enumerate(zip(drafts, parents, strict=True), start=1):
            path = paths[parent] + [token]
            paths.append(path)
            valid = len(grammar.validate_tokens(path)) == len(path)
            if valid:
                grammar.accept_tokens(req_id, path)
            manager._fill_bitmasks(((grammar, row + slot, valid),))
            if valid:
                grammar.rollback(len(path))
        row += 1 + len(drafts)
    return manager._grammar_bitmask[:row].numpy()


def tree_parents(budget: int, rng: random.Random) -> list[int]:
    """A chain at B=15 (what a chain-seeded DDTree verifies at the chain's size); else a
    random tree of depth <= 15 that favours recent nodes (deep paths, as drafts give)."""
    if budget == 15:
        return list(range(15))
    parents, depth = [], [0]
    for slot in range(1, budget + 1):
        parent = rng.choice([q for q in range(slot) if depth[q] < 15][-12:])
        parents.append(parent)
        depth.append(depth[parent] + 1)
    return parents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="15,63")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    from ddtree.vllm_plugin.v1.grammar import tree_grammar_bitmask

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "target")
    budgets = [int(b) for b in args.budgets.split(",")]
    config = SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=False),
        speculative_config=SimpleNamespace(num_speculative_tokens=max(budgets)),
    )
    backend = XgrammarBackend(vllm_config=config, tokenizer=tokenizer, vocab_size=len(tokenizer))
    code_tokens = [t for t in range(len(tokenizer)) if set(tokenizer.decode([t])) <= set(ALPHABET)]

    class Manager:  # the two StructuredOutputManager members the row filling uses
        def __init__(self, rows: int):
            self._grammar_bitmask = backend.allocate_token_bitmask(rows)

        def should_fill_bitmask(self, request) -> bool:
            return True

        def _fill_bitmasks(self, batch) -> None:
            for grammar, index, apply in batch:
                if apply:
                    grammar.fill_bitmask(self._grammar_bitmask, index)
                else:
                    self._grammar_bitmask[index].fill_(-1)

    rng = random.Random(0)
    print(f"{args.requests} requests, regex {REGEX!r}, ms per step (one bitmask of all trees):")
    print("| B | per path | depth first | same rows |\n|---:|---:|---:|---|")
    for budget in budgets:
        requests, drafts, parents = {}, {}, {}
        for r in range(args.requests):
            grammar = backend.compile_grammar(StructuredOutputOptions.REGEX, REGEX)
            requests[f"r{r}"] = SimpleNamespace(
                structured_output_request=SimpleNamespace(grammar=grammar)
            )
            drafts[f"r{r}"] = [rng.choice(code_tokens) for _ in range(budget)]
            parents[f"r{r}"] = tree_parents(budget, rng)
        ids = list(requests)
        timed = {}
        for name, fill in (("per path", per_path_rows), ("depth first", tree_grammar_bitmask)):
            manager = Manager(args.requests * (1 + budget))
            fill(manager, requests, ids, drafts, parents)  # warm
            start = time.perf_counter()
            for _ in range(args.repeats):
                rows = fill(manager, requests, ids, drafts, parents).copy()
            timed[name] = (1e3 * (time.perf_counter() - start) / args.repeats, rows)
        same = bool((timed["per path"][1] == timed["depth first"][1]).all())
        print(f"| {budget} | {timed['per path'][0]:.2f} | {timed['depth first'][0]:.2f} | {same} |")


if __name__ == "__main__":
    main()
