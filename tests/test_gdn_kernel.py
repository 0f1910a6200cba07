"""The tree GDN kernels (``ddtree.kernels.gdn_tree``: recurrence, conv) against the torch
references :func:`ddtree.gdn.tree_gdn` and :func:`ddtree.gdn.tree_conv1d_table`, run with Triton's
CPU interpreter: DDTree trees with padding
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
    run_interpreted(__file__, parts=2)


def check(
    dtype: torch.dtype,
    l2norm: bool,
    seed: int,
    chain_seed: bool = False,
    budget: int = 17,
    run_sizes: tuple[int, ...] = (3,),
) -> None:
    """``budget`` 17 at depth 3: 2 + 4 + 8 = 14 prefixes exist, 3 padding slots. With
    ``chain_seed`` the leading slots are a chain (walked by the root's program), and
    ``budget`` <= 3 makes the whole tree one. ``run_sizes``: the off-chain nodes per run of
    the kernel's programs to check (each size a whole interpreted run: the sizes go with one
    case, the dtypes and norms with the others)."""
    from ddtree.kernels.gdn_tree import tree_gdn_fused, tree_runs

    gen = torch.Generator().manual_seed(seed)
    batch, depth = 2, 3
    logits = torch.randn(batch, depth, 2, generator=gen) * 2
    trees = ddtree.build_tree(logits, budget, chain_seed=chain_seed)
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
    for run_nodes in run_sizes:  # runs of off-chain nodes sharing one walk of the chain
        runs = tree_runs(trees.ancestors, trees.depths, run_nodes)
        got = tree_gdn_fused(
            *inputs, state, trees.ancestors, trees.depths, use_qk_l2norm=l2norm, block_v=16,
            runs=runs,
        )  # fmt: skip
        torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)
    # Straight into token rows of a [T, HV, V] output in the inputs' dtype (vLLM's core
    # attention output): padding slots (-1) and rows of no node left as they were.
    token_rows = torch.randperm(batch * n + 3, generator=gen)[: batch * n].view(batch, n)
    token_rows[:, -2:] = -1
    rows_out = torch.full((batch * n + 3, heads_v, dim_v), 7.0).to(dtype)
    tree_gdn_fused(*inputs, state, trees.ancestors, trees.depths, use_qk_l2norm=l2norm,
                   block_v=16, out=rows_out, token_rows=token_rows)  # fmt: skip
    written = token_rows >= 0
    torch.testing.assert_close(
        rows_out[token_rows[written]].float(),
        want[written].to(dtype).float(),
        atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
    )
    untouched = torch.ones(batch * n + 3, dtype=torch.bool)
    untouched[token_rows[written]] = False
    assert (rows_out[untouched] == 7.0).all()
    if budget > depth:
        assert (trees.parents[:, 1:] < 0).any(), "the case should hold padding slots"
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)
    if chain_seed:
        chain = min(depth, budget)
        assert torch.equal(trees.parents[:, 1 : 1 + chain], torch.arange(chain).expand(batch, -1))

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
    # k, v laid out by path position and g, beta per node (the V2 commit's layout).
    rows, nodes = torch.arange(batch)[:, None], path.clamp(min=0)
    positions = torch.where(path >= 0, torch.arange(path.shape[1]), -1)
    by_position = cache.clone()
    by_position[slots] = state
    k_path, v_path = inputs[1][rows, nodes], inputs[2][rows, nodes]
    replay_path_fused(k_path, v_path, *inputs[3:], by_position, slots, positions,
                      use_qk_l2norm=l2norm, block_v=16, gate_at=nodes)  # fmt: skip
    assert torch.equal(by_position[slots], cache[slots])
    others = [i for i in range(5) if i not in slots.tolist()]
    assert torch.equal(cache[others], before[others])
    _, node_states = tree_gdn(*inputs, state, trees.parents, use_qk_l2norm=l2norm)
    for r, node in enumerate(deepest):
        torch.testing.assert_close(
            cache[slots[r]], node_states[r, node].float(), atol=1e-4, rtol=1e-4
        )


def check_leading_chains() -> None:
    """Trees whose leading chain ends early or is absent: slot 2 a sibling of slot 1, a
    padding tree (every slot its own ancestor at depth 0, a request without drafts), slot 1
    a child of the root but slot 2 its grandchild's sibling. The kernel's per-node replay
    and the root's chain walk must agree with the reference wherever the chain ends."""
    from ddtree.gdn import tree_gdn
    from ddtree.kernels.gdn_tree import tree_gdn_fused, tree_runs
    from ddtree.tree import _ancestry

    gen = torch.Generator().manual_seed(7)
    parents = torch.tensor(
        [
            [-1, 0, 0, 1, 2, 3],  # chain 1 only: slot 2 is a child of the root
            [-1, 0, 1, 2, 1, 4],  # chain 1..3, then a branch off slot 1
            [-1, 0, 1, 0, 3, 4],  # chain 1..2
        ]
    )
    depths = torch.tensor([[0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 2, 3], [0, 1, 2, 1, 2, 3]])
    padding = torch.arange(6)[:, None].expand(6, 4)  # every slot its own ancestor
    ancestors = torch.cat([_ancestry(parents, 3)[0], padding[None]])
    depths = torch.cat([depths, torch.zeros(1, 6, dtype=torch.long)])
    parents = torch.cat([parents, torch.full((1, 6), -1)])
    batch, n, heads, heads_v, dim_k, dim_v = 4, 6, 1, 2, 8, 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    inputs = [rand(batch, n, heads, dim_k), rand(batch, n, heads, dim_k),
              rand(batch, n, heads_v, dim_v), -torch.rand(batch, n, heads_v, generator=gen),
              torch.rand(batch, n, heads_v, generator=gen)]  # fmt: skip
    state = rand(batch, heads_v, dim_v, dim_k) * 0.5
    want, _ = tree_gdn(*inputs, state, parents)
    runs = tree_runs(ancestors, depths, 2)
    assert runs.chain.tolist() == [1, 3, 2, 0]
    # (a chain node's branch point is itself, with no own steps)
    assert runs.branch[:3].tolist() == [[0, 1, 0, 1, 0, 1], [0, 1, 2, 3, 1, 1],
                                        [0, 1, 2, 0, 0, 0]]  # fmt: skip
    assert runs.length[:3].tolist() == [[0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 1, 2],
                                        [0, 0, 0, 1, 2, 3]]  # fmt: skip
    assert runs.order.tolist()[0] == [2, 4, 3, 5, -1, -1]  # by branch point, then slot
    assert runs.order.tolist()[3] == [1, 2, 3, 4, 5, -1]  # padding: from the cached state
    assert runs.branch[3].tolist()[1:] == [-1] * 5 and runs.length[3].tolist()[1:] == [1] * 5
    for run_nodes in (1, 2, 5):
        runs = tree_runs(ancestors, depths, run_nodes)
        got = tree_gdn_fused(*inputs, state, ancestors, depths, block_v=8, runs=runs)
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def check_path_conv(dtype: torch.dtype, seed: int) -> None:
    """The commit's conv (``path_conv_fused``: the conv outputs along each accepted path and
    the conv columns after it, in place) against :func:`ddtree.gdn.path_conv1d`: paths shorter
    and longer than the conv window, a request without a tree (length 0: its columns
    untouched), vLLM's strided conv cache."""
    from ddtree.gdn import path_conv1d
    from ddtree.kernels.gdn_tree import path_conv_fused

    gen = torch.Generator().manual_seed(seed)
    batch, n, channels, width, blocks = 4, 9, 40, 4, 7
    x = torch.randn(batch, n, channels, generator=gen).to(dtype)
    conv = torch.randn(blocks, width - 1 + 2, channels, generator=gen).to(dtype).transpose(1, 2)
    weight = torch.randn(channels, width, generator=gen) * 0.5
    bias = torch.randn(channels, generator=gen) * 0.1
    cells = torch.tensor([3, 0, 5, 1])
    path = torch.tensor([[0, 2, 5, 6, 8, -1], [-1] * 6, [0, 1, -1, -1, -1, -1], [0] + [-1] * 5])
    lengths = (path >= 0).sum(1)  # 5, 0 (no tree), 2, 1
    rows = torch.arange(batch)[:, None]
    for b, activation in ((bias, "silu"), (None, None)):
        state = conv[cells][..., : width - 1].float()
        want, want_state = path_conv1d(x[rows, path.clamp(min=0)], state, lengths, weight, b,
                                       activation)  # fmt: skip
        got_conv = conv.clone()
        got = path_conv_fused(x, got_conv, cells, path, lengths, weight, b, activation,
                              block_c=16)  # fmt: skip
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for r in range(batch):
            n_r = int(lengths[r])
            torch.testing.assert_close(got[r, :n_r].float(), want[r, :n_r], atol=tol, rtol=tol)
            columns = got_conv[cells[r], :, : width - 1]
            if n_r:  # copies of inputs: exact
                assert torch.equal(columns, want_state[r].to(dtype)), r
            else:
                assert torch.equal(columns, conv[cells[r], :, : width - 1]), r
        others = [i for i in range(blocks) if i not in cells.tolist()]
        assert torch.equal(got_conv[others], conv[others])
        assert torch.equal(got_conv[:, :, width - 1 :], conv[:, :, width - 1 :])


