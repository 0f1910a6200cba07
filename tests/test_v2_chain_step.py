"""A V2 step whose every tree is its forced chain (K <= D drafts) is the chain's verify: the
tree sampler leaves it to vLLM's rejection sampler, skips the tail (walk, commit) and the
tree rows, and still feeds the budget tuner what a walk would have."""

from types import SimpleNamespace

import pytest
import torch

import ddtree
from ddtree.budget import accepted_within

pytest.importorskip("triton")

DEPTH, VOCAB = 6, 3


def chain_cases(seed: int = 1):
    """Chain-sized trees (K <= D) walked: yields (walked path, verified [R], num_sampled
    [R], cu_num_logits [R + 1]) with a prefill row and a non-final chunk appended."""
    gen = torch.Generator().manual_seed(seed)
    for budget in range(1, DEPTH + 1):
        logits = torch.randn(32, DEPTH, VOCAB, generator=gen) * 2
        tree = ddtree.build_tree(logits, budget, chain_seed=True)
        chain = logits.argmax(-1)[:, :budget]
        agree = torch.arange(budget) < torch.randint(0, budget + 1, (32, 1), generator=gen)
        targets = torch.zeros(32, budget + 1, dtype=torch.long)
        targets[:, :budget] = torch.where(agree, chain, (chain + 1) % VOCAB)
        walked = ddtree.walk(tree, targets)
        # + a prefill (one logit, one token sampled), a non-final chunk (one logit, none)
        path = torch.cat([walked.path, torch.tensor([[0] + [-1] * DEPTH, [-1] * (DEPTH + 1)])])
        verified = torch.tensor([budget] * 32 + [0, 0])
        num_sampled = torch.cat([walked.num_accepted + 1, torch.tensor([1, 0])]).int()
        counts = torch.tensor([budget + 1] * 32 + [1, 1])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int()
        yield path, verified, num_sampled, cu


def check_chain_acceptance(interpret: bool) -> None:
    """``kernels.chain_acceptance`` (from vLLM's accepted counts) adds what the walk of the
    chain-sized tree adds to an ``AcceptanceCurve``."""
    from ddtree.budget import AcceptanceCurve
    from ddtree.vllm_plugin.v2.kernels import chain_acceptance

    for path, verified, num_sampled, cu in chain_cases():
        walked, chain = AcceptanceCurve(31, "cpu"), AcceptanceCurve(31, "cpu")
        walked.update(path, verified)
        chain_acceptance(num_sampled, cu, chain.rows, chain.accepted, interpret=interpret)
        assert chain.rows.tolist() == walked.rows.tolist()
        assert chain.accepted.tolist() == walked.accepted.tolist()
        assert walked.accepted.sum() > 0


def test_chain_acceptance_is_the_walks():
    check_chain_acceptance(interpret=False)


def _sampler(monkeypatch, gdn=None):
    from ddtree.vllm_plugin.config import DDTreeOptions, Settings
    from ddtree.vllm_plugin.tuner import BudgetTuner
    from ddtree.vllm_plugin.v2.engine import TreeEngine, TreeTables
    from ddtree.vllm_plugin.v2.sampler import TreeSampler

    tables = TreeTables(4, 31, DEPTH, torch.device("cpu"))
    engine = TreeEngine(DDTreeOptions(31), DEPTH, Settings(cuda_graphs=False), tables)
    engine.tuner = BudgetTuner(engine.options, torch.device("cpu"), every=1)
    engine.gdn = gdn
    calls = []

    def chain_sampler(logits, input_batch, draft_logits):
        calls.append(draft_logits)
        return SimpleNamespace(num_sampled=torch.tensor([3, 1, 5], dtype=torch.int32))

    tree_sampler = SimpleNamespace(sample=lambda *a, **k: calls.append("tree") or 1 / 0)
    sampler = TreeSampler(engine, tree_sampler, 31, chain_sampler)
    monkeypatch.setattr(sampler, "tail", lambda *a: 1 / 0)
    return engine, sampler, calls


