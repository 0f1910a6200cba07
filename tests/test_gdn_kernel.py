"""The tree GDN kernel (``ddtree.kernels.gdn_tree``) against the torch reference
:func:`ddtree.gdn.tree_gdn`, run with Triton's CPU interpreter: DDTree trees with padding
slots, grouped value heads, a V dimension split over several programs, float32 and bfloat16
inputs (the GPU's), with and without the in-kernel q/k L2 norm."""

import pytest
import torch

import ddtree
from ddtree.gdn import tree_gdn

from helpers import run_interpreted

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def test_kernel_equals_the_reference():
    """Runs this file's checks under Triton's interpreter (``helpers.run_interpreted``)."""
    pytest.importorskip("triton")
    run_interpreted(__file__)


def check(dtype: torch.dtype, l2norm: bool, seed: int) -> None:
    from ddtree.kernels.gdn_tree import tree_gdn_fused

    gen = torch.Generator().manual_seed(seed)
    batch, depth, budget = 2, 3, 17  # 2 + 4 + 8 = 14 prefixes exist: 3 padding slots
    trees = ddtree.build_tree(torch.randn(batch, depth, 2, generator=gen) * 2, budget)
    n, heads, heads_v, dim_k, dim_v = budget + 1, 2, 4, 16, 24

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = rand(batch, n, heads, dim_k), rand(batch, n, heads, dim_k)
    v = rand(batch, n, heads_v, dim_v)
    g = -torch.rand(batch, n, heads_v, generator=gen)  # log-decay <= 0
    beta = torch.rand(batch, n, heads_v, generator=gen)
    state = rand(batch, heads_v, dim_v, dim_k) * 0.5
    inputs = [t.to(dtype) for t in (q, k, v, g, beta)]
    want, _ = tree_gdn(*inputs, state, trees.parents, use_qk_l2norm=l2norm)
    got = tree_gdn_fused(
        *inputs, state, trees.ancestors, trees.depths, use_qk_l2norm=l2norm, block_v=16
    )
    assert (trees.parents[:, 1:] < 0).any(), "the case should hold padding slots"
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)

    # The commit: each request's accepted path replayed into its own slot of a state cache
    # (other slots untouched), equal to the reference's replay and to the tree's node state.
    from ddtree.gdn import GDNStash, replay_path
    from ddtree.kernels.gdn_tree import replay_path_fused

    deepest = [int(trees.depths[r].argmax()) for r in range(batch)]  # a deepest node each
    path = torch.full((batch, depth + 2), -1, dtype=torch.long)
    for r, node in enumerate(deepest):
        chain = []
        while node >= 0:
            chain.append(node)
            node = int(trees.parents[r, node])
        path[r, : len(chain)] = torch.tensor(chain[::-1])
    stash = GDNStash(*inputs[1:], torch.zeros(batch, n, 3), trees.parents)
    want_state, _ = replay_path(stash, path, state, torch.zeros(batch, 3, 3), use_qk_l2norm=l2norm)
    cache = torch.randn(5, heads_v, dim_v, dim_k, generator=gen)
    slots = torch.tensor([3, 1])
    cache[slots] = state
    before = cache.clone()
    replay_path_fused(*inputs[1:], cache, slots, path, use_qk_l2norm=l2norm, block_v=16)
    torch.testing.assert_close(cache[slots], want_state.float(), atol=1e-4, rtol=1e-4)
    others = [i for i in range(5) if i not in slots.tolist()]
    assert torch.equal(cache[others], before[others])
    _, node_states = tree_gdn(*inputs, state, trees.parents, use_qk_l2norm=l2norm)
    for r, node in enumerate(deepest):
        torch.testing.assert_close(
            cache[slots[r]], node_states[r, node].float(), atol=1e-4, rtol=1e-4
        )


if __name__ == "__main__":
    for seed, (dtype, l2norm) in enumerate(
        [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)]
    ):
        check(dtype, l2norm, seed)
