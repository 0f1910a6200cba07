"""Step budgets from the target's verify cost, measured once at start-up.

A tree of B nodes makes every request of the step forward ``1 + B`` tokens instead of the
chain's ``1 + D``. While the target's forward is bound by reading its weights that is nearly
free; once it is bound by compute it is not. At start-up the plugin times the target's forward
(vLLM's own ``_dummy_run``, graphs and attention included) and picks, per request bucket b, the
largest step budget whose forward costs at most ``max_verify_cost`` times the chain's:

    B_step(b) = max{B' in candidates : cost(b * (1 + B')) <= ratio * cost(b * (1 + D))}

so a large batch falls back to the chain by itself and one request keeps its whole tree. The
table is fixed before DDTree's graphs are captured; no step measures anything. Opt-in
(``ddtree_max_verify_cost``): on the H200 one engine (B=511, Qwen3-8B shapes) hit an illegal
memory access inside the measuring dummy runs (B=255 ran), very likely because those batches
gave every request seq_len = num_tokens (up to 8192, past max_model_len and the block table's
row); they now pass ``profile_seq_lens``. Not yet re-run on a GPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable

import torch

from ddtree.vllm_plugin import graphs

logger = logging.getLogger("vllm.ddtree")  # under vLLM's log configuration
CONTEXT_TOKENS = 1024  # context per request in the timed batches, beside its new tokens


def candidate_budgets(budget: int, depth: int) -> list[int]:
    """Step budgets tried, largest first: B, then 2^k - 1 below it, down to the chain."""
    chain = min(budget, depth)
    steps = [budget]
    k = budget.bit_length()
    while (1 << k) - 1 > chain:
        if (1 << k) - 1 < budget:
            steps.append((1 << k) - 1)
        k -= 1
    if steps[-1] != chain:
        steps.append(chain)
    return steps


def choose_step_budgets(
    cost: Callable[[int], float],
    buckets: list[int],
    budget: int,
    depth: int,
    max_cost_ratio: float,
    max_tokens: int,
) -> dict[int, int]:
    """``{bucket: B_step}``: per bucket the largest candidate whose forward of
    ``bucket * (1 + B_step)`` tokens costs at most ``max_cost_ratio`` x the chain's and fits
    in ``max_tokens``; never below the chain. ``cost(num_tokens)`` is in any time unit."""
    chain = min(budget, depth)
    table = {}
    for b in buckets:
        limit = max_cost_ratio * cost(b * (1 + chain))
        table[b] = next(
            (
                s
                for s in candidate_budgets(budget, depth)
                if s == chain or (b * (1 + s) <= max_tokens and cost(b * (1 + s)) <= limit)
            ),
            chain,
        )
    return table


def forward_seconds(runner, num_tokens: int, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed forwards of the target over ``num_tokens`` tokens (vLLM's
    dummy batch: attention, graphs and padding as a real step of that size; the drafter's
    dummy run left out), by :func:`fastest_seconds`."""
    drafter = getattr(runner, "drafter", None)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    # vLLM's dummy batch gives every request seq_len = num_tokens unless told otherwise: past
    # max_model_len (and the block table's row) for large n. Give each request a context of
    # its queries + CONTEXT_TOKENS, within max_model_len.
    num_reqs = min(num_tokens, runner.scheduler_config.max_num_seqs)
    queries = num_tokens // num_reqs + num_tokens % num_reqs  # the largest request's (vLLM's split)
    seq_len = max(queries, min(runner.max_model_len, queries + CONTEXT_TOKENS))
    run = functools.partial(
        runner._dummy_run,
        num_tokens,
        force_attention=True,
        skip_eplb=True,
        profile_seq_lens=seq_len,
    )
    if drafter is not None:
        drafter.dummy_run = lambda *args, **kwargs: None  # instance attribute hides the method
    try:
        return fastest_seconds(run, sync, repeats)
    finally:
        if drafter is not None:
            del drafter.dummy_run


def fastest_seconds(run: Callable[[], object], sync: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` after one warm call, ``sync``
    (the device's synchronize, or a no-op) around each. The minimum, not the mean: host
    jitter only ever adds time."""
    run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def monotone(counts: list[int], seconds: list[float]) -> dict[int, float]:
    """``{tokens: seconds}`` made non-decreasing in the tokens (``counts`` increasing): each
    count costs the least measured at it or at any larger count. Timing noise only adds time,
    so a stalled measurement is bounded by a larger count's (a running maximum would carry one
    stall to every larger count: a CI host under load once timed 512 tokens at 1091 ms against
    71 ms for 1024, and the model cut a budget it should have kept)."""
    return dict(zip(counts, suffix_min(seconds), strict=True))


def suffix_min(values: list[float]) -> list[float]:
    """Each value lowered to the least at or after it: a cost non-decreasing in its index."""
    return list(itertools.accumulate(reversed(values), min))[::-1]


def fit_step_budgets(runner, budget: int, depth: int, max_cost_ratio: float) -> dict[int, int]:
    """Measure the target's forward on ``runner`` at every token count the choice can ask
    for, make the costs non-decreasing in the tokens (:func:`monotone`: more tokens never cost
    less, and a stalled measurement is bounded by a larger count's), and return ``{bucket:
    B_step}`` for every power-of-two bucket up to ``max_num_seqs`` (logged as a table)."""
    scheduler = runner.scheduler_config
    max_tokens = scheduler.max_num_scheduled_tokens or scheduler.max_num_batched_tokens
    buckets = graphs.buckets(scheduler.max_num_seqs)
    chain = min(budget, depth)
    counts = sorted(
        {
            min(b * (1 + s), max_tokens)
            for b in buckets
            for s in candidate_budgets(budget, depth)
            if s == chain or b * (1 + s) <= max_tokens
        }
    )
    start = time.perf_counter()
    measured = [forward_seconds(runner, n) for n in counts]
    cost = monotone(counts, measured)
    table = choose_step_budgets(
        lambda n: cost[min(n, max_tokens)], buckets, budget, depth, max_cost_ratio, max_tokens
    )
    logger.info(
        "ddtree step budgets (max verify cost %.2fx the chain's; measured in %.1f s): %s; "
        "forward ms by tokens (measured / used): %s",
        max_cost_ratio,
        time.perf_counter() - start,
        ", ".join(f"{b} req -> B {s}" for b, s in table.items()),
        ", ".join(
            f"{n}: {1e3 * t:.2f}/{1e3 * cost[n]:.2f}" for n, t in zip(counts, measured, strict=True)
        ),
    )
    return table