def test_chain_steps_go_to_vllms_rejection_sampler(monkeypatch):
    from ddtree.vllm_plugin.v2 import prepare

    engine, sampler, calls = _sampler(monkeypatch)
    assert engine.chain_verify
    # requests with 5 and 4 drafts (K <= D) and a prefill: the chain's verify
    cu = torch.tensor([0, 6, 7, 12], dtype=torch.int32)
    batch = SimpleNamespace(cu_num_logits=cu, num_reqs=3, num_draft_tokens_per_req=None)
    engine.chain_trees = True
    engine.walked = True
    sampler(torch.zeros(12, VOCAB), batch)
    assert calls == [None]  # one-hot drafts: no draft distribution
    assert not engine.walked  # the drafter reorders nothing
    # the tuner's sums (copied by its step()): what the walks' paths add
    path = torch.tensor([[0, 1, 2, -1, -1, -1, -1], [0] + [-1] * 6, [0, 1, 2, 3, 4, -1, -1]])
    verified = torch.tensor([5, 0, 4])
    budgets = torch.arange(1, 32)
    valid = budgets[None, :] <= verified[:, None]
    rows, accepted = engine.tuner.reader.host.view(4, -1)[:2]
    assert rows.tolist() == valid.sum(0).tolist()
    assert accepted.tolist() == (accepted_within(path, budgets) * valid).sum(0).tolist()

    # prepare_step marks no tree rows for such a step
    marked = []
    monkeypatch.setattr(
        prepare.kernels, "mark_trees_and_depth_positions", lambda *a: marked.append(a)
    )
    batch.num_draft_tokens_per_req = torch.tensor([5, 0, 4]).numpy()
    prepare.prepare_step(engine, batch)
    assert engine.tree_step and not marked
    engine.chain_trees = False  # a wider tree: marked, and the walk's tail runs
    batch.input_ids = batch.positions = batch.logits_indices = torch.zeros(12, dtype=torch.long)
    batch.idx_mapping = batch.query_start_loc = torch.zeros(4, dtype=torch.int32)
    batch.num_reqs_after_padding = 3
    prepare.prepare_step(engine, batch)
    assert len(marked) == 1
    sampler.sampler.returns_logprobs = lambda *a: False
    batch.expanded_idx_mapping = batch.idx_mapping_np = batch.expanded_local_pos = None
    with pytest.raises(ZeroDivisionError):
        sampler(torch.zeros(12, VOCAB), batch)
    assert calls == [None, "tree"]


def test_hybrid_targets_keep_the_walk(monkeypatch):
    """A Gated DeltaNet commit replays the walked path: hybrids never delegate."""
    engine, sampler, calls = _sampler(monkeypatch, gdn=object())
    engine.chain_trees = True
    assert not engine.chain_step()
    sampler.sampler.returns_logprobs = lambda *a: False
    z = torch.zeros(4, dtype=torch.long)
    batch = SimpleNamespace(
        logits_indices=z, expanded_idx_mapping=None, idx_mapping_np=None, positions=z,
        input_ids=z, expanded_local_pos=None, num_reqs=3,
    )  # fmt: skip
    with pytest.raises(ZeroDivisionError):
        sampler(torch.zeros(4, VOCAB), batch)
    assert calls == ["tree"]


def test_auto_trees_stay_within_full_verify_graphs():
    """An "auto" engine's widest tree per bucket: the largest candidate whose verify fits
    vLLM's full-graph limit (never below the chain); the tuner times nothing wider."""
    from ddtree.vllm_plugin.tuner import widest_budget

    # vLLM's default limit, 512 tokens: 1-2 requests 255, 4: 127, 8: 63, 16: 31, 32+: 15
    got = [widest_budget(255, 15, size, 512) for size in (1, 2, 4, 8, 16, 32, 64, 512)]
    assert got == [255, 255, 127, 63, 31, 15, 15, 15]
    assert widest_budget(255, 15, 32, None) == 255  # no full decode graphs: no limit
    assert widest_budget(63, 15, 16, 2048) == 63
    assert widest_budget(7, 15, 512, 512) == 7  # a budget below the depth is the chain


