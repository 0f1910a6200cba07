"""Gated DeltaNet on draft trees (ddtree.gdn): every node sees exactly its root path's chain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree
from ddtree.gdn import (
    GDNStash,
    ancestor_table,
    chain_gdn,
    check_parents,
    check_path,
    gdn_gating,
    path_conv1d,
    replay_path,
    tree_conv1d,
    tree_conv1d_table,
    tree_gdn,
    tree_gdn_chunked,
)
from ddtree.tree import chain_tree

from helpers import KINDS, make_logits

F64 = torch.float64


@st.composite
def trees(draw) -> torch.Tensor:
    """parents long [b, N]: a DDTree built from random logits (padding when the budget exceeds
    the lattice), or a random parent array with padding slots anywhere."""
    seed = draw(st.integers(0, 2**31 - 1))
    batch = draw(st.integers(1, 3))
    if draw(st.booleans()):
        depth, vocab = draw(st.integers(1, 5)), draw(st.integers(2, 5))
        budget = draw(st.integers(0, 24))
        logits = make_logits(draw(st.sampled_from(KINDS)), batch, depth, vocab, seed)
        return ddtree.build_tree(logits, budget).parents
    n_slots = draw(st.integers(1, 12))
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, n_slots), -1, dtype=torch.long)
    for row in range(batch):
        real = [0]
        for slot in range(1, n_slots):
            if float(torch.rand((), generator=gen)) < 0.2:
                continue  # padding
            parents[row, slot] = real[int(torch.randint(len(real), (), generator=gen))]
            real.append(slot)
    return parents


def root_path(parents: torch.Tensor, row: int, slot: int) -> list[int]:
    path = [slot]
    while int(parents[row, path[-1]]) >= 0:
        path.append(int(parents[row, path[-1]]))
    return path[::-1]


def gdn_inputs(parents: torch.Tensor, seed: int, heads: int, group: int, dim_k: int, dim_v: int):
    """Random float64 (q, k, v, g, beta, state) for every slot of ``parents``."""
    gen = torch.Generator().manual_seed(seed)
    batch, n_slots = parents.shape
    heads_v = heads * group

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q, k = randn(batch, n_slots, heads, dim_k), randn(batch, n_slots, heads, dim_k)
    v = randn(batch, n_slots, heads_v, dim_v)
    g = -2 * torch.rand(batch, n_slots, heads_v, generator=gen, dtype=F64)  # decay in (e^-2, 1]
    beta = torch.rand(batch, n_slots, heads_v, generator=gen, dtype=F64)
    state = randn(batch, heads_v, dim_v, dim_k)
    return q, k, v, g, beta, state


gdn_shapes = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(1, 2),  # key heads H
    st.integers(1, 3),  # value heads per key head
    st.integers(1, 5),  # K
    st.integers(1, 4),  # V
    st.booleans(),  # use_qk_l2norm
)


@settings(max_examples=40, deadline=None)
@given(trees(), gdn_shapes)
def test_tree_gdn_is_the_chain_along_each_root_path(parents, shape):
    seed, heads, group, dim_k, dim_v, l2norm = shape
    q, k, v, g, beta, state = gdn_inputs(parents, seed, heads, group, dim_k, dim_v)
    out, node_states = tree_gdn(q, k, v, g, beta, state, parents, use_qk_l2norm=l2norm)
    out_chunked, states_chunked = tree_gdn_chunked(
        q, k, v, g, beta, state, parents, use_qk_l2norm=l2norm
    )
    assert torch.isfinite(out).all()  # padding slots too
    torch.testing.assert_close(out_chunked, out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(states_chunked, node_states, rtol=1e-9, atol=1e-9)
    for row in range(parents.shape[0]):
        for slot in range(parents.shape[1]):
            path = root_path(parents, row, slot)
            chain_out, chain_states = chain_gdn(
                q[row : row + 1, path],
                k[row : row + 1, path],
                v[row : row + 1, path],
                g[row : row + 1, path],
                beta[row : row + 1, path],
                state[row : row + 1],
                use_qk_l2norm=l2norm,
            )
            torch.testing.assert_close(out[row, slot], chain_out[0, -1], rtol=0, atol=1e-12)
            torch.testing.assert_close(
                node_states[row, slot], chain_states[0, -1], rtol=0, atol=1e-12
            )


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), gdn_shapes)
def test_chain_shaped_tree_is_chain_gdn(batch, depth, shape):
    seed, heads, group, dim_k, dim_v, l2norm = shape
    parents = chain_tree(torch.zeros(batch, depth, dtype=torch.long)).parents
    q, k, v, g, beta, state = gdn_inputs(parents, seed, heads, group, dim_k, dim_v)
    chain = chain_gdn(q, k, v, g, beta, state, scale=0.7, use_qk_l2norm=l2norm)
    tree = tree_gdn(q, k, v, g, beta, state, parents, scale=0.7, use_qk_l2norm=l2norm)
    chunked = tree_gdn_chunked(q, k, v, g, beta, state, parents, scale=0.7, use_qk_l2norm=l2norm)
    for got in (tree, chunked):
        torch.testing.assert_close(got[0], chain[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], chain[1], rtol=1e-10, atol=1e-10)


def test_chain_gdn_single_step_by_hand():
    """One head, K = V = 1 with no normalization: every term of the update is visible."""
    s0, gate, strength, key, value, query = 2.0, -0.5, 0.25, 3.0, 1.0, 4.0
    one = torch.ones(1, 1, 1, 1, dtype=F64)
    out, states = chain_gdn(
        one * query,
        one * key,
        one * value,
        torch.full((1, 1, 1), gate, dtype=F64),
        torch.full((1, 1, 1), strength, dtype=F64),
        torch.full((1, 1, 1, 1), s0, dtype=F64),
        scale=1.0,
        use_qk_l2norm=False,
    )
    decayed = s0 * torch.tensor(gate, dtype=F64).exp()
    state = decayed + strength * (value - decayed * key) * key
    assert states.item() == pytest.approx(float(state), abs=1e-15)
    assert out.item() == pytest.approx(float(state) * query, abs=1e-15)


def conv_over_path(x_path, conv_state, weight, bias, activation):
    """Plain causal conv of the last node of a path: ``x_path [T, C]``, ``conv_state [C, W-1]``."""
    width = weight.shape[1]
    history = torch.cat([conv_state, x_path.T], 1)  # [C, W-1+T], newest last
    out = (history[:, -width:] * weight).sum(1) + (0 if bias is None else bias)
    return F.silu(out) if activation else out


conv_shapes = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(2, 5),  # width W
    st.integers(1, 6),  # channels C
    st.booleans(),  # bias
    st.sampled_from([None, "silu", "swish"]),
)


def conv_inputs(parents, seed, width, channels, with_bias):
    gen = torch.Generator().manual_seed(seed)
    batch, n_slots = parents.shape
    x = torch.randn(batch, n_slots, channels, generator=gen, dtype=F64)
    conv_state = torch.randn(batch, channels, width - 1, generator=gen, dtype=F64)
    weight = torch.randn(channels, width, generator=gen, dtype=F64)
    bias = torch.randn(channels, generator=gen, dtype=F64) if with_bias else None
    return x, conv_state, weight, bias


@settings(max_examples=40, deadline=None)
@given(trees(), conv_shapes)
def test_tree_conv1d_is_the_causal_conv_along_each_root_path(parents, shape):
    seed, width, channels, with_bias, activation = shape
    x, conv_state, weight, bias = conv_inputs(parents, seed, width, channels, with_bias)
    out = tree_conv1d(x, conv_state, parents, weight, bias, activation)
    for row in range(parents.shape[0]):
        for slot in range(parents.shape[1]):
            path = root_path(parents, row, slot)
            want = conv_over_path(x[row, path], conv_state[row], weight, bias, activation)
            torch.testing.assert_close(out[row, slot], want, rtol=0, atol=1e-12)


def engine_tables(parents: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What an engine keeps instead of ``parents``: k-th ancestors ``[b, N, depth+1]``
    saturating at the root (padding: itself) and depths ``[b, N]``."""
    above = ancestor_table(parents, parents.shape[1])  # -1 past the root
    depths = (above >= 0).sum(-1) - 1
    steps = torch.arange(depth + 1).clamp(max=depths[..., None])  # [b, N, depth+1]
    return above.gather(2, steps), depths


