"""``GraphCache.prepare``: graphs captured at start-up, not in a served step (the CUDA side is
in test_gpu_graphs.py); the V2 tree sampler prepares its tail for every request bucket."""

from types import SimpleNamespace

import pytest
import torch

from ddtree.vllm_plugin import graphs


def test_prepare_is_a_no_op_where_the_cache_runs_eagerly():
    calls = []
    cache = graphs.GraphCache(lambda a: calls.append(a) or a + 1)
    cache.prepare(torch.zeros(3))  # CPU tensors: eager, nothing to capture
    assert calls == [] and cache.entries == {}
    off = graphs.GraphCache(lambda a: calls.append(a), enabled=False)
    off.prepare(torch.zeros(3))
    assert calls == [] and off.entries == {}


def test_tree_sampler_prepares_its_tail_for_every_bucket():
    pytest.importorskip("vllm")
    from ddtree.vllm_plugin.v2.sampler import TreeSampler

    prepared = []
    sampler = object.__new__(TreeSampler)  # only what capture_tails reads
    sampler.engine = SimpleNamespace(tables=SimpleNamespace(tokens=torch.zeros(8, 65)))
    sampler._inputs = {}
    sampler.tail = SimpleNamespace(prepare=lambda *inputs: prepared.append(inputs))
    sampler.capture_tails(24, torch.device("cpu"))
    assert [inputs[0].shape for inputs in prepared] == [(r, 65) for r in (1, 2, 4, 8, 16, 32)]
    assert all(len(inputs) == 5 and inputs[4].dtype == torch.bool for inputs in prepared)
    # a served step of that bucket reads the same buffers the graph was captured with
    served = sampler._tail_buffers(32, torch.device("cpu"))
    assert all(a is b for a, b in zip(served, prepared[-1], strict=True))


def test_tree_sampler_warms_the_chain_step_without_touching_the_sums(monkeypatch):
    """Start-up runs vLLM's rejection sampler once on its dummy batch, with the model's own
    logits, and the chain sums' kernel into scratch: the tuner's curve stays zero."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu import input_batch

    from ddtree.budget import AcceptanceCurve
    from ddtree.vllm_plugin.v2.sampler import TreeSampler

    dummy = SimpleNamespace(cu_num_logits=torch.tensor([0, 16]))
    monkeypatch.setattr(input_batch.InputBatch, "make_dummy", lambda *args: dummy)
    calls = []
    sampler = object.__new__(TreeSampler)
    sampler.chain_sampler = lambda logits, batch, draft: (
        calls.append((logits, batch, draft))
        or (SimpleNamespace(num_sampled=torch.tensor([4], dtype=torch.int32)))
    )
    curve = AcceptanceCurve(15, torch.device("cpu"))
    sampler.engine = SimpleNamespace(acceptance=None, tuner=SimpleNamespace(curve=curve))
    runner = SimpleNamespace(
        model_config=SimpleNamespace(get_hidden_size=lambda: 8), dtype=torch.float32,
        device=torch.device("cpu"), input_buffers=None,
        model=SimpleNamespace(compute_logits=lambda hidden: hidden.sum(1, keepdim=True) + 7),
    )  # fmt: skip
    sampler.warm_chain_step(runner)
    ((logits, batch, draft),) = calls
    assert torch.equal(logits, torch.full((1, 1), 7.0)) and batch is dummy and draft is None
    assert not curve.rows.any() and not curve.accepted.any()
    sampler.chain_sampler = None  # hybrid targets: no chain step to warm
    sampler.warm_chain_step(runner)
    assert len(calls) == 1
