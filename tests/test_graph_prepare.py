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
