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
    from ddtree.budget import AcceptanceCurve, CurveReader, mean_accepted

    curve = AcceptanceCurve(4, "cpu")
    reader = CurveReader(curve)

    def take() -> dict:  # on the CPU a copy lands at once
        reader.start()
        assert reader.landed() and not reader.landed()  # once per copy
        return reader.take()

    path = torch.tensor([[0, 1, 3, -1], [0, 2, 4, 5], [0, -1, -1, -1]])
    curve.update(path, torch.tensor([4, 2, 0]))  # request 1 verified 2 nodes, request 2 none
    first = take()
    assert first == {"rows": [2, 2, 1, 1], "accepted": [1, 2, 2, 2]}
    assert take() == {"rows": [0] * 4, "accepted": [0] * 4}  # zeroed by the read
    curve.update(path[:1], torch.tensor([4]))
    second = take()
    assert mean_accepted([first, second]) == [2 / 3, 3 / 3, 4 / 2, 4 / 2]  # rows 3, 3, 2, 2
    assert mean_accepted([{"rows": [0, 1], "accepted": [0, 1]}]) == [None, 1.0]


def test_predicted_within_sums_the_path_probabilities_of_each_smaller_tree():
    """The drafter's expected accepted length of the budget-K tree: the sum over its first K
    nodes of exp(score), -inf padding adding nothing; 0 past the tree's own size."""
    from ddtree.budget import predicted_within

    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0)) * 3
    tree = ddtree.build_tree(logits, 20, chain_seed=True)
    got = predicted_within(tree.scores, 24)  # [3, 24]
    probs = tree.scores[:, 1:].exp()
    for k in range(1, 21):
        assert torch.allclose(got[:, k - 1], probs[:, :k].sum(1))
    assert (got[:, 20:] == 0).all()
    # A one-hot drafter expects its whole chain: D tokens.
    sure = torch.full((1, 4, 50), -1e4)
    sure[..., 7] = 0.0
    chain = ddtree.build_tree(sure, 4, chain_seed=True)
    assert torch.allclose(predicted_within(chain.scores, 4)[:, 3], torch.tensor(4.0))


def test_expected_accepted_measures_then_extrapolates_with_the_drafter():
    from ddtree.budget import expected_accepted

    # K = 1..5; K = 3, 4 verified by too few request steps: extrapolated from K* = 2 with the
    # drafter's predicted gain, scaled by measured / predicted at K* (1.2 / 1.6 = 0.75); K = 5
    # neither verified nor proposed often enough: unknown.
    rows = [100, 100, 3, 0, 0]
    accepted = [80, 120, 5, 0, 0]
    proposals = [100, 100, 100, 100, 2]
    predicted = [90.0, 160.0, 200.0, 260.0, 6.0]  # means 0.9, 1.6, 2.0, 2.6
    got = expected_accepted(rows, accepted, proposals, predicted, min_rows=10)
    assert got[:4] == pytest.approx([0.8, 1.2, 1.2 + 0.75 * 0.4, 1.2 + 0.75 * 1.0])
    assert got[4] is None
    # Never decreasing in K.
    noisy = expected_accepted([50, 50, 50], [40, 35, 45], [0] * 3, [0.0] * 3, min_rows=10)
    assert noisy == pytest.approx([0.8, 0.8, 0.9])
    # Nothing measured: the prediction; nothing at all: unknown.
    assert expected_accepted([0, 0], [0, 0], [10, 10], [5.0, 8.0], 1) == pytest.approx([0.5, 0.8])
    assert expected_accepted([0, 0], [0, 0], [0, 0], [0.0, 0.0], 1) == [None, None]


