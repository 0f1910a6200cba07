"""The start-up cost model's choice of step budgets (pure part; the measurement runs inside the
engines: test_vllm_ddtree.py on the CPU, the H200 runs in benchmarks/)."""

from hypothesis import given
from hypothesis import strategies as st

from ddtree.vllm_plugin.cost_model import candidate_budgets, choose_step_budgets

BUCKETS = [1, 2, 4, 8, 16, 32]


def test_candidates_run_from_the_budget_down_to_the_chain():
    assert candidate_budgets(511, 15) == [511, 255, 127, 63, 31, 15]
    assert candidate_budgets(300, 15) == [300, 255, 127, 63, 31, 15]
    assert candidate_budgets(64, 15) == [64, 63, 31, 15]
    assert candidate_budgets(8, 15) == [8]
    assert candidate_budgets(15, 15) == [15]


def test_flat_cost_keeps_the_whole_tree():
    table = choose_step_budgets(lambda n: 1.0, BUCKETS, 255, 15, 1.1, max_tokens=1 << 20)
    assert table == dict.fromkeys(BUCKETS, 255)


def test_compute_bound_cost_shrinks_trees_as_the_batch_grows():
    # Weight-bound up to 512 tokens, then linear in the tokens (an H200-like 8B forward).
    def cost(n):
        return max(1.0, n / 512)

    table = choose_step_budgets(cost, BUCKETS, 511, 15, 1.1, max_tokens=1 << 20)
    assert table == {1: 511, 2: 255, 4: 127, 8: 63, 16: 31, 32: 15}


def test_scheduler_token_limit_is_respected():
    table = choose_step_budgets(lambda n: 1.0, BUCKETS, 255, 15, 2.0, max_tokens=2048)
    assert table == {1: 255, 2: 255, 4: 255, 8: 255, 16: 127, 32: 63}


@given(
    budget=st.integers(1, 1024),
    depth=st.integers(1, 31),
    ratio=st.floats(1.0, 4.0),
    slopes=st.lists(st.floats(0.0, 1.0), min_size=12, max_size=12),
)
def test_choice_is_the_largest_candidate_within_the_ratio(budget, depth, ratio, slopes):
    def cost(n):  # any non-decreasing cost of the token count
        return 1.0 + sum(s * max(0, n - (1 << k)) for k, s in enumerate(slopes))

    max_tokens = 4096
    table = choose_step_budgets(cost, BUCKETS, budget, depth, ratio, max_tokens)
    chain = min(budget, depth)
    for b, steps in table.items():
        assert chain <= steps <= budget
        limit = ratio * cost(b * (1 + chain))
        fits = [
            s
            for s in candidate_budgets(budget, depth)
            if s == chain or (b * (1 + s) <= max_tokens and cost(b * (1 + s)) <= limit)
        ]
        assert steps == max(fits)


def test_monotone_costs_bound_a_stall_by_larger_counts():
    """Costs non-decreasing in the tokens; a stalled measurement (timing noise only adds time)
    is bounded by a larger count's instead of raising every larger count."""
    from ddtree.vllm_plugin.cost_model import monotone

    measured = [7.2, 9.7, 11.0, 16.7, 43.1, 1091.3, 71.0]
    got = monotone([16, 32, 64, 128, 256, 512, 1024], measured)
    assert list(got.values()) == [7.2, 9.7, 11.0, 16.7, 43.1, 71.0, 71.0]
    assert monotone([1, 2, 3], [3.0, 2.0, 5.0]) == {1: 2.0, 2: 2.0, 3: 5.0}