def test_narrower_trees_are_padded_with_rejected_children_of_the_root():
    """A tree built for a larger bucket (fewer slots) is stored with padding slots that no
    target token matches: a walk over the padded tree accepts what the tree's own walk
    does, the padding nodes are children of the root (the grammar needs a parent)."""
    from ddtree.vllm_plugin.v2.engine import TreeTables

    gen = torch.Generator().manual_seed(2)
    tables = TreeTables(4, 31, DEPTH, torch.device("cpu"))
    logits = torch.randn(3, DEPTH, 40, generator=gen) * 2
    tree = ddtree.build_tree(logits, 7)
    wide = tables.widen(tree)
    assert wide.tokens.shape == (3, 32) and wide.ancestors.shape == (3, 32, DEPTH + 1)
    assert (wide.tokens[:, 8:] == -1).all() and (wide.parents[:, 8:] == 0).all()
    assert (wide.depths[:, 8:] == 1).all()
    assert wide.ancestors[0, 9].tolist() == [9] + [0] * DEPTH
    for name in ("tokens", "parents", "depths", "ancestors"):
        assert torch.equal(getattr(wide, name)[:, :8], getattr(tree, name)), name
    tables.store(torch.tensor([3, 0, 1]), wide)
    assert tables.tokens[3, :8].tolist() == tree.tokens[0].tolist()
    from helpers import agreeing_targets

    targets = agreeing_targets(tree, 40, seed=5)
    padded_targets = torch.cat([targets, torch.zeros(3, 24, dtype=torch.long)], 1)
    walked = ddtree.walk(tree, targets)
    walked_wide = ddtree.walk(wide, padded_targets)
    assert torch.equal(walked.path, walked_wide.path)
    assert torch.equal(walked.num_accepted, walked_wide.num_accepted)
    assert tables.widen(wide) is wide


