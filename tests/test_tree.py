import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree
from ddtree.reference import build_tree_reference
from ddtree.tree import chain_tree

from helpers import KINDS, make_logits, tree_paths

shapes = st.tuples(
    st.integers(1, 4),  # batch
    st.integers(1, 16),  # depth D
    st.integers(2, 300),  # vocabulary V
    st.integers(0, 1100),  # budget B
)


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from(KINDS), st.booleans(), st.integers(0, 2**31 - 1))
def test_matches_reference_heap(shape, kind, chain_seed, seed):
    batch, depth, vocab, budget = shape
    logits = make_logits(kind, batch, depth, vocab, seed)
    tree = ddtree.build_tree(logits, budget, chain_seed=chain_seed)
    for row in range(batch):
        ref = build_tree_reference(logits[row], budget, chain_seed=chain_seed)
        assert tree_paths(tree, row) == ref.paths()
        # Same slot order too (forced chain, then score, depth, within-depth order).
        n = len(ref.tokens)
        assert tree.tokens[row, :n].tolist() == ref.tokens
        assert tree.parents[row, :n].tolist() == ref.parents
        assert tree.depths[row, :n].tolist() == ref.depths


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from(KINDS), st.booleans(), st.integers(0, 2**31 - 1), st.data())
def test_slot_prefix_is_the_smaller_budget_tree(shape, kind, chain_seed, seed, data):
    """The first 1 + K slots of a budget-B tree are the budget-K tree (what a scheduler that
    verifies only K of the B drafts gets), for any K <= B."""
    batch, depth, vocab, budget = shape
    logits = make_logits(kind, batch, depth, vocab, seed)
    tree = ddtree.build_tree(logits, budget, chain_seed=chain_seed)
    k = data.draw(st.integers(0, budget))
    small = ddtree.build_tree(logits, k, chain_seed=chain_seed)
    for name in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(tree, name)[:, : k + 1], getattr(small, name)), name


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from(KINDS), st.booleans(), st.integers(0, 2**31 - 1))
def test_tree_invariants(shape, kind, chain_seed, seed):
    batch, depth, vocab, budget = shape
    tree = ddtree.build_tree(
        make_logits(kind, batch, depth, vocab, seed), budget, chain_seed=chain_seed
    )
    n_slots = budget + 1
    for name in ("tokens", "parents", "depths", "scores"):
        assert getattr(tree, name).shape == (batch, n_slots), name
    assert tree.mask.shape == (batch, n_slots, n_slots) and tree.mask.dtype == torch.bool
    assert tree.ancestors.shape == (batch, n_slots, depth + 1)
    lattice = sum(vocab**d for d in range(1, depth + 1))
    assert tree.num_nodes.tolist() == [min(budget, lattice)] * batch
    for row in range(batch):
        tokens, parents = tree.tokens[row].tolist(), tree.parents[row].tolist()
        depths, scores = tree.depths[row].tolist(), tree.scores[row].tolist()
        mask = tree.mask[row]
        real = int(tree.num_nodes[row])
        assert tokens[0] == -1 and parents[0] == -1 and depths[0] == 0
        siblings = set()
        for i in range(1, n_slots):
            expected_row = torch.zeros(n_slots, dtype=torch.bool)
            if i <= real:
                p = parents[i]
                assert 0 <= p < i
                assert depths[i] == depths[p] + 1 <= depth
                assert 0 <= tokens[i] < vocab
                assert scores[i] <= scores[p]
                assert (p, tokens[i]) not in siblings  # siblings carry distinct tokens
                siblings.add((p, tokens[i]))
                node = i
                while node >= 0:
                    expected_row[node] = True
                    node = parents[node]
                # Slots in score order, the forced chain first (only after it may a score rise).
                if i != (min(depth, budget) if chain_seed else 0) + 1:
                    assert scores[i] <= scores[i - 1]
            else:  # padding
                assert tokens[i] == -1 and parents[i] == -1 and depths[i] == 0
                expected_row[i] = True
            assert torch.equal(mask[i], expected_row), i
        assert mask[0].tolist() == [True] + [False] * budget


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from(KINDS), st.integers(0, 2**31 - 1))
def test_chain_seed_holds_the_argmax_chain(shape, kind, seed):
    batch, depth, vocab, budget = shape
    logits = make_logits(kind, batch, depth, vocab, seed)
    seeded = ddtree.build_tree(logits, budget, chain_seed=True)
    plain = ddtree.build_tree(logits, budget)
    # argmax with the documented tie-break: smallest token id among the maxima.
    chain = [logits[:, d].argmax(-1) for d in range(depth)]  # first max = smallest id
    for row in range(batch):
        paths = tree_paths(seeded, row)
        for d in range(1, min(depth, budget) + 1):
            assert tuple(int(chain[i][row]) for i in range(d)) in paths
        # Only the lowest-scoring other nodes are displaced: the non-chain nodes of the seeded
        # tree are the best non-chain nodes of the plain one.
        chain_paths = {tuple(int(chain[i][row]) for i in range(d)) for d in range(1, depth + 1)}
        plain_paths = tree_paths(plain, row)
        others = set(paths) - chain_paths
        assert others <= set(plain_paths)
        dropped = set(plain_paths) - set(paths)
        if dropped and others:
            assert max(plain_paths[p] for p in dropped) <= min(paths[p] for p in others)
        assert len(paths) == len(plain_paths)


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from(KINDS), st.integers(0, 2**31 - 1))
def test_chain_sized_seeded_tree_is_the_argmax_chain_tree(shape, kind, seed):
    """At a budget K <= D, ``chain_seed`` gives exactly ``chain_tree`` of the argmax chain
    (the V2 drafter drafts chain-sized buckets that way, without a tree build)."""
    batch, depth, vocab, budget = shape
    budget = 1 + budget % depth  # 1..D
    logits = make_logits(kind, batch, depth, vocab, seed)
    seeded = ddtree.build_tree(logits, budget, chain_seed=True)
    chain = chain_tree(logits[:, :budget].argmax(-1), max_depth=depth)
    for name in ("tokens", "parents", "depths", "mask", "ancestors", "num_nodes"):
        assert torch.equal(getattr(chain, name), getattr(seeded, name)), name


