"""DDTree inside vLLM 0.26 (CPU build, V1 runner): lossless greedy, sampling runs, config errors.

Engines run in this process (``engines.engine``: seconds to start); the cases share them
where they can.
"""

import logging
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")

from engines import (  # noqa: E402
    MODELS,
    PROMPTS,
    assert_same_distribution,
    ddtree_spec,
    engine,
    greedy,
    token_counts,
)

# T=1 distribution checks: generated token 2 of this prompt (sampled at a tree node whenever
# token 1 was accepted from the tree), nucleus 0.95 so the support stays small.
SAMPLED_PROMPT, SAMPLED_INDEX, SAMPLES = PROMPTS[0], 2, 240
pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter

VOCAB = 8192


def _sampled(llm):
    params = vllm.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=1, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def _counts(llm):
    return token_counts(
        llm, SAMPLED_PROMPT, SAMPLED_INDEX, SAMPLES, VOCAB, temperature=1.0, top_p=0.95
    )


@pytest.fixture(scope="module")
def no_spec():
    """No-spec TP=1: (greedy outputs, T=1 token counts). Up to 16 requests at once: the 4 greedy
    requests run together as in the 4-request DDTree engines, the samples 16 at a time."""
    with engine(max_num_seqs=16) as llm:
        return greedy(llm), _counts(llm)


@pytest.fixture(scope="module")
def ddtree_64():
    """DDTree B=64 at TP=1: (greedy outputs, seeded T=1 samples)."""
    with engine(spec=ddtree_spec(64)) as llm:
        return greedy(llm), _sampled(llm)


def test_vllm_dflash_chain_equals_no_spec(no_spec):
    """The control: the bundled pair under vLLM's own DFlash chain (loads target, drafter and
    tokenizer; greedy output equals no-spec, as it must for DDTree below)."""
    assert vllm.__version__ == "0.26.0"
    assert [len(t) for t, _ in no_spec[0][:2]] == [64, 40]
    spec = {"method": "dflash", "model": str(MODELS / "drafter"), "num_speculative_tokens": 15}
    with engine(spec=spec) as llm:
        assert greedy(llm) == no_spec[0]


@pytest.mark.parametrize("budget", [1, 64])
def test_greedy_ddtree_equals_no_spec(no_spec, budget, request):
    """The smallest tree (one node) and B=64 (a budget past the drafter's depth D=15)."""
    if budget == 64:  # the fixture's engine also ran seeded T=1 samples
        got, sampled = request.getfixturevalue("ddtree_64")
        assert got == no_spec[0]
        assert all(len(tokens) == 30 for tokens in sampled)  # T=1 runs, requested lengths
        return
    with engine(spec=ddtree_spec(budget)) as llm:
        assert greedy(llm) == no_spec[0]


def test_engines_in_one_process_keep_their_own_state(no_spec, acceptance_logged, caplog):
    """Two DDTree engines with different budgets, then a no-spec engine, one after another in
    this process: each must give no-spec's greedy tokens (step state kept in module globals
    would hand the second engine the first one's KV caches).

    With DDTREE_ACCEPTANCE=1 the B=15 engine logs, per step, what each K <= 15 would have
    accepted: at K = 15 that is what it did accept (vLLM's own counters), and a smaller tree
    never accepts more. The B=255 engine caps a step's tree tokens at 100
    (ddtree_max_verify_tokens: 4 requests -> 24 nodes each, 2 -> 49, 1 -> 99, trees of
    changing width between steps) and fits the start-up cost model (a ratio that never
    binds)."""
    caplog.set_level(logging.INFO, logger="vllm.ddtree")
    for budget in (15, 255):
        caplog.clear()
        spec = ddtree_spec(budget)
        if budget == 255:
            spec.update(ddtree_max_verify_tokens=100, ddtree_max_verify_cost=100.0)
        with engine(spec=spec, disable_log_stats=False) as llm:
            if budget == 255:
                log = caplog.text
                assert "ddtree step budgets (max verify cost 100.00x" in log, log[-3000:]
                assert "1 req -> B 255, 2 req -> B 255, 4 req -> B 255;" in log
            assert greedy(llm) == no_spec[0], budget
            counts = _spec_counts(llm)
        if budget == 15:
            rows, accepted = _acceptance(caplog.text, 15)
            assert rows == [counts["num_drafts"]] * 15, (rows, counts)
            assert accepted[-1] == counts["num_accepted_tokens"], (accepted, counts)
            assert accepted == sorted(accepted) and accepted[0] < accepted[-1]
    with engine() as llm:
        assert greedy(llm) == no_spec[0]


@pytest.fixture
def acceptance_logged(monkeypatch, caplog):
    """DDTREE_ACCEPTANCE=1 for the engines made in the test: a line per step."""
    import dataclasses

    from ddtree.vllm_plugin import config

    monkeypatch.setenv("DDTREE_ACCEPTANCE", "1")
    monkeypatch.setattr(
        config, "SETTINGS", dataclasses.replace(config.SETTINGS, acceptance_every=1)
    )
    caplog.set_level(logging.WARNING, logger="vllm.ddtree")


def _acceptance(log: str, budget: int) -> tuple[list[int], list[int]]:
    """Summed ``ddtree-acceptance`` lines of a log: (rows, accepted) per K = 1..budget."""
    from ddtree.bench.report import parse_acceptance_log, sum_acceptance

    reports = parse_acceptance_log(log)
    assert reports and all(r["budget"] == budget and r["steps"] == 1 for r in reports)
    sums = sum_acceptance(reports)
    return sums["rows"], sums["accepted"]