def check_stash() -> None:
    """``stash_nodes`` against a row gather and :func:`ddtree.gdn.gdn_gating`: token rows in
    any order, a row used twice (padding slots point at a clamped row), ``a`` / ``b`` as
    strided views (vLLM splits them from one projection), large ``a`` (softplus's linear
    branch)."""
    from ddtree.gdn import gdn_gating
    from ddtree.kernels.gdn_tree import stash_nodes

    gen = torch.Generator().manual_seed(5)
    tokens, channels, heads_v, batch, n = 11, 40, 6, 2, 5
    mixed = torch.randn(tokens, channels, generator=gen).bfloat16()
    ab = torch.randn(tokens, 2 * heads_v, generator=gen).bfloat16() * 4
    ab[3, :heads_v] = 30.0
    b, a = ab[:, :heads_v], ab[:, heads_v:]
    a_log, dt_bias = torch.randn(heads_v, generator=gen), torch.randn(heads_v, generator=gen)
    rows = torch.tensor([[4, 3, 10, 0, 0], [7, 8, 9, 2, 10]])
    x = torch.zeros(batch, n, channels, dtype=torch.bfloat16)
    g, beta = torch.zeros(batch, n, heads_v), torch.zeros(batch, n, heads_v)
    stash_nodes(mixed, a, b, a_log, dt_bias, rows, x, g, beta, block_c=16)
    want_g, want_beta = gdn_gating(a_log, a[rows], b[rows], dt_bias)
    assert torch.equal(x, mixed[rows])
    torch.testing.assert_close(g, want_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, want_beta, atol=1e-6, rtol=1e-6)