@settings(max_examples=40, deadline=None)
@given(trees(), conv_shapes, st.integers(0, 3))
def test_tree_conv1d_from_engine_tables_equals_tree_conv1d(parents, shape, extra_depth):
    """The fixed-shape conv of the V2 engine (ancestor table + depths) is :func:`tree_conv1d`,
    whether the table is deeper or shallower than the conv window."""
    seed, width, channels, with_bias, activation = shape
    x, conv_state, weight, bias = conv_inputs(parents, seed, width, channels, with_bias)
    depth = int((ancestor_table(parents, parents.shape[1]) >= 0).sum(-1).max()) - 1
    ancestors, depths = engine_tables(parents, depth + extra_depth)
    want = tree_conv1d(x, conv_state, parents, weight, bias, activation)
    got = tree_conv1d_table(x, conv_state, ancestors, depths, weight, bias, activation)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(trees(), conv_shapes, st.integers(0, 2**31 - 1))
def test_path_conv1d_is_the_tree_conv_on_the_path(parents, shape, path_seed):
    """The commit's conv along an accepted path: the tree verify's outputs at the path's
    nodes, and the conv state :func:`replay_path` leaves."""
    seed, width, channels, with_bias, activation = shape
    x, conv_state, weight, bias = conv_inputs(parents, seed, width, channels, with_bias)
    batch, n_slots = parents.shape
    gen = torch.Generator().manual_seed(path_seed)
    real = [[s for s in range(n_slots) if s == 0 or parents[r, s] >= 0] for r in range(batch)]
    paths = [
        root_path(parents, r, real[r][int(torch.randint(len(real[r]), (), generator=gen))])
        for r in range(batch)
    ]
    steps = max(map(len, paths)) + 1
    path = torch.tensor([p + [-1] * (steps - len(p)) for p in paths])
    lengths = (path >= 0).sum(1)
    rows = torch.arange(batch)[:, None]
    out, new_conv = path_conv1d(x[rows, path.clamp(min=0)], conv_state, lengths, weight, bias,
                                activation)  # fmt: skip
    tree_out = tree_conv1d(x, conv_state, parents, weight, bias, activation)
    for row, accepted in enumerate(paths):
        torch.testing.assert_close(out[row, : len(accepted)], tree_out[row, accepted], rtol=0,
                                   atol=1e-12)  # fmt: skip
        history = torch.cat([conv_state[row], x[row, accepted].T], 1)
        torch.testing.assert_close(new_conv[row], history[:, -(width - 1) :], rtol=0, atol=0)


