import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree
from ddtree.reference import walk_reference

from helpers import KINDS, agreeing_targets, make_logits


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 16),
    st.integers(2, 300),
    st.integers(0, 1100),
    st.sampled_from(KINDS),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_walk_matches_reference(batch, depth, vocab, budget, kind, agree, seed):
    tree = ddtree.build_tree(make_logits(kind, batch, depth, vocab, seed), budget)
    if agree:
        target = agreeing_targets(tree, vocab, seed)
    else:
        target = torch.randint(
            0, vocab, tree.tokens.shape, generator=torch.Generator().manual_seed(seed)
        )
    acc = ddtree.walk(tree, target)
    assert acc.path.shape == (batch, depth + 1) and acc.emitted.shape == (batch, depth + 1)
    for row in range(batch):
        path, bonus = walk_reference(
            tree.tokens[row].tolist(), tree.parents[row].tolist(), target[row].tolist()
        )
        n = len(path) - 1
        assert acc.path[row].tolist() == path + [-1] * (depth - n)
        assert int(acc.num_accepted[row]) == n
        assert int(acc.bonus[row]) == bonus
        emitted = [int(tree.tokens[row, s]) for s in path[1:]] + [bonus]
        assert acc.emitted[row].tolist() == emitted + [-1] * (depth - n)
        assert acc.accepted[row].nonzero().flatten().tolist() == sorted(path)


def test_full_chain_accepted():
    logits = make_logits("normal", 2, 6, 40, 0)
    tree = ddtree.build_tree(logits, 32, chain_seed=True)
    chain = logits.argmax(-1)  # [b, D]
    # The target agrees with the whole argmax chain and then says 7.
    target = torch.full_like(tree.tokens, 7)
    for row in range(2):
        slot = 0
        for d in range(6):
            target[row, slot] = chain[row, d]
            slot = int(
                ((tree.parents[row] == slot) & (tree.tokens[row] == chain[row, d])).nonzero()
            )
    acc = ddtree.walk(tree, target)
    assert acc.num_accepted.tolist() == [6, 6]
    assert acc.bonus.tolist() == [7, 7]
    assert acc.emitted[:, :6].tolist() == chain.tolist()


def test_nothing_accepted_gives_the_target_root_token():
    tree = ddtree.build_tree(torch.randn(1, 3, 5), 4)
    target = torch.full_like(tree.tokens, 99)  # no draft token is 99
    acc = ddtree.walk(tree, target)
    assert acc.num_accepted.tolist() == [0]
    assert acc.path.tolist() == [[0, -1, -1, -1]]
    assert acc.emitted.tolist() == [[99, -1, -1, -1]]


def test_bad_target_tokens():
    tree = ddtree.build_tree(torch.randn(2, 3, 5), 4)
    with pytest.raises(ValueError, match="target_tokens must have shape"):
        ddtree.walk(tree, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="target_tokens must have shape"):
        ddtree.walk(tree, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="target_tokens must be torch.long"):
        ddtree.walk(tree, torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="target_tokens must be a torch.Tensor"):
        ddtree.walk(tree, [[0] * 5] * 2)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="target_tokens is on"):
            ddtree.walk(tree, torch.zeros(2, 5, dtype=torch.long, device="cuda"))
    else:  # a meta tensor stands in for another device
        with pytest.raises(ValueError, match="target_tokens is on meta"):
            ddtree.walk(tree, torch.zeros(2, 5, dtype=torch.long, device="meta"))
