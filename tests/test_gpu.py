"""CUDA-only: build + walk captured in a CUDA graph replay exactly like eager, with no sync."""

import pytest
import torch

import ddtree

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "batch, budget, vocab", [(1, 64, 1000), (4, 255, 151936), (2, 1024, 32000)]
)
def test_cuda_graph_replay_matches_eager(batch, budget, vocab):
    depth = 15
    logits = torch.randn(batch, depth, vocab, device="cuda") * 4
    target = torch.randint(0, vocab, (batch, 1 + budget), device="cuda")

    def step():
        tree = ddtree.build_tree(logits, budget, chain_seed=True, check_values=False)
        target[:, 0] = tree.tokens[:, 1]
        return tree, ddtree.walk(tree, target)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # any host sync during capture raises
    try:
        with torch.cuda.graph(graph):
            tree_out, acc_out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(3):
        logits.copy_(torch.randn_like(logits) * 4)
        graph.replay()
        tree, acc = step()
        for name in ("tokens", "parents", "depths", "mask", "ancestors", "num_nodes"):
            assert torch.equal(getattr(tree_out, name), getattr(tree, name)), name
        for name in ("path", "num_accepted", "bonus", "emitted"):
            assert torch.equal(getattr(acc_out, name), getattr(acc, name)), name
        assert int(acc.num_accepted.min()) >= 1


def test_matches_cpu():
    logits = torch.randn(2, 15, 5000) * 4
    cpu = ddtree.build_tree(logits, 128)
    gpu = ddtree.build_tree(logits.cuda(), 128)
    # logsumexp rounds differently on the two devices; token sets must agree all the same
    # (no near-ties at this scale).
    assert torch.equal(cpu.tokens, gpu.tokens.cpu())
    assert torch.equal(cpu.parents, gpu.parents.cpu())