def test_budget_zero_is_root_only():
    tree = ddtree.build_tree(torch.randn(3, 5, 7), 0)
    assert tree.tokens.tolist() == [[-1]] * 3
    assert tree.mask.tolist() == [[[True]]] * 3
    assert tree.num_nodes.tolist() == [0, 0, 0]


def test_small_lattice_is_padded():
    # V=2, D=2: 2 + 4 = 6 prefixes, budget 10 -> 4 padding slots.
    tree = ddtree.build_tree(torch.randn(1, 2, 2), 10)
    assert tree.num_nodes.tolist() == [6]
    assert tree.tokens[0, 7:].tolist() == [-1] * 4


def test_half_precision_logits():
    logits = torch.randn(2, 4, 50)
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype)
        tree = ddtree.build_tree(low, 20)
        for row in range(2):
            assert tree_paths(tree, row) == build_tree_reference(low[row], 20).paths()


@pytest.mark.parametrize(
    "logits, budget, message",
    [
        (torch.randn(1, 3, 5), -1, "budget must be >= 0"),
        (torch.randn(1, 3, 5), 2.0, "budget must be an int"),
        (torch.randn(1, 3, 5), True, "budget must be an int"),
        (torch.randn(1, 3, 5), 1 << 20, "budget must be <="),
        (torch.randn(3, 5), 4, "draft_logits must be 3-D"),
        (torch.randn(1, 2, 3, 5), 4, "draft_logits must be 3-D"),
        (torch.randint(0, 5, (1, 3, 5)), 4, "draft_logits must be floating point"),
        (torch.randn(1, 0, 5), 4, "draft_logits must be non-empty"),
        (torch.tensor([[[0.0, float("nan")]]]), 4, "draft_logits contains NaN or inf"),
        (torch.tensor([[[0.0, float("inf")]]]), 4, "draft_logits contains NaN or inf"),
        (torch.tensor([[[0.0, float("-inf")]]]), 4, "draft_logits contains NaN or inf"),
        ([[[0.0, 1.0]]], 4, "draft_logits must be a torch.Tensor"),
    ],
)
def test_bad_input(logits, budget, message):
    with pytest.raises(ValueError, match=message):
        ddtree.build_tree(logits, budget)
