"""Which rows of a verify step the V2 attention hook leaves to vLLM's backend and which to the
paged tree kernel (``TreeEngine.attend``): with a forced chain the backend's causal pass
computes the root and the chain, as for vLLM's own chain verify, the tree kernel the rest."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")


def _attend(
    monkeypatch, chain_seed: bool, max_query_len: int, all_tree: bool = True, chain=False,
    settings=None,
):  # fmt: skip
    """The calls one ``attend`` makes, in order: ("backend",), ("flash",) (the context part
    by FlashAttention), ("tree", first_slot[, the kernel's keyword arguments])."""
    from ddtree.vllm_plugin.attention import flash
    from ddtree.vllm_plugin.config import DDTreeOptions, Settings
    from ddtree.vllm_plugin.v2 import engine as engine_module
    from ddtree.vllm_plugin.v2.engine import TreeEngine, TreeTables

    calls = []

    def tree_kernel(*args, first_slot=0, **kw):
        calls.append(("tree", first_slot, sorted(kw)) if kw else ("tree", first_slot))

    monkeypatch.setattr(
        flash,
        "context_attention",
        lambda *args: calls.append(("flash",)) or {"context_out": 1, "context_lse": 2},
    )
    monkeypatch.setattr(engine_module, "paged_tree_attention", tree_kernel)
    tables = TreeTables(4, 63, 15, torch.device("cpu"))
    options = DDTreeOptions(63, chain_seed=chain_seed)
    engine = TreeEngine(options, 15, settings or Settings(), tables)
    engine.tree_step, engine.all_tree, engine.chain_trees = True, all_tree, chain
    metadata = SimpleNamespace(
        max_query_len=max_query_len,
        query_start_loc=torch.tensor([0, max_query_len], dtype=torch.int32),
        seq_lens=torch.tensor([max_query_len + 9], dtype=torch.int32),
        block_table=torch.zeros(1, 4, dtype=torch.int32),
    )
    query = torch.zeros(max_query_len, 2, 8)
    impl = SimpleNamespace(scale=1.0)
    engine.attend(
        impl, lambda: calls.append(("backend",)), query, None, None, None, metadata,
        torch.zeros_like(query), 0,
    )  # fmt: skip
    return calls


def test_forced_chain_rows_take_the_backends_pass(monkeypatch):
    # B = 63 verified: root + chain of D = 15 by the backend, slots 16.. by the tree kernel
    assert _attend(monkeypatch, True, 64) == [("backend",), ("tree", 16)]
    # a step budget K = 10 <= D: the whole tree is the chain, the kernel writes nothing
    assert _attend(monkeypatch, True, 11) == [("backend",), ("tree", 11)]
    # no forced chain: every request a tree -> the tree kernel alone
    assert _attend(monkeypatch, False, 64) == [("tree", 0)]
    # a mixed step (prefill rows) always takes the backend's pass
    assert _attend(monkeypatch, False, 300, all_tree=False) == [("backend",), ("tree", 0)]
    assert _attend(monkeypatch, True, 300, all_tree=False) == [("backend",), ("tree", 16)]
    # every tree of the step its forced chain (K <= D drafts, begin_step's chain_trees): the
    # backend's pass computes them all, also in a mixed step; no tree-kernel launch
    assert _attend(monkeypatch, True, 300, all_tree=False, chain=True) == [("backend",)]
    assert _attend(monkeypatch, True, 11, chain=True) == [("backend",)]


def test_chain_sized_trees_skip_the_drafters_reorder():
    """A chain-seeded tree of K <= D drafts is its forced chain: every walk's path is slots
    0..a in order, so the drafter's rows and positions are already in place. ``begin_step``
    says so only then (``chain_trees``), and the speculator skips its reorder."""
    import ddtree
    from ddtree.vllm_plugin.config import DDTreeOptions, Settings
    from ddtree.vllm_plugin.v2.engine import TreeEngine, TreeTables
    from ddtree.vllm_plugin.v2.prepare import begin_step

    gen = torch.Generator().manual_seed(0)
    depth, vocab = 6, 3
    for budget in range(1, depth + 1):
        logits = torch.randn(64, depth, vocab, generator=gen) * 2
        tree = ddtree.build_tree(logits, budget, chain_seed=True)
        # targets agreeing with the argmax chain for a random number of steps, then not
        chain = logits.argmax(-1)
        agree = torch.arange(depth) < torch.randint(0, depth + 1, (64, 1), generator=gen)
        targets = torch.zeros(64, budget + 1, dtype=torch.long)
        targets[:, :budget] = torch.where(
            agree[:, :budget], chain[:, :budget], (chain[:, :budget] + 1) % vocab
        )
        path = ddtree.walk(tree, targets).path
        slot = torch.arange(path.shape[1]).expand_as(path)
        assert torch.equal(torch.where(path >= 0, slot, -1), path), budget
        assert (path[:, 1:] >= 0).any()  # some walks leave the root

    def flags(chain_seed: bool, drafts: dict) -> bool:
        tables = TreeTables(4, 63, depth, torch.device("cpu"))
        engine = TreeEngine(DDTreeOptions(63, chain_seed=chain_seed), depth, Settings(), tables)
        out = SimpleNamespace(
            scheduled_spec_decode_tokens=drafts, num_scheduled_tokens=dict.fromkeys(drafts, 1)
        )
        begin_step(engine, out, dummy_run=False)
        return engine.chain_trees

    assert flags(True, {"a": [1] * depth, "b": [2] * 3})
    assert not flags(True, {"a": [1] * depth, "b": [2] * (depth + 1)})  # one wider tree
    assert not flags(False, {"a": [1] * 3})  # a tree without its forced chain


def test_flash_context_part_reaches_the_tree_kernel(monkeypatch):
    """``DDTREE_TREE_ATTENTION=flash``: the context part comes from one FlashAttention call
    (its output and log-sum-exp handed to the tree kernel), after the backend's chain rows."""
    from ddtree.vllm_plugin.config import Settings

    calls = _attend(monkeypatch, True, 64, settings=Settings(tree_attention="flash"))
    assert calls == [("backend",), ("flash",), ("tree", 16, ["context_lse", "context_out"])]


def test_flash_context_call_sees_the_cached_context_only(monkeypatch):
    """The FlashAttention call covers each request's cached tokens (seq_len minus the step's
    own), non-causal, one split (graph safe), into the persistent buffer; its [H, T]
    log-sum-exp is handed on as [T, H]."""
    import vllm.v1.attention.backends.fa_utils as fa_utils

    from ddtree.vllm_plugin.attention import flash

    seen = {}

    def fake(**kw):
        seen.update(kw)
        return kw["out"], torch.arange(3 * 12.0).view(3, 12)  # lse [H, T]

    monkeypatch.setattr(fa_utils, "flash_attn_varlen_func", fake, raising=False)
    metadata = SimpleNamespace(
        max_query_len=7,
        max_seq_len=40,
        query_start_loc=torch.tensor([0, 5, 12, 12], dtype=torch.int32),  # the last: padding
        seq_lens=torch.tensor([40, 7, 0], dtype=torch.int32),
        block_table=torch.zeros(3, 4, dtype=torch.int32),
    )
    impl = SimpleNamespace(head_size=4, scale=0.5, vllm_flash_attn_version=3)
    context, out = torch.full((5,), -7, dtype=torch.int32), torch.zeros(20, 3, 4)
    kv_cache = torch.zeros(6, 2, 16, 8)  # [blocks, kv heads, block, 2 x head]
    got = flash.context_attention(impl, torch.zeros(12, 3, 4), kv_cache, metadata, context, out)
    assert seen["seqused_k"].tolist() == [35, 0, 0]  # 40 - 5; a prefill's 7 - 7; padding
    assert seen["causal"] is False and seen["num_splits"] == 1 and seen["softmax_scale"] == 0.5
    assert seen["out"].data_ptr() == out.data_ptr() and seen["out"].shape[0] == 12
    assert seen["k"].shape == (6, 16, 2, 4) and seen["v"].shape == (6, 16, 2, 4)
    assert got["context_lse"].shape == (12, 3) and got["context_lse"][5, 2] == 2 * 12 + 5
    assert got["context_out"].shape == (12, 3, 4)


def test_context_shares_follow_the_launch_grid():
    """``DDTREE_CONTEXT_SPLITS=auto``: shares only where the grid leaves the GPU idle (one or
    two requests at B=63 on 132 SMs at Qwen3-8B's 8 KV heads x 4), none for a full grid or a
    step past the scratch; a fixed N always N; the scratch handed on is N shares wide."""
    from ddtree.vllm_plugin.attention.paged_tree_kernel import shares_for_grid
    from ddtree.vllm_plugin.config import DDTreeOptions, Settings
    from ddtree.vllm_plugin.v2.engine import TreeEngine, TreeTables

    def shares(reqs, query_len, first=16, sms=132, most=4):
        return shares_for_grid(reqs, query_len, first, 8, 4, sms, most)

    assert shares(1, 64) == 4  # 3 row blocks x 8 KV heads = 24 programs: 4 x 24 <= 132
    assert shares(2, 64) == 2
    assert shares(4, 64) == 1
    assert shares(1, 128) == 2  # B = 127: 7 row blocks
    assert shares(1, 256) == 1  # B = 255: 15 row blocks, 120 programs
    assert shares(8, 256) == 1
    assert shares(1, 64, most=2) == 2 and shares(1, 64, most=8, sms=1000) == 8
    assert shares(1, 16) == 1  # the whole tree is the forced chain: no tree-kernel rows

    def engine_shares(splits: int, reqs: int, query_len: int, tokens: int):
        tables = TreeTables(4, 63, 15, torch.device("cpu"))
        engine = TreeEngine(DDTreeOptions(63), 15, Settings(context_splits=splits), tables)
        width = 4 if splits == 0 else splits
        engine.context_partials = (
            torch.zeros(256, 32, width, 128), torch.zeros(256, 32, width)
        )  # fmt: skip
        engine.num_sms = 132
        metadata = SimpleNamespace(
            max_query_len=query_len, query_start_loc=torch.zeros(reqs + 1, dtype=torch.int32)
        )
        kv_cache = torch.zeros(1, 8, 16, 256)
        return engine.context_shares(torch.zeros(tokens, 32, 128), kv_cache, metadata, 16)

    auto = engine_shares(0, 1, 64, 64)
    assert auto["context_splits"] == 4
    assert [tuple(t.shape) for t in auto["partials"]] == [(256, 32, 4, 128), (256, 32, 4)]
    two = engine_shares(0, 2, 64, 128)["partials"]
    assert two[0].shape[2] == 2 and two[0].stride(2) == 128 and two[1].stride(2) == 1
    assert engine_shares(0, 8, 64, 256) == {}  # a full grid
    assert engine_shares(0, 1, 64, 300) == {}  # a step past the scratch
    assert engine_shares(3, 8, 64, 256)["context_splits"] == 3  # fixed: always