def _timing_runner(max_num_seqs: int) -> SimpleNamespace:
    """What ``tuner.measure`` reads of a runner: vLLM's default 512-token full decode graphs."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = SimpleNamespace(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_cudagraph_capture_size=512
    )
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_scheduled_tokens=8192, max_num_seqs=max_num_seqs),
        vllm_config=SimpleNamespace(compilation_config=compilation),
    )


def test_the_tuner_times_and_schedules_only_trees_within_full_graphs():
    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.tuner import BudgetTuner, measure

    options = DDTreeOptions(255, auto_budget=True)
    tuner = BudgetTuner(options, torch.device("cpu"))
    runner = _timing_runner(max_num_seqs=32)
    timed = []

    def seconds(reqs: int, budget: int) -> float:
        timed.append((reqs, budget))
        return 1e-3  # every step as fast: only the graph limit bounds the schedule

    measure(tuner, runner, 15, seconds)
    assert tuner.candidates == [15, 31, 63, 127, 255]
    assert max(r * (1 + k) for r, k in timed) == 512
    assert tuner.step_ms[-1] == [1.0] + [float("inf")] * 4  # 32 requests: the chain only
    assert options.budget_schedule == (
        (1, 2, 255),
        (3, 4, 127),
        (5, 8, 63),
        (9, 16, 31),
        (17, 32, 15),
    )


def test_start_up_timing_survives_stalls():
    """A stalled timing (the host busy with another engine's start-up) must not cut a bucket's
    budgets: the fastest of several rounds per cell, and a larger budget's lower time bounds
    a smaller one's (not a running maximum, which carries a stall to every larger budget)."""
    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.tuner import TIMING_ROUNDS, BudgetTuner, measure

    options = DDTreeOptions(255, auto_budget=True)
    tuner = BudgetTuner(options, torch.device("cpu"))
    runner = _timing_runner(max_num_seqs=2)
    calls = {}

    def seconds(reqs: int, budget: int) -> float:
        calls[reqs, budget] = calls.get((reqs, budget), 0) + 1
        if (reqs, budget) == (1, 63):
            return 5e-3  # stalled in every round
        if (reqs, budget) == (2, 31) and calls[reqs, budget] == 1:
            return 9e-3  # stalled once
        return 1e-3 + 1e-6 * budget

    measure(tuner, runner, 15, seconds)
    assert set(calls.values()) == {TIMING_ROUNDS}
    assert tuner.step_ms[0][2] == pytest.approx(1e3 * (1e-3 + 127e-6))  # 63 bounded by 127
    assert tuner.step_ms[1][1] == pytest.approx(1e3 * (1e-3 + 31e-6))
    assert options.budget_schedule == ((1, 2, 255),)


def test_v2_start_up_timing_includes_every_rows_logits_and_sampling(monkeypatch):
    """The V2 step timed at start-up is the dummy verify + drafter, then the logits of all
    ``requests x (1 + K)`` rows and vLLM's Gumbel-max pass over them (what grows with K)."""
    from vllm.v1.worker.gpu.sample import gumbel

    from ddtree.vllm_plugin.tuner import v2_step_seconds

    sampled = []
    monkeypatch.setattr(
        gumbel, "gumbel_sample", lambda logits, request, *a, **k: sampled.append(logits.shape)
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    dummy = []

    def dummy_run(num_tokens, uniform_decode, skip_eplb):
        dummy.append((num_tokens, runner.decode_query_len))
        return torch.zeros(num_tokens + 8, 4), None  # padded rows past the batch

    states = SimpleNamespace(temperature=SimpleNamespace(gpu=None), seeds=SimpleNamespace(gpu=None))
    runner = SimpleNamespace(
        decode_query_len=16,
        device=torch.device("cpu"),
        _dummy_run=dummy_run,
        model=SimpleNamespace(compute_logits=lambda hidden: hidden @ torch.zeros(4, 50)),
        sampler=SimpleNamespace(sampling_states=states),
    )
    seconds = v2_step_seconds(runner, repeats=2)(4, 31)
    assert seconds >= 0 and runner.decode_query_len == 16
    assert dummy == [(128, 32)] * 3  # one warm call, two timed
    assert sampled == [(128, 50)] * 3


def test_acceptance_log_waits_for_its_copy_without_a_sync(caplog):
    """``DDTREE_ACCEPTANCE`` on CUDA: the sums go to the host by a non-blocking copy and are
    logged at the first step after the copy's event completed (never a blocking read)."""
    import json
    import logging

    from ddtree.bench.report import ACCEPTANCE_MARKER
    from ddtree.vllm_plugin.debug import AcceptanceLog

    done = []
    log = AcceptanceLog(2, 4, "cpu")
    log.reader.event = SimpleNamespace(record=lambda: None, query=lambda: bool(done))  # CUDA's
    path = torch.tensor([[0, 1, 3, -1]])
    with caplog.at_level(logging.WARNING, logger="vllm.ddtree"):
        for _ in range(5):
            log.update(path, torch.tensor([4]))
            log.step()
        lines = [r.getMessage() for r in caplog.records if ACCEPTANCE_MARKER in r.getMessage()]
        assert lines == []  # the copy has not landed: nothing read, nothing logged
        done.append(True)
        log.step()
    lines = [r.getMessage() for r in caplog.records if ACCEPTANCE_MARKER in r.getMessage()]
    report = json.loads(lines[0].split(ACCEPTANCE_MARKER, 1)[1])
    assert report == {"steps": 2, "budget": 4, "rows": [2] * 4, "accepted": [2, 2, 4, 4]}


def test_drafter_trees_per_bucket_follow_the_schedule():
    """The V2 drafter builds, per graph bucket, the widest tree a batch size of the bucket
    may verify: "auto" within full graphs, a schedule its largest K there, else B."""
    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.v2.speculator import make_speculator_class

    cls = make_speculator_class(object)

    def budgets(options: DDTreeOptions, graph_tokens=512) -> list[int]:
        engine = SimpleNamespace(options=options, depth=15)
        speculator = SimpleNamespace(engine=engine, tree_budgets={}, _graph_tokens=graph_tokens)
        return [cls.tree_budget(speculator, n) for n in (1, 2, 3, 4, 8, 16, 24, 32)]

    schedule = ((1, 2, 255), (3, 8, 63), (9, 512, 15))
    assert budgets(DDTreeOptions(255, budget_schedule=schedule)) == [
        255,
        255,
        63,
        63,
        63,
        15,
        15,
        15,
    ]
    assert budgets(DDTreeOptions(255, auto_budget=True)) == [255, 255, 127, 127, 63, 31, 15, 15]
    assert budgets(DDTreeOptions(255)) == [255] * 8


def test_chain_sized_buckets_draft_the_argmax_chain_without_a_tree_build():
    """A drafter graph whose bucket verifies K <= D drafts stores the argmax chain (no
    vocabulary stage, no tree build, no tuner proposals) — the very tree that ``build_tree``
    with ``chain_seed`` gives at K, ties to the lower id — and wider buckets build trees."""
    from ddtree.vllm_plugin.config import DDTreeOptions
    from ddtree.vllm_plugin.v2.engine import TreeTables
    from ddtree.vllm_plugin.v2.speculator import make_speculator_class

    cls = make_speculator_class(object)
    depth, vocab, budget = 6, 50, 31
    gen = torch.Generator().manual_seed(4)
    schedule = ((1, 2, budget), (3, 512, 4))  # 3+ requests: a chain-sized K = 4
    built = []

    class Tuner:
        def proposed(self, scores, real):
            built.append(scores.shape[1] - 1)

    def speculator(num_reqs: int):
        engine = SimpleNamespace(
            options=DDTreeOptions(budget, budget_schedule=schedule),
            depth=depth,
            tables=TreeTables(8, budget, depth, torch.device("cpu")),
            settings=SimpleNamespace(fused_tree_kernels=False),
            tuner=Tuner(),
        )
        spec = SimpleNamespace(
            engine=engine,
            tree_budgets={},
            _graph_tokens=512,
            idx_mapping=torch.tensor([5, 0, 7, 2, 1, 3, 4, 6])[:num_reqs],
            draft_nodes=torch.zeros(8, budget, dtype=torch.long),
        )
        spec.tree_budget = lambda n: cls.tree_budget(spec, n)
        spec._build_trees = lambda logits: cls._build_trees(spec, logits)
        return spec

    for num_reqs, k in ((4, 4), (2, budget)):
        logits = torch.randn(num_reqs, depth, vocab, generator=gen)
        logits[0, 1, 7] = logits[0, 1, 3] = logits[0, 1].max() + 1  # a tie: the lower id
        spec = speculator(num_reqs)
        built.clear()
        cls._store_trees(spec, logits)
        assert built == ([] if k <= depth else [budget])
        expected = spec.engine.tables.widen(ddtree.build_tree(logits, k, chain_seed=True))
        rows = spec.idx_mapping.long()
        tables = spec.engine.tables
        assert torch.equal(tables.tokens[rows], expected.tokens)
        assert torch.equal(tables.parents[rows], expected.parents)
        assert torch.equal(tables.depths[rows], expected.depths.int())
        assert torch.equal(tables.ancestors[rows], expected.ancestors.int())
        nodes = expected.tokens[:, 1:]
        assert torch.equal(spec.draft_nodes[:num_reqs], torch.where(nodes >= 0, nodes, 0))
        if k <= depth:
            assert tables.tokens[5, 2].item() == 3


def test_v2_per_step_code_is_sync_checked():
    """DDTREE_SYNC_DEBUG (the equality suite's ``ddtreesync`` cases) covers every piece of
    DDTree's own per-step code on the V2 runner that runs outside a CUDA graph: a host sync
    there would serialize async scheduling's host and GPU work."""
    from ddtree.vllm_plugin.v2 import prepare
    from ddtree.vllm_plugin.v2.engine import TreeEngine
    from ddtree.vllm_plugin.v2.sampler import TreeSampler
    from ddtree.vllm_plugin.v2.speculator import make_speculator_class

    speculator = make_speculator_class(object)
    for fn in (
        prepare.begin_step,
        prepare.prepare_step,
        TreeEngine.attend,
        TreeSampler._walk,
        TreeSampler._chain_stats,
        speculator._accepted_path_first,
    ):
        assert getattr(fn, "__wrapped__", None) is not None, fn.__qualname__


def test_v2_steps_are_profiled_by_stage(caplog):
    """``DDTREE_PROFILE`` on the V2 runner: begin_step, the verify forward, the tree sampler and
    the speculator's propose mark the step's stages, and every N served steps one report of
    mean ms per stage is logged; dummy runs and graph captures are not profiled."""
    import json
    import logging

    from ddtree.bench.report import PROFILE_MARKER
    from ddtree.vllm_plugin.config import DDTreeOptions, Settings
    from ddtree.vllm_plugin.v2 import prepare
    from ddtree.vllm_plugin.v2.engine import TreeEngine, TreeTables
    from ddtree.vllm_plugin.v2.sampler import TreeSampler
    from ddtree.vllm_plugin.v2.speculator import make_speculator_class

    class Drafter:  # vLLM's DFlash speculator, as far as DDTree's propose calls it
        def propose(self, *args, **kwargs):
            return None

    tables = TreeTables(4, 31, DEPTH, torch.device("cpu"))
    settings = Settings(cuda_graphs=False, profile_every=2)
    engine = TreeEngine(DDTreeOptions(31), DEPTH, settings, tables)
    chain = lambda *a: SimpleNamespace(num_sampled=torch.tensor([1], dtype=torch.int32))  # noqa: E731
    sampler = TreeSampler(engine, SimpleNamespace(), 31, chain)
    speculator_cls = make_speculator_class(Drafter)
    speculator = speculator_cls.__new__(speculator_cls)  # its state only: no vLLM config
    speculator.engine, speculator.draft_nodes = engine, torch.zeros(4, 31, dtype=torch.long)
    out = SimpleNamespace(
        scheduled_spec_decode_tokens={"a": [1] * 5}, num_scheduled_tokens={"a": 6}
    )
    batch = SimpleNamespace(cu_num_logits=torch.tensor([0, 6], dtype=torch.int32), num_reqs=1)

    def step(dummy_run: bool) -> None:
        prepare.begin_step(engine, out, dummy_run)
        engine.mark("forward")  # patches.prepare_attn, after prepare_step
        engine.chain_trees = True  # 5 drafts <= D: the chain's verify
        sampler(torch.zeros(6, VOCAB), batch)
        speculator.propose(batch, None, None, None, None, None, None, dummy_run=dummy_run)

    caplog.set_level(logging.WARNING, logger="vllm.ddtree")
    step(dummy_run=True)
    engine.capturing = True
    step(dummy_run=False)
    engine.capturing = False
    assert engine.profile.marks == [] and PROFILE_MARKER not in caplog.text
    for _ in range(3):  # the third step's "prepare" closes the second: one report
        step(dummy_run=False)
    reports = [r.getMessage() for r in caplog.records if PROFILE_MARKER in r.getMessage()]
    assert len(reports) == 1, reports
    report = json.loads(reports[0].split(PROFILE_MARKER, 1)[1])
    assert report["steps"] == 2
    assert list(report["ms_per_step"]) == ["prepare", "forward", "sample", "vllm", "draft", "rest"]