def test_budget_per_batch_size_equals_no_spec(no_spec, acceptance_logged, caplog):
    """``ddtree_budget_per_batch_size``: 4 requests verify 6-node trees, 2 verify 20, a lone
    one 64 (the requests finish at different lengths, so the batch shrinks); greedy output
    stays no-spec's and the mean verified nodes per draft step falls between 6 and 64. The
    acceptance log counts a request-step at K only up to the nodes it verified."""
    schedule = [[1, 1, 64], [2, 2, 20], [3, 8, 6]]
    spec = ddtree_spec(64, ddtree_budget_per_batch_size=schedule)
    with engine(spec=spec, disable_log_stats=False) as llm:
        assert llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens_per_batch_size
        assert greedy(llm) == no_spec[0]
        counts = _spec_counts(llm)
    per_step = counts["num_draft_tokens"] / counts["num_drafts"]
    assert 6 < per_step < 64, counts
    rows, _ = _acceptance(caplog.text, 64)
    assert rows[:6] == [counts["num_drafts"]] * 6, (rows, counts)
    assert rows == sorted(rows, reverse=True) and 0 < rows[63] < rows[6] < rows[5], rows
    verified = sum(rows)  # request-steps at K, summed over K: the nodes verified
    assert verified == counts["num_draft_tokens"], (verified, counts)


def test_auto_budget_schedule_equals_no_spec(no_spec, monkeypatch, caplog):
    """``ddtree_budget_per_batch_size: "auto"``: the target's forward is timed at start-up for
    every (request bucket, candidate budget), the first schedule goes into vLLM's scheduler,
    and every 4 steps (DDTREE_TUNE_EVERY) the acceptance measured on the walks moves it. The
    scheduler reads the tuner's list itself, and greedy output stays no-spec's while the
    budgets change under it."""
    import dataclasses

    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from ddtree.vllm_plugin import config

    monkeypatch.setattr(config, "SETTINGS", dataclasses.replace(config.SETTINGS, tune_every=4))
    caplog.set_level(logging.INFO, logger="vllm.ddtree")
    spec = ddtree_spec(64, ddtree_budget_per_batch_size="auto")
    with engine(spec=spec) as llm:
        assert greedy(llm) == no_spec[0]
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        options = config.options_of(scheduler.vllm_config.speculative_config)
        assert options.auto_budget and scheduler.dynamic_sd_lookup is options.live_lookup
        ranges = [list(r) for r in options.budget_schedule]
        assert scheduler.dynamic_sd_lookup == build_dynamic_sd_schedule_lookup(ranges, 4, 64)
        params = vllm.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        assert len(llm.generate(PROMPTS * 3, params)) == 12  # more steps for the tuner
        updates, verified, proposed, shared = llm.collective_rpc(_tuner_counts)[0]
        assert shared == id(options)  # the worker's tuner writes the scheduler's options
    assert updates >= 1 and verified > 0 and proposed > 0, (updates, verified, proposed)
    log = caplog.text
    assert "ddtree budgets by throughput: candidates [15, 31, 63, 64]; step ms" in log, log[-3000:]


def _tuner_counts(worker) -> tuple[int, float, float, int]:
    """(schedule updates, request steps verified at K = 1, proposals reaching K = 1 (decayed
    totals), id of its options) of the worker's DDTree tuner."""
    from ddtree.vllm_plugin.patches import engine_of

    tuner = engine_of(worker.model_runner).tuner
    rows, _, proposals, _ = tuner.totals.view(4, -1)
    return tuner.updates, float(rows[0]), float(proposals[0]), id(tuner.options)


def _spec_counts(llm) -> dict[str, float]:
    return {
        m.name.removeprefix("vllm:spec_decode_"): m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
    }


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 needs two CPU cores")
def test_tensor_parallel_ddtree(no_spec, monkeypatch):
    """DDTree at tensor_parallel_size=2 (two worker processes, the target's heads and MLP split
    between them, vocabulary-parallel head gathered): greedy tokens equal no-spec's at TP=1;
    seeded samples are reproducible; T=1 samples follow no-spec's distribution (chi-square).
    Every rank builds and walks its own tree from the gathered logits and its own seeded
    draws; a rank that built another tree would verify other tokens and part. (Exact equality
    with TP=1's samples is not promised: an all-reduce changes the logits' bits.)"""
    cores = sorted(os.sched_getaffinity(0))[:2]
    # vLLM's CPU workers bind one NUMA node each unless told which cores to take.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    with engine(
        spec=ddtree_spec(64),
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        disable_log_stats=False,
        max_num_seqs=16,  # the 240 seeded samples in 15 batches (each rank's steps cost IPC)
    ) as llm:
        assert greedy(llm) == no_spec[0]
        counts = _spec_counts(llm)  # of the greedy requests
        assert counts["num_drafts"] > 0 and counts["num_accepted_tokens"] > counts["num_drafts"]
        first = _sampled(llm)
        assert _sampled(llm) == first
        assert all(len(tokens) == 30 for tokens in first)
        assert_same_distribution(_counts(llm), no_spec[1])


def test_plugin_leaves_torch_cuda_alone_off_the_cpu():
    """Importing vLLM's CPU worker swaps torch.cuda.Event / Stream for placeholders in the whole
    process (it broke every CUDA engine once): off the CPU platform the plugin must not."""
    code = (
        "import sys, torch\n"
        "from vllm.platforms import current_platform\n"
        "current_platform.is_cpu = lambda: False\n"
        "event = torch.cuda.Event\n"
        "from ddtree.vllm_plugin import patches\n"
        "patches._patch_workers_warm_up()\n"
        "assert 'vllm.v1.worker.cpu_worker' not in sys.modules\n"
        "assert torch.cuda.Event is event\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
