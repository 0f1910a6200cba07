"""Budgets by throughput: the accepted length of every smaller budget read off one walk at the
largest, against walking each smaller tree; the schedule chooser on small tables."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree
from ddtree.budget import accepted_within, throughput_schedule


def _target_tokens(tree: ddtree.DraftTree, follow: float, vocab: int, gen) -> torch.Tensor:
    """At each slot: with probability ``follow`` the token of one of its children (so paths
    run deep and also leave the first branch), else a random token."""
    batch, slots = tree.tokens.shape
    target = torch.randint(0, vocab, (batch, slots), generator=gen)
    for b in range(batch):
        for s in range(slots):
            children = (tree.parents[b] == s).nonzero().flatten()
            if len(children) and torch.rand((), generator=gen) < follow:
                pick = children[torch.randint(0, len(children), (), generator=gen)]
                target[b, s] = tree.tokens[b, pick]
    return target


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 60),
    chain_seed=st.booleans(),
    follow=st.floats(0.4, 1.0),
)
def test_accepted_within_equals_walking_every_smaller_tree(seed, budget, chain_seed, follow):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, 10, generator=gen) * 2
    big = ddtree.build_tree(logits, budget, chain_seed=chain_seed)
    target = _target_tokens(big, follow, 10, gen)
    path = ddtree.walk(big, target).path
    budgets = torch.arange(1, budget + 1)
    got = accepted_within(path, budgets)  # [b, budget]
    assert got.shape == (3, budget)
    for k in range(1, budget + 1):
        small = ddtree.build_tree(logits, k, chain_seed=chain_seed)
        assert torch.equal(small.tokens, big.tokens[:, : 1 + k])  # the same nodes, same slots
        want = ddtree.walk(small, target[:, : 1 + k]).num_accepted
        assert torch.equal(got[:, k - 1], want), k
    assert torch.equal(got[:, -1], ddtree.walk(big, target).num_accepted)


def test_accepted_within_counts_the_path_inside_each_budget():
    path = torch.tensor([[0, 1, 4, 9, -1], [0, -1, -1, -1, -1], [0, 2, 3, 70, 71]])
    got = accepted_within(path, torch.tensor([1, 3, 4, 9, 70, 100]))
    assert got.tolist() == [[1, 1, 2, 3, 3, 3], [0, 0, 0, 0, 0, 0], [0, 2, 2, 2, 3, 4]]


def test_throughput_schedule_picks_the_fastest_budget_per_bucket():
    budgets = [15, 63, 255]
    accepted = [1.5, 2.5, 3.0]  # tokens per step: 2.5, 3.5, 4.0
    step_ms = [
        [4.0, 4.2, 4.6],  # 1 request: 0.625, 0.833, 0.870 -> 255
        [4.2, 4.8, 7.5],  # 2: 0.595, 0.729, 0.533 -> 63
        [4.5, 5.6, 9.0],  # 4: 0.556, 0.625, 0.444 -> 63
        [5.0, 8.0, 20.0],  # 8: 0.5, 0.4375, 0.2 -> 15
        [6.0, 12.0, 40.0],  # 16 -> 15
    ]
    got = throughput_schedule(accepted, step_ms, [1, 2, 4, 8, 16], budgets, max_batch=64)
    assert got == [[1, 1, 255], [2, 4, 63], [5, 64, 15]]
    # Ties go to the smaller budget; a max_batch inside the buckets ends the schedule there.
    assert throughput_schedule([1.0, 3.0], [[2.0, 4.0], [3.0, 6.0]], [1, 2], [15, 63], 1) == [
        [1, 1, 15]
    ]


def test_throughput_schedule_refuses_mismatched_tables():
    with pytest.raises(ValueError, match="differ"):
        throughput_schedule([1.0], [[1.0, 2.0]], [1], [15, 63], 8)
    with pytest.raises(ValueError, match="sizes increasing"):
        throughput_schedule([1.0, 2.0], [[1.0, 2.0], [1.0, 2.0]], [2, 1], [15, 63], 8)
    with pytest.raises(ValueError, match="max_batch"):
        throughput_schedule([1.0], [[1.0]], [4], [15], 2)


def test_acceptance_curve_sums_valid_budgets_and_resets():
    from ddtree.budget import AcceptanceCurve, mean_accepted

    curve = AcceptanceCurve(4, "cpu")
    path = torch.tensor([[0, 1, 3, -1], [0, 2, 4, 5], [0, -1, -1, -1]])
    curve.update(path, torch.tensor([4, 2, 0]))  # request 1 verified 2 nodes, request 2 none
    first = curve.take()
    assert first == {"rows": [2, 2, 1, 1], "accepted": [1, 2, 2, 2]}
    assert curve.take() == {"rows": [0] * 4, "accepted": [0] * 4}  # zeroed by take
    curve.update(path[:1], torch.tensor([4]))
    second = curve.take()
    assert mean_accepted([first, second]) == [2 / 3, 3 / 3, 4 / 2, 4 / 2]  # rows 3, 3, 2, 2
    assert mean_accepted([{"rows": [0, 1], "accepted": [0, 1]}]) == [None, 1.0]
