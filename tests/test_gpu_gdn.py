"""CUDA-only: the tree GDN kernel at Qwen3.6-27B GDN head shapes (16 key heads, 48 value
heads, head size 128) in bf16 against the float32 torch reference, on a budget-63 tree."""

import pytest
import torch

import ddtree
from ddtree.gdn import tree_gdn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch", [1, 4])
def test_tree_gdn_kernel_bf16(batch):
    from ddtree.kernels.gdn_tree import tree_gdn_fused

    gen = torch.Generator(device="cuda").manual_seed(batch)
    n, heads, heads_v, dim = 64, 16, 48, 128

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    trees = ddtree.build_tree(rand(batch, 15, 3000) * 3, n - 1, chain_seed=True)
    q, k = rand(batch, n, heads, dim).bfloat16(), rand(batch, n, heads, dim).bfloat16()
    v = rand(batch, n, heads_v, dim).bfloat16()
    g = -torch.rand(batch, n, heads_v, device="cuda", generator=gen) * 0.1
    beta = torch.rand(batch, n, heads_v, device="cuda", generator=gen)
    state = rand(batch, heads_v, dim, dim) * 0.1
    want, node_states = tree_gdn(q, k, v, g, beta, state, trees.parents)
    got = tree_gdn_fused(q, k, v, g, beta, state, trees.ancestors, trees.depths)
    torch.testing.assert_close(got, want.float(), atol=2e-3, rtol=2e-3)

    # The commit: the deepest node's path replayed into each request's state slot.
    from ddtree.kernels.gdn_tree import replay_path_fused

    rows = torch.arange(batch, device="cuda")
    node = trees.depths.argmax(1)  # [b]: a deepest node
    up = trees.ancestors[rows, node]  # [b, D + 1]: the node, its parent, ..., the root
    depth = trees.depths[rows, node][:, None]
    step = torch.arange(up.shape[1], device="cuda")
    path = torch.where(step <= depth, up.gather(1, (depth - step).clamp(min=0)), -1)
    cache = state.clone()
    replay_path_fused(k, v, g, beta, cache, rows, path)
    torch.testing.assert_close(cache, node_states[rows, node].float(), atol=2e-3, rtol=2e-3)


def test_v2_tree_gdn_glue_on_cuda_and_in_a_graph():
    """``vllm_plugin/v2/gdn.py`` (the V2 runner's GDN verify and commit) on CUDA: the CPU
    glue test's batch (full tree, prefill, clipped tree, padded row), then both steps as one
    CUDA graph replay (fixed shapes, no host read)."""
    pytest.importorskip("vllm")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_v2_glue import check_gdn

    check_gdn("cuda")
