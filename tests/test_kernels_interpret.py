"""ddtree.kernels run by Triton's CPU interpreter at small shapes, against the torch path and
ddtree.reference (tests/kernel_checks.py). Triton picks interpreter or compiler when a kernel is
decorated, i.e. when ddtree.kernels is first imported, so in an ordinary run this module starts
itself in a fresh process with TRITON_INTERPRET=1 (one test here, the cases there)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETING:

    def test_kernels_in_the_interpreter():
        """This file's tests under Triton's interpreter, in two processes side by side: the
        tree stage's hypothesis search (about 60% of the time) and the rest."""
        from helpers import run_side_by_side

        pytest.importorskip("triton")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        base = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        base += ["-W", "ignore::DeprecationWarning"]
        heavy = f"{__file__}::test_tree_stage"
        runs = [[*base, heavy], [*base, __file__, "-k", "not test_tree_stage or short_last_chunk"]]
        outputs = run_side_by_side(runs, env)
        assert all(" passed" in output for output in outputs), outputs  # both ran tests

    def test_pdl_setting_is_checked_and_off_for_cpu_tensors():
        pytest.importorskip("triton")
        from ddtree.kernels._common import pdl_args

        assert pdl_args(torch.device("cpu")) == {"PDL": False}
        env = {**os.environ, "DDTREE_PDL": "yes"}
        done = subprocess.run(
            [sys.executable, "-c", "import ddtree.kernels"], env=env, capture_output=True, text=True
        )
        assert done.returncode != 0 and "DDTREE_PDL must be 0 or 1, got 'yes'" in done.stderr

    def test_fused_path_refuses_cpu_tensors():
        pytest.importorskip("triton")
        from ddtree import kernels

        with pytest.raises(kernels.FusedUnavailable, match="needs CUDA tensors"):
            kernels.build_tree_fused(torch.randn(1, 3, 50), 8)
        tree = __import__("ddtree").build_tree(torch.randn(1, 3, 50), 8)
        with pytest.raises(kernels.FusedUnavailable, match="needs CUDA tensors"):
            kernels.walk_fused(tree, torch.zeros(1, 9, dtype=torch.long))

else:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import ddtree
    from ddtree import kernels
    from ddtree.kernels import vocab_topk
    from ddtree.tree import draft_topk

    from helpers import KINDS, agreeing_targets, make_logits
    from kernel_checks import (
        check_build_vs_reference,
        check_compact_kv,
        check_tree,
        check_vocab,
        check_walk,
        clustered_logits,
    )

    DTYPES = (torch.float32, torch.bfloat16)

    @pytest.fixture(autouse=True)
    def small_networks(monkeypatch):
        """The interpreter's bitonic sort costs seconds at 1024 keys: keep the networks small."""
        monkeypatch.setattr(vocab_topk, "MIN_CAP", 64)

    @settings(max_examples=20, deadline=None)
    @given(
        st.integers(1, 2),  # batch
        st.integers(1, 2),  # depth
        st.integers(2, 1500),  # vocab
        st.integers(1, 32),  # k (clamped to the vocabulary)
        st.sampled_from((*KINDS, "sorted", "block")),
        st.sampled_from(DTYPES),
        st.sampled_from((256, 1024)),  # tokens per program: several programs per row
        st.integers(0, 2**31 - 1),
    )
    def test_vocab_stage(batch, depth, vocab, k, kind, dtype, segment, seed):
        make = clustered_logits if kind in ("sorted", "block") else make_logits
        logits = make(kind, batch, depth, vocab, seed).to(dtype)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(vocab_topk, "SEGMENT", segment)
            check_vocab(logits, min(k, vocab))

    def test_vocab_stage_edges():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(vocab_topk, "SEGMENT", 256)
            # Every token tied (the exact fallback), k = V, -0.0 next to +0.0, a single token.
            check_vocab(torch.zeros(1, 2, 700), 32)
            check_vocab(make_logits("normal", 1, 1, 30, 0), 30)
            check_vocab(torch.tensor([[[0.0, -0.0, 1.0, -0.0, 0.0, -1.0]]]), 4)
            check_vocab(torch.tensor([[[3.0]]]), 1)

    @settings(max_examples=30, deadline=None)
    @given(
        st.integers(1, 3),  # batch
        st.integers(1, 16),  # depth
        st.integers(2, 300),  # vocab
        st.integers(1, 32),  # budget
        st.sampled_from(KINDS),
        st.booleans(),
        st.integers(0, 2**31 - 1),
    )
    def test_tree_stage(batch, depth, vocab, budget, kind, chain_seed, seed):
        logits = make_logits(kind, batch, depth, vocab, seed)
        logprobs, ids = draft_topk(logits, min(budget, vocab))
        check_tree(logprobs, ids, budget, chain_seed)

    @pytest.mark.parametrize(
        "seed, budget, vocab",
        [(0, 120, 300), (0, 128, 150), (1, 260, 400)],  # last chunk: 4, 5, 82 candidates
    )
    def test_tree_stage_short_last_chunk(seed, budget, vocab):
        """More candidates at a depth than the beam holds, the last chunk short (sorted at 64
        or 256 keys before its merge): found by replaying the kernel's counts on these
        logits (depth 2 has 132, 517 and 594 candidates for beams of 128, 128 and 512)."""
        logits = make_logits("normal", 1, 3, vocab, seed)
        logprobs, ids = draft_topk(logits, min(budget, vocab))
        for chain_seed in (False, True):
            check_tree(logprobs, ids, budget, chain_seed)

    @settings(max_examples=8, deadline=None)
    @given(
        st.integers(1, 2),  # batch
        st.integers(1, 6),  # depth
        st.integers(2, 300),  # vocab
        st.integers(1, 24),  # budget
        st.sampled_from(KINDS),
        st.sampled_from(DTYPES),
        st.booleans(),
        st.integers(0, 2**31 - 1),
    )
    def test_build_and_walk(batch, depth, vocab, budget, kind, dtype, chain_seed, seed):
        logits = make_logits(kind, batch, depth, vocab, seed).to(dtype)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(vocab_topk, "SEGMENT", 256)
            tree = check_build_vs_reference(logits, budget, chain_seed)
        check_walk(tree, agreeing_targets(tree, vocab, seed))
        gen = torch.Generator().manual_seed(seed)
        check_walk(tree, torch.randint(0, vocab, tree.tokens.shape, generator=gen))

    def test_walk_edges():
        tree = ddtree.build_tree(make_logits("normal", 2, 4, 30, 1), 12, chain_seed=True)
        check_walk(tree, torch.full_like(tree.tokens, 29))  # nothing accepted
        target = torch.full_like(tree.tokens, 7)
        for row in range(2):  # the whole chain accepted
            slot = 0
            for d in range(4):
                child = ((tree.parents[row] == slot) & (tree.depths[row] == d + 1)).nonzero()
                target[row, slot] = tree.tokens[row, int(child[0])]
                slot = int(child[0])
        check_walk(tree, target)
        # The chain agrees below its first node only: its deeper nodes match their parents
        # but are not accepted (a walk must check every ancestor, not only the parent).
        for row in range(2):
            first_level = set(tree.tokens[row][tree.depths[row] == 1].tolist())
            target[row, 0] = next(t for t in range(30) if t not in first_level)
        check_walk(tree, target)

    @pytest.mark.parametrize("layout", ["flash", "split"])
    def test_compact_kv(layout):
        gen = torch.Generator().manual_seed(1)
        check_compact_kv(layout, num_layers=3, num_reqs=2, moves=5, device="cpu", gen=gen)
        check_compact_kv(layout, num_layers=1, num_reqs=1, moves=1, device="cpu", gen=gen)

    def test_budget_limits():
        logits = make_logits("normal", 1, 2, 40, 0)
        assert kernels.build_tree_fused(logits, 0).tokens.tolist() == [[-1]]
        with pytest.raises(kernels.FusedUnavailable, match="budgets <= 1024"):
            kernels.build_tree_fused(logits, 1025)
        with pytest.raises(ValueError, match="budget must be >= 0"):
            kernels.build_tree_fused(logits, -1)