def check_conv(dtype: torch.dtype, seed: int) -> None:
    """The tree conv kernel against :func:`ddtree.gdn.tree_conv1d_table` (itself tested against
    the per-path conv): DDTree trees with padding slots, an ancestor table shallower than the
    window for one case, vLLM's conv cache layout (strided, read at each request's slot)."""
    from ddtree.gdn import tree_conv1d_table
    from ddtree.kernels.gdn_tree import tree_conv_fused

    gen = torch.Generator().manual_seed(seed)
    batch, depth, budget, width, channels = 3, 2 + seed, 12, 4, 40
    trees = ddtree.build_tree(torch.randn(batch, depth, 3, generator=gen) * 2, budget)
    x = torch.randn(batch, budget + 1, channels, generator=gen).to(dtype)
    # vLLM's SD layout [S, W-1, C], viewed [S, C, W-1] (strides C and 1).
    cache = torch.randn(6, width - 1, channels, generator=gen).transpose(1, 2)
    slots = torch.tensor([4, 0, 2])
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen)
    for b, activation in ((bias, "silu"), (None, None)):
        want = tree_conv1d_table(x.float(), cache[slots], trees.ancestors, trees.depths, weight,
                                 b, activation)  # fmt: skip
        got = tree_conv_fused(x, cache, slots, trees.ancestors, trees.depths, weight, b,
                              activation, block_c=16)  # fmt: skip
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


if __name__ == "__main__":
    import sys

    part = sys.argv[1] if len(sys.argv) > 1 else None  # run_interpreted's share, None: all
    if part in (None, "1"):  # about half of the time each
        check(torch.float32, True, 0, run_sizes=(1, 3, 8))
        check(torch.bfloat16, True, 2)
        check(torch.bfloat16, True, 4, chain_seed=True, budget=3)  # a chain-sized tree
        check_stash()
    if part in (None, "2"):
        check_conv(torch.float32, 0)
        check_conv(torch.bfloat16, 1)
        check(torch.float32, False, 1)
        check(torch.float32, True, 3, chain_seed=True)
        check_leading_chains()
        check_path_conv(torch.float32, 0)
        check_path_conv(torch.bfloat16, 1)
    if part not in (None, "1", "2"):
        raise SystemExit(f"unknown part {part!r}")