@settings(max_examples=15, deadline=None)
@given(trees(), conv_shapes)
def test_tree_conv1d_matches_vllm_causal_conv1d_update_torch(parents, shape):
    """vLLM's torch twin of ``causal_conv1d_update``, run over each node's root path."""
    conv = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")
    seed, width, channels, with_bias, activation = shape
    x, conv_state, weight, bias = conv_inputs(parents, seed, width, channels, with_bias)
    out = tree_conv1d(x, conv_state, parents, weight, bias, activation)
    for row in range(parents.shape[0]):
        for slot in range(parents.shape[1]):
            path = root_path(parents, row, slot)
            cached = conv_state[row : row + 1].clone()  # updated in place by vLLM
            want = conv.causal_conv1d_update_torch(
                x[row : row + 1, path].transpose(1, 2), cached, weight, bias, activation
            )  # [1, C, T]
            torch.testing.assert_close(out[row, slot], want[0, :, -1], rtol=0, atol=1e-12)
            # vLLM's conv state after a chain: its last W-1 inputs (what replay_path keeps).
            history = torch.cat([conv_state[row], x[row, path].T], 1)
            torch.testing.assert_close(cached[0], history[:, -(width - 1) :], rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(trees(), gdn_shapes, st.integers(2, 5), st.integers(0, 2**31 - 1))
def test_replay_path_commits_the_accepted_chain(parents, shape, width, path_seed):
    seed, heads, group, dim_k, dim_v, l2norm = shape
    q, k, v, g, beta, state = gdn_inputs(parents, seed, heads, group, dim_k, dim_v)
    x, conv_state, _, _ = conv_inputs(parents, seed + 1, width, 3, False)
    batch, n_slots = parents.shape
    gen = torch.Generator().manual_seed(path_seed)
    real = [[s for s in range(n_slots) if s == 0 or parents[r, s] >= 0] for r in range(batch)]
    picks = [int(torch.randint(len(slots), (), generator=gen)) for slots in real]
    paths = [root_path(parents, r, real[r][pick]) for r, pick in enumerate(picks)]
    width_l = max(map(len, paths)) + int(torch.randint(2, (1,), generator=gen))  # extra padding
    path = torch.tensor([p + [-1] * (width_l - len(p)) for p in paths])
    stash = GDNStash(k=k, v=v, g=g, beta=beta, conv_input=x, parents=parents)
    new_state, new_conv = replay_path(stash, path, state, conv_state, use_qk_l2norm=l2norm)
    _, node_states = tree_gdn(q, k, v, g, beta, state, parents, use_qk_l2norm=l2norm)
    for row, accepted in enumerate(paths):
        _, chain_states = chain_gdn(
            q[row : row + 1, accepted],
            k[row : row + 1, accepted],
            v[row : row + 1, accepted],
            g[row : row + 1, accepted],
            beta[row : row + 1, accepted],
            state[row : row + 1],
            use_qk_l2norm=l2norm,
        )
        torch.testing.assert_close(new_state[row], chain_states[0, -1], rtol=0, atol=1e-12)
        torch.testing.assert_close(new_state[row], node_states[row, accepted[-1]], rtol=0, atol=0)
        history = torch.cat([conv_state[row], x[row, accepted].T], 1)
        torch.testing.assert_close(new_conv[row], history[:, -(width - 1) :], rtol=0, atol=0)


def test_replay_by_hand_root_only_and_two_slots():
    """Root only: one step, conv state shifted by one column; root + slot 2: two columns."""
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    q, k, v, g, beta, state = gdn_inputs(parents, 3, 1, 2, 3, 2)
    x = torch.arange(2 * 3 * 2, dtype=F64).view(2, 3, 2)  # [b, N, C]
    conv_state = -torch.arange(2 * 2 * 3, dtype=F64).view(2, 2, 3) - 1  # [b, C, W-1 = 3]
    stash = GDNStash(k=k, v=v, g=g, beta=beta, conv_input=x, parents=parents)
    path = torch.tensor([[0, -1], [0, 2]])
    new_state, new_conv = replay_path(stash, path, state, conv_state)
    _, chain_states = chain_gdn(q[:1, :1], k[:1, :1], v[:1, :1], g[:1, :1], beta[:1, :1], state[:1])
    torch.testing.assert_close(new_state[0], chain_states[0, 0], rtol=0, atol=1e-12)
    assert new_conv[0].tolist() == [[-2.0, -3.0, 0.0], [-5.0, -6.0, 1.0]]
    assert new_conv[1].tolist() == [[-9.0, 6.0, 10.0], [-12.0, 7.0, 11.0]]


def test_parents_and_paths_are_validated():
    check_parents(torch.tensor([[-1, 0, -1, 1]]))
    for bad in ([[0, 0]], [[-1, 1]], [[-1, 0, 2]], [[-1, -1, 1]], [[-1, -2]]):
        with pytest.raises(ValueError):
            check_parents(torch.tensor(bad))
    parents = torch.tensor([[-1, 0, 0, 1]])
    assert check_path(torch.tensor([[0, 1, 3, -1]]), parents).tolist() == [3]
    for bad in ([[1, 3]], [[0, 2, 3]], [[0, -1, 1]], [[0, 4]], [[0, 3]]):
        with pytest.raises(ValueError):
            check_path(torch.tensor(bad), parents)


def _vllm_cpu_ops():
    ops = pytest.importorskip("vllm._custom_ops")
    names = (
        "fused_sigmoid_gating_delta_rule_update_spec_cpu",
        "chunk_gated_delta_rule_cpu",
        "fused_gdn_gating_cpu",
    )
    if not all(hasattr(torch.ops._C, name) for name in names):
        pytest.skip("this vLLM build has no CPU GDN kernels")
    return ops


def _bf16_problem(seed: int, tokens: int, heads: int = 2, group: int = 2):
    """bf16 inputs shaped like vLLM's CPU kernels want them (head dims multiples of 32)."""
    gen = torch.Generator().manual_seed(seed)
    dim_k, dim_v, heads_v = 32, 64, heads * group
    bf16 = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(bf16)

    return {
        "q": randn(tokens, heads, dim_k),
        "k": randn(tokens, heads, dim_k),
        "v": randn(tokens, heads_v, dim_v),
        "a": randn(tokens, heads_v, scale=2.0),
        "b": randn(tokens, heads_v, scale=2.0),
        "A_log": torch.randn(heads_v, generator=gen) * 0.5,
        "dt_bias": randn(heads_v),
        "state": torch.randn(heads_v, dim_v, dim_k, generator=gen) * 0.3,  # ours: [HV, V, K]
    }


def test_chain_gdn_matches_vllm_cpu_recurrent_kernel():
    """vLLM's fused recurrent CPU kernel (the spec-decode one: it also writes the state after
    every token) against chain_gdn in float64 on the same bf16 values."""
    ops = _vllm_cpu_ops()
    lengths = (3, 5)
    p = _bf16_problem(0, sum(lengths))
    # vLLM's CPU kernels take the state as [slots, HV, K, V]; slot 0 is the null block.
    pool = torch.zeros(1 + 2 * 6, *p["state"].transpose(-1, -2).shape)
    pool[1] = pool[7] = p["state"].transpose(-1, -2)
    state_slots = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], dtype=torch.int32)
    out = ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        p["A_log"],
        p["dt_bias"],
        p["q"],
        p["k"],
        p["v"],
        p["a"],
        p["b"],
        pool,
        state_slots,
        torch.ones(2, dtype=torch.int32),  # one accepted token: start from column 0
        torch.tensor([0, 3, 8], dtype=torch.int32),
        True,
    )  # [T, HV, V] bf16
    g, beta = gdn_gating(p["A_log"].double(), p["a"].double(), p["b"].double(), p["dt_bias"])
    start = 0
    for seq, length in enumerate(lengths):
        span = slice(start, start + length)
        want_out, want_states = chain_gdn(
            p["q"][None, span].double(),
            p["k"][None, span].double(),
            p["v"][None, span].double(),
            g[None, span],
            beta[None, span],
            p["state"][None].double(),
        )
        torch.testing.assert_close(out[span].double(), want_out[0], rtol=1e-2, atol=2e-3)
        written = pool[state_slots[seq, :length].long()].transpose(-1, -2).double()
        torch.testing.assert_close(written, want_states[0], rtol=1e-5, atol=1e-5)
        start += length