def test_tuner_moves_the_schedule_with_traffic_and_writes_the_lookup_in_place():
    """A BudgetTuner on the CPU: once walks accept deep, the lone request takes the whole tree
    (flat step times) while 8 requests keep the chain (step time grows with the tokens); the
    scheduler's lookup list is rewritten in place."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.tuner import BudgetTuner

    options = DDTreeOptions(budget=31, auto_budget=True, budget_schedule=((1, 8, 7),))
    lookup = build_dynamic_sd_schedule_lookup([[1, 8, 7]], 8, 31)
    options.live_lookup = lookup
    held = lookup
    step_ms = [[10.0, 10.0, 10.0], [10.0, 10.5, 11.0], [10.0, 11.0, 20.0], [10.0, 20.0, 60.0]]
    tuner = BudgetTuner(options, torch.device("cpu"), every=2)
    tuner.set_costs([1, 2, 4, 8], [7, 15, 31], step_ms, 8)
    # Every request step verified 31 nodes and accepted slots 1, 9, 20, 28 (deep paths); the
    # drafter expected almost nothing (alone it would pick the chain everywhere): the measured
    # means win wherever enough request steps verified the budget.
    path = torch.tensor([[0, 1, 9, 20, 28, -1, -1, -1]] * 16)
    scores = torch.cat([torch.zeros(16, 1), torch.full((16, 31), -6.0)], 1)
    real = torch.arange(16) < 12  # 4 padding rows: not counted as proposals
    for _ in range(3):  # 2 steps start a copy, the third folds it in
        tuner.proposed(scores, real)
        tuner.walked(path, torch.full((16,), 31))
        tuner.step()
    assert tuner.totals.view(4, -1)[2].tolist() == [24] * 31  # proposals: 2 steps x 12
    assert tuner.curve.rows[0] == 16  # the third step's walks: not folded yet
    # accepted(7) = 1, accepted(15) = 2, accepted(31) = 4 tokens:
    # 1 request: 2/10, 3/10, 5/10 -> 31; 2: 31 (5/11 > 3/10.5); 4: 15 (3/11 > 5/20 > 2/10);
    # 8: 7 (2/10 > 3/20).
    assert options.budget_schedule == ((1, 2, 31), (3, 4, 15), (5, 8, 7))
    assert lookup is held and lookup[1:] == [31, 31, 15, 15, 7, 7, 7, 7]


def test_tuner_keeps_a_larger_budget_that_nothing_measured_yet():
    """Traffic only at batch sizes that verify 15-node trees says nothing of 31: the lone
    request keeps its 31 (only its own steps can tell) while the other sizes follow the data
    (here: 15 accepts no more than 7 at a 5% higher cost, so 7; at a 2% higher cost the
    bucket would keep 15: changes need >= 3% more tokens per second)."""
    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.tuner import BudgetTuner

    schedule = ((1, 1, 31), (2, 4, 15), (5, 8, 7))
    options = DDTreeOptions(budget=31, auto_budget=True, budget_schedule=schedule)
    step_ms = [[10.0, 10.5, 10.5]] * 2 + [[10.0, 10.2, 10.5]] * 2
    tuner = BudgetTuner(options, torch.device("cpu"), every=1)
    tuner.set_costs([1, 2, 4, 8], [7, 15, 31], step_ms, 8)
    path = torch.tensor([[0, 1, -1, -1]] * 32)
    scores = torch.cat([torch.zeros(32, 1), torch.full((32, 15), -0.1)], 1)  # 15-node trees
    for _ in range(2):
        tuner.proposed(scores, torch.ones(32, dtype=torch.bool))
        tuner.walked(path, torch.full((32,), 15))
        tuner.step()
    assert options.budget_schedule == ((1, 1, 31), (2, 2, 7), (3, 4, 15), (5, 8, 7))


def test_tuner_learns_served_step_costs_and_tries_a_neighbour_once():
    """Start-up's table can miss what a wider tree costs in service (flat here: 2 ms for 15 and
    31 drafts). Served periods of steps where every request verified K drafts become K's cost
    (stalls and steps with a prefill not counted); an unserved neighbour whose scaled
    estimate is within EXPLORE_MARGIN is tried once, then served costs decide."""
    from types import SimpleNamespace

    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.tuner import BudgetTuner, apply, scheduled_drafts

    options = DDTreeOptions(budget=31, auto_budget=True, budget_schedule=((1, 16, 31),))
    tuner = BudgetTuner(options, torch.device("cpu"), every=1)
    tuner.set_costs([1, 2, 4, 8, 16], [15, 31], [[2.0, 2.0]] * 5, 16)
    expected = [None] * 31
    expected[14], expected[30] = 2.5, 3.0
    clock = [100.0]

    def serve(drafts: int, ms: float, steps: int, requests: int = 16, prefill: bool = False):
        for _ in range(steps):
            out = SimpleNamespace(
                scheduled_spec_decode_tokens={r: [0] * drafts for r in range(requests)},
                num_scheduled_tokens={r: drafts + 1 for r in range(requests)},
            )
            if prefill:  # one request without drafts: says nothing about K
                out.scheduled_spec_decode_tokens.pop(0)
            tuner.observe(*scheduled_drafts(out), now=clock[0])
            clock[0] += ms / 1e3

    assert tuner.choose(expected) == [[1, 16, 31]]  # flat table: the wider tree
    serve(31, 5.0, 10)
    serve(31, 20.0, 3, prefill=True)  # prefill steps: counted apart
    serve(31, 5.0, 1)
    clock[0] += 2.0  # an idle gap: a stall
    serve(31, 5.0, 1)
    tuner._fold()
    assert tuner.live[4][1] == [pytest.approx(5.0), 10]  # the 10 steps: no prefill, no stall
    assert tuner.mixed_live[4][1] == [pytest.approx(20.0), 3]  # logged, not a cost of K
    assert tuner.served_label(tuner.mixed_live, 1, with_steps=True) == "16x31=20.00/3"
    assert tuner.served_label(tuner.live, 8) == "16x31=5.00"
    assert tuner.cost_ms[4] == [pytest.approx(5.0), pytest.approx(5.0)]  # 15: 2 x (5 / 2)
    # served 31 (4 / 5 tokens per ms) vs 15's estimate (3.5 / 5): within 15%, so 15 is tried
    schedule = tuner.choose(expected)
    assert schedule == [[1, 8, 31], [9, 16, 15]]
    apply(options, schedule)
    # no served 15 yet (the window was skipped here): back to 31, and 15 is not tried again
    assert tuner.choose(expected) == [[1, 16, 31]]
    serve(15, 4.0, 10)
    serve(15, 4.0, 1, requests=1)  # another bucket: ends the last 16-request step
    tuner._fold()
    assert tuner.live[4][0] == [pytest.approx(4.0), 10]
    # served: 15 at 3.5 / 4 = 0.875 tokens per ms beats 31 at 0.8
    assert tuner.choose(expected) == [[1, 8, 31], [9, 16, 15]]
