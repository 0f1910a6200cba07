"""Which rows of a verify step the V2 attention hook leaves to vLLM's backend and which to the
paged tree kernel (``TreeEngine.attend``): with a forced chain the backend's causal pass
computes the root and the chain, as for vLLM's own chain verify, the tree kernel the rest."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")


def _attend(monkeypatch, chain_seed: bool, max_query_len: int, all_tree: bool = True):
    from ddtree.vllm_plugin.config import DDTreeOptions, Settings
    from ddtree.vllm_plugin.v2 import engine as engine_module
    from ddtree.vllm_plugin.v2.engine import TreeEngine, TreeTables

    calls = []
    monkeypatch.setattr(
        engine_module,
        "paged_tree_attention",
        lambda *args, first_slot=0, **kw: calls.append(("tree", first_slot)),
    )
    tables = TreeTables(4, 63, 15, torch.device("cpu"))
    engine = TreeEngine(DDTreeOptions(63, chain_seed=chain_seed), 15, Settings(), tables)
    engine.tree_step, engine.all_tree = True, all_tree
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