def test_chain_gdn_matches_vllm_cpu_chunk_kernel():
    """vLLM's chunked (prefill) CPU kernel: same recurrence, computed in blocks (with bf16
    products inside, hence the looser tolerance)."""
    ops = _vllm_cpu_ops()
    tokens = 70  # more than one 64-token chunk
    p = _bf16_problem(1, tokens)
    g, beta = ops.fused_gdn_gating_cpu(p["A_log"], p["a"], p["b"], p["dt_bias"])  # [1, T, HV]
    out, final = ops.chunk_gated_delta_rule_cpu(
        p["q"][None],
        p["k"][None],
        p["v"][None],
        g,
        beta,
        p["state"].transpose(-1, -2)[None].contiguous(),
        True,
        torch.tensor([0, tokens], dtype=torch.int32),
        False,
        True,
    )
    want_out, want_states = chain_gdn(
        p["q"][None].double(),
        p["k"][None].double(),
        p["v"][None].double(),
        g.double(),
        beta.double(),
        p["state"][None].double(),
    )
    torch.testing.assert_close(out.double(), want_out, rtol=2e-2, atol=5e-3)
    torch.testing.assert_close(
        final.transpose(-1, -2).double(), want_states[:, -1], rtol=2e-2, atol=1e-2
    )


def test_gdn_gating_matches_vllm_cpu():
    ops = _vllm_cpu_ops()
    p = _bf16_problem(2, 16)
    a = p["a"].clone()
    a[0] = 30.0  # past the softplus threshold: softplus(x) = x there
    g, beta = ops.fused_gdn_gating_cpu(p["A_log"], a, p["b"], p["dt_bias"])
    want_g, want_beta = gdn_gating(p["A_log"].double(), a.double(), p["b"].double(), p["dt_bias"])
    torch.testing.assert_close(g[0].double(), want_g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta[0].double(), want_beta, rtol=1e-2, atol=0)  # bf16 out
