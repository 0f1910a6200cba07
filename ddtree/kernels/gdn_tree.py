"""Gated DeltaNet on a draft tree, the exact path-flattened recurrence (one Triton launch).

Torch reference: :func:`ddtree.gdn.tree_gdn` (same math as vLLM's recurrent kernels: q/k L2
norm in the kernel, ``S = exp(g) S``, ``S += beta (v - S k) k^T``, ``o = S q``). Each program
takes one (node, value head, V-tile): it loads the request's cached state tile ``[BV, K]`` and
replays the node's root path (root first, ``depth + 1`` tokens, read from the k-th-ancestor
table) in registers, then writes the node's output.

The tree's leading chain (slots 1..m, slot i at depth i the child of slot i - 1: the forced
chain of a chain-seeded tree, or all of a chain-sized one) is walked once, by the root's
program, which writes each of those nodes' outputs on the way; their own programs return. A
chain of 1 + D nodes thus costs D + 1 state updates, as vLLM's chain kernel does, instead of
(D + 1)(D + 2) / 2: the step of a chain-sized tree at large batches, where every SM is busy.

No per-node state is stored: the commit replays the accepted path the same way, into the
request's own state slot (:func:`replay_path_fused`; torch reference
:func:`ddtree.gdn.replay_path`). Off-chain nodes still cost ``depth + 1`` updates each; a
tree-masked chunked form is the faster next step for wide trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ddtree.gdn import check_activation
from ddtree.kernels._common import next_pow2
from ddtree.kernels.build import check_device


@triton.jit
def _l2norm(x, eps, L2NORM: tl.constexpr):
    """``x`` in float32, divided by sqrt(sum(x^2) + eps) when ``L2NORM`` (vLLM's in-kernel
    q/k norm)."""
    x = x.to(tl.float32)
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, 0) + eps)
    return x


@triton.jit
def _delta_rule_step(state, k_row, v_row, g_at, beta_at, offs_k, mask_k, offs_v, mask_v, eps,
                     L2NORM: tl.constexpr):  # fmt: skip
    """One token of the gated delta rule on a state tile ``[BV, BK]``: ``S = exp(g) S``, ``S +=
    beta (v - S k) k^T``; the token's k / v rows and its g / beta cells are given by address."""
    kk = _l2norm(tl.load(k_row + offs_k, mask=mask_k, other=0.0), eps, L2NORM)
    vv = tl.load(v_row + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    state = state * tl.exp(tl.load(g_at).to(tl.float32))
    delta = tl.load(beta_at).to(tl.float32) * (vv - tl.sum(state * kk[None, :], 1))  # [BV]
    return state + delta[:, None] * kk[None, :]


@triton.jit
def _store_output(out_ptr, rows_ptr, req, node, value, offs_v, mask_v, hv, s_wb, s_ob, s_on,
                  s_oh, TOKEN_ROWS: tl.constexpr):  # fmt: skip
    """A node's output: at ``out[req, node]``, or with ``TOKEN_ROWS`` at the token row
    ``rows[req, node]`` of ``out [T, HV, V]`` (-1: none) in ``out``'s dtype."""
    if TOKEN_ROWS:
        row = tl.load(rows_ptr + req * s_wb + node).to(tl.int64)
        at = out_ptr + tl.maximum(row, 0) * s_on + hv * s_oh + offs_v
        tl.store(at, value.to(out_ptr.dtype.element_ty), mask=mask_v & (row >= 0))
    else:
        tl.store(out_ptr + req * s_ob + node * s_on + hv * s_oh + offs_v, value, mask=mask_v)


@dataclass
class TreeRuns:
    """How :func:`tree_gdn_fused` splits a batch of trees over its programs (fixed shapes).

    A tree's leading chain (slots 1..m, slot i at depth i the child of slot i - 1: a
    chain-seeded tree's forced chain) is walked once, by one program per request. Every other
    node branches off that chain at its deepest chain ancestor ``b`` and then has ``L`` nodes of
    its own (itself included); the off-chain nodes, sorted by ``b``, are cut into runs of
    ``run_nodes``. A run's program walks the chain forward once for all its nodes and
    replays each node's own ``L`` steps from a copy: ``max b + 1 + sum L`` state updates per
    run instead of ``sum (depth + 1)``.
    """

    chain: torch.Tensor  # int32 [b]: m, the leading chain's length
    order: torch.Tensor  # int32 [b, N]: off-chain slots sorted by branch point, then -1
    branch: torch.Tensor  # int32 [b, N]: b, the branch point's slot (= its depth); -1: none
    length: torch.Tensor  # int32 [b, N]: L, the node's own steps after its branch point
    run_nodes: int

    @property
    def num_runs(self) -> int:
        return -(-(self.order.shape[1] - 1) // self.run_nodes)  # the root is never off-chain


def tree_runs(ancestors: torch.Tensor, depths: torch.Tensor, run_nodes: int) -> TreeRuns:
    """:class:`TreeRuns` of trees given by ``ancestors [b, N, D+1]`` (k-th ancestor, saturating
    at the root; a padding slot is its own ancestor) and ``depths [b, N]`` (padding: 0). A
    padding slot never reaches the chain: it starts from the cached state (``b = -1``) and
    replays its own token (``L = depth + 1``), as :func:`ddtree.gdn.tree_gdn` treats it."""
    if run_nodes < 1:
        raise ValueError(f"run_nodes must be >= 1, got {run_nodes}")
    batch, n_slots, levels = ancestors.shape
    ancestors, depths = ancestors.long(), depths.long()
    step = torch.arange(1, min(levels - 1, n_slots - 1) + 1, device=ancestors.device)
    links = (depths[:, step] == step) & (ancestors[:, step, 1] == step - 1)  # [b, <= D]
    chain = links.long().cumprod(1).sum(1)  # [b]
    slot = torch.arange(n_slots, device=ancestors.device)
    on_chain = slot <= chain[:, None]  # [b, N]
    reaches = ancestors <= chain[:, None, None]  # [b, N, D+1]: k-th ancestor on the chain
    first = reaches.int().argmax(2)  # [b, N]: the first such k (0 where none)
    found = reaches.any(2)
    length = torch.where(found, first, depths + 1)
    branch = torch.where(found, ancestors.gather(2, first[..., None])[..., 0], -1)
    big = levels + 1  # after every branch point: the chain's own slots, sorted last
    key = torch.where(on_chain, big, branch + 1)
    sorted_key, order = torch.sort(key, dim=1, stable=True)
    order = torch.where(sorted_key < big, order, -1)
    return TreeRuns(chain.int(), order.int(), branch.int(), length.int(), run_nodes)


def default_run_nodes(batch: int, n_slots: int, programs_per_node: int) -> int:
    """Nodes per run: 1 (every node its own program, the most parallel) until the grid holds
    ~32k programs, then up to 8 (fewer chain walks where all SMs are busy anyway)."""
    run = 1
    while run < 8 and batch * n_slots * programs_per_node >= 32768 * 2 * run:
        run *= 2
    return run


@triton.jit
def _tree_gdn_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, ancestors_ptr,
    chain_ptr, order_ptr, branch_ptr, length_ptr,
    out_ptr, rows_ptr, n_slots, n_runs, run_nodes, ratio, dim_v, scale, eps,
    s_qb, s_qn, s_qh, s_kb, s_kn, s_kh, s_vb, s_vn, s_vh, s_gb, s_gn,
    s_sb, s_sh, s_sv, s_ab, s_an, s_rb, s_wb, s_ob, s_on, s_oh,
    K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
    SLOTS: tl.constexpr, TOKEN_ROWS: tl.constexpr,
):  # fmt: skip
    """Program (request, run 0: the leading chain / run r: off-chain nodes of run r - 1)."""
    pid = tl.program_id(0)
    hv = tl.program_id(1)
    req = pid // (n_runs + 1)
    run = pid % (n_runs + 1)
    first = (run - 1) * run_nodes
    if run > 0:
        if tl.load(order_ptr + req * s_rb + first) < 0:
            return  # past this request's off-chain nodes
    h = hv // ratio
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < dim_v
    tile = mask_v[:, None] & mask_k[None, :]
    cell = req
    if SLOTS:  # the request's state lives in a cache slot
        cell = tl.load(slots_ptr + req).to(tl.int64)
    chain = tl.load(
        state_ptr + cell * s_sb + hv * s_sh + offs_v[:, None] * s_sv + offs_k[None, :],
        mask=tile,
        other=0.0,
    ).to(tl.float32)  # [BV, BK]: the state after chain slot `walked`
    k_at = k_ptr + req * s_kb + h * s_kh
    v_at = v_ptr + req * s_vb + hv * s_vh
    g_at = g_ptr + req * s_gb + hv
    b_at = beta_ptr + req * s_gb + hv
    q_at = q_ptr + req * s_qb + h * s_qh
    if run == 0:  # the leading chain: every chain node's output on the way
        for at in range(0, tl.load(chain_ptr + req) + 1):
            chain = _delta_rule_step(chain, k_at + at * s_kn, v_at + at * s_vn, g_at + at * s_gn,
                                     b_at + at * s_gn, offs_k, mask_k, offs_v, mask_v, eps,
                                     L2NORM)  # fmt: skip
            qq = _l2norm(tl.load(q_at + at * s_qn + offs_k, mask=mask_k, other=0.0), eps, L2NORM)
            _store_output(out_ptr, rows_ptr, req, at, tl.sum(chain * (qq * scale)[None, :], 1),
                          offs_v, mask_v, hv, s_wb, s_ob, s_on, s_oh, TOKEN_ROWS)  # fmt: skip
    else:
        walked = -1  # before the root
        for i in range(0, run_nodes):
            node = tl.load(order_ptr + req * s_rb + first + i, mask=first + i < n_slots, other=-1)
            if node >= 0:
                branch = tl.load(branch_ptr + req * s_rb + node)
                for at in range(walked + 1, branch + 1):  # the chain forward to the branch
                    chain = _delta_rule_step(chain, k_at + at * s_kn, v_at + at * s_vn,
                                             g_at + at * s_gn, b_at + at * s_gn, offs_k,
                                             mask_k, offs_v, mask_v, eps, L2NORM)  # fmt: skip
                walked = tl.maximum(walked, branch)
                own = tl.load(length_ptr + req * s_rb + node)
                state = chain
                for j in range(0, own):  # the node's own path, its first step first
                    up = tl.load(ancestors_ptr + req * s_ab + node * s_an + own - 1 - j)
                    state = _delta_rule_step(state, k_at + up * s_kn, v_at + up * s_vn,
                                             g_at + up * s_gn, b_at + up * s_gn, offs_k,
                                             mask_k, offs_v, mask_v, eps, L2NORM)  # fmt: skip
                qq = _l2norm(tl.load(q_at + node * s_qn + offs_k, mask=mask_k, other=0.0), eps,
                             L2NORM)  # fmt: skip
                _store_output(out_ptr, rows_ptr, req, node,
                              tl.sum(state * (qq * scale)[None, :], 1), offs_v, mask_v, hv,
                              s_wb, s_ob, s_on, s_oh, TOKEN_ROWS)  # fmt: skip


def tree_gdn_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    l2norm_eps: float = 1e-6,
    out: torch.Tensor | None = None,
    block_v: int = 32,
    state_slots: torch.Tensor | None = None,
    runs: TreeRuns | None = None,
    num_warps: int = 4,
    token_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every node's GDN output ``[b, N, HV, V]`` float32: its root path's recurrence from the
    request's cached ``state [b, HV, V, K]`` (or, with ``state_slots [b]``, from
    ``state[state_slots[r]]`` of a cache ``[S, HV, V, K]``, read only).

    ``q, k [b, N, H, K]``, ``v [b, N, HV, V]``, ``g, beta [b, N, HV]`` (log-decay, write
    strength), ``ancestors [b, N, D + 1]`` (k-th ancestor, saturating at the root; padding
    slots point at themselves) and ``depths [b, N]`` of :class:`ddtree.tree.DraftTree`; padding
    slots (depth 0) start from the cached state, as in :func:`ddtree.gdn.tree_gdn`. ``runs``:
    :func:`tree_runs` of these trees (made here when None; an engine makes it once per step
    for all its layers). With ``token_rows [b, N]`` (each node's row of ``out``, -1: none)
    the outputs go straight into the given ``out [T, HV, V]`` (e.g. vLLM's core attention
    output, in its dtype) and other rows are left as they are.
    """
    check_device(q, k, v, g, beta, state, ancestors, depths)
    batch, n_slots, heads, dim_k = k.shape
    heads_v, dim_v = v.shape[2], v.shape[3]
    if heads_v % heads:
        raise ValueError(f"value heads ({heads_v}) must be a multiple of key heads ({heads})")
    states = batch if state_slots is None else state.shape[0]
    if tuple(state.shape) != (states, heads_v, dim_v, dim_k):
        raise ValueError(f"state must be [b or S, HV, V, K], got {list(state.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        if t.stride(-1) != 1:
            raise ValueError(f"tree_gdn_fused: {name} must have a contiguous last dim")
    g, beta, ancestors = g.contiguous(), beta.contiguous(), ancestors.contiguous()
    block_v = min(block_v, next_pow2(dim_v))
    tiles = triton.cdiv(dim_v, block_v)
    if runs is None:
        runs = tree_runs(ancestors, depths, default_run_nodes(batch, n_slots, heads_v * tiles))
    if tuple(runs.order.shape) != (batch, n_slots):
        raise ValueError(f"runs are for trees {list(runs.order.shape)}, not {[batch, n_slots]}")
    if token_rows is not None:
        if out is None or out.dim() != 3 or out.stride(-1) != 1:
            raise ValueError("tree_gdn_fused: token_rows needs out [T, HV, V], last dim contiguous")
        if tuple(token_rows.shape) != (batch, n_slots):
            raise ValueError(f"token_rows must be [{batch}, {n_slots}]")
        token_rows = token_rows.contiguous()
        strides = (0, out.stride(0), out.stride(1))  # (request, node -> token row, head)
    else:
        if out is None:
            out = torch.empty(batch, n_slots, heads_v, dim_v, dtype=torch.float32, device=v.device)
        strides = (out.stride(0), out.stride(1), out.stride(2))
    grid = (batch * (runs.num_runs + 1), heads_v, tiles)
    _tree_gdn_kernel[grid](
        q, k, v, g, beta, state, state if state_slots is None else state_slots, ancestors,
        runs.chain, runs.order, runs.branch, runs.length, out,
        runs.order if token_rows is None else token_rows,
        n_slots, runs.num_runs, runs.run_nodes, heads_v // heads, dim_v,
        dim_k**-0.5 if scale is None else scale, l2norm_eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        ancestors.stride(0), ancestors.stride(1), runs.order.stride(0),
        0 if token_rows is None else token_rows.stride(0), *strides,
        K=dim_k, BK=next_pow2(dim_k), BV=block_v, L2NORM=use_qk_l2norm,
        SLOTS=state_slots is not None, TOKEN_ROWS=token_rows is not None, num_warps=num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _replay_path_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, path_ptr, gate_ptr,
    path_len, ratio, dim_v, eps,
    s_kb, s_kn, s_kh, s_vb, s_vn, s_vh, s_gb, s_gn, s_ss, s_sh, s_sv, s_pb, s_ab,
    K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
    GATE_AT: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // ratio
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < dim_v
    tile = mask_v[:, None] & mask_k[None, :]
    cell = tl.load(slots_ptr + req).to(tl.int64)  # the request's state slot in the cache
    where = state_ptr + cell * s_ss + hv * s_sh + offs_v[:, None] * s_sv + offs_k[None, :]
    state = tl.load(where, mask=tile, other=0.0).to(tl.float32)
    for t in range(0, path_len):
        at = tl.load(path_ptr + req * s_pb + t)
        if at >= 0:  # the accepted path, then -1 padding
            gate = at
            if GATE_AT:  # g and beta at other rows than k and v
                gate = tl.load(gate_ptr + req * s_ab + t)
            gb = req * s_gb + gate * s_gn + hv
            state = _delta_rule_step(state, k_ptr + req * s_kb + at * s_kn + h * s_kh,
                                     v_ptr + req * s_vb + at * s_vn + hv * s_vh, g_ptr + gb,
                                     beta_ptr + gb, offs_k, mask_k, offs_v, mask_v, eps,
                                     L2NORM)  # fmt: skip
    tl.store(where, state.to(state_ptr.dtype.element_ty), mask=tile)


def replay_path_fused(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    path: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
    l2norm_eps: float = 1e-6,
    block_v: int = 32,
    gate_at: torch.Tensor | None = None,
) -> None:
    """Commit accepted paths in place: ``state[state_slots[r]]`` (a cache ``[S, HV, V, K]``)
    becomes the state after request r's path, as a chain over its tokens would leave it.

    ``k [b, N, H, K]``, ``v [b, N, HV, V]``, ``g, beta [b, N, HV]``: the tree verify's inputs
    per node; ``path`` long ``[b, L]``: accepted slots from the root (the root included), then
    -1. With ``gate_at [b, L]``, step t reads ``g`` and ``beta`` at row ``gate_at[r, t]``
    instead of ``path[r, t]`` (k and v along the path, g and beta still per node). The
    recurrence of :func:`ddtree.gdn.replay_path` (its conv-window part is a gather)."""
    check_device(k, v, g, beta, state, state_slots, path)
    batch, _, heads, dim_k = k.shape
    heads_v, dim_v = v.shape[2], v.shape[3]
    if tuple(state.shape[1:]) != (heads_v, dim_v, dim_k) or state.stride(-1) != 1:
        raise ValueError(f"state must be a contiguous [S, HV, V, K] cache, got {list(state.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"replay_path_fused: {name} must have a contiguous last dim")
    g, beta, path = g.contiguous(), beta.contiguous(), path.contiguous()
    if gate_at is not None:
        if gate_at.shape != path.shape:
            raise ValueError(f"gate_at {list(gate_at.shape)} must be path's {list(path.shape)}")
        gate_at = gate_at.contiguous()
    block_v = min(block_v, next_pow2(dim_v))
    grid = (batch, heads_v, triton.cdiv(dim_v, block_v))
    _replay_path_kernel[grid](
        k, v, g, beta, state, state_slots, path, path if gate_at is None else gate_at,
        path.shape[1], heads_v // heads, dim_v, l2norm_eps,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), state.stride(0), state.stride(1), state.stride(2),
        path.stride(0), path.stride(0) if gate_at is None else gate_at.stride(0),
        K=dim_k, BK=next_pow2(dim_k), BV=block_v, L2NORM=use_qk_l2norm,
        GATE_AT=gate_at is not None,
    )  # fmt: skip


@triton.jit
def _stash_kernel(
    mixed_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, rows_ptr, x_ptr, g_ptr, beta_ptr,
    channels, heads_v, s_mt, s_at, s_bt, s_xn, s_gn,
    BC: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    node = tl.program_id(0)  # flat (request, slot)
    part = tl.program_id(1)
    row = tl.load(rows_ptr + node).to(tl.int64)  # the node's token row
    offs = part * BC + tl.arange(0, BC)
    mask = offs < channels
    tl.store(x_ptr + node * s_xn + offs, tl.load(mixed_ptr + row * s_mt + offs, mask=mask),
             mask=mask)  # fmt: skip
    if part == 0:  # g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), in float32
        heads = tl.arange(0, BH)
        inside = heads < heads_v
        x = tl.load(a_ptr + row * s_at + heads, mask=inside, other=0.0).to(tl.float32)
        x += tl.load(dt_bias_ptr + heads, mask=inside, other=0.0).to(tl.float32)
        softplus = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)
        a_log = tl.load(a_log_ptr + heads, mask=inside, other=0.0).to(tl.float32)
        tl.store(g_ptr + node * s_gn + heads, -tl.exp(a_log) * softplus, mask=inside)
        b = tl.load(b_ptr + row * s_bt + heads, mask=inside, other=0.0).to(tl.float32)
        tl.store(beta_ptr + node * s_gn + heads, 1.0 / (1.0 + tl.exp(-b)), mask=inside)


def stash_nodes(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    rows: torch.Tensor,
    conv_input: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    block_c: int = 1024,
) -> None:
    """A tree verify's per-node stash in one launch: for each node (``rows [b, N]``, its token
    row) its conv input row of ``mixed_qkv [T, C]`` into ``conv_input [b, N, C]`` and its
    gating into ``g, beta [b, N, HV]`` float32 (``g = -exp(A_log) softplus(a + dt_bias)``,
    ``beta = sigmoid(b)`` from ``a, b [T, HV]``). Torch reference:
    :func:`ddtree.gdn.gdn_gating` and a row gather."""
    check_device(mixed_qkv, a, b, a_log, dt_bias, rows, conv_input, g, beta)
    batch, n_slots, channels = conv_input.shape
    heads_v = g.shape[-1]
    for name, t in (("mixed_qkv", mixed_qkv), ("a", a), ("b", b), ("conv_input", conv_input)):
        if t.stride(-1) != 1:
            raise ValueError(f"stash_nodes: {name} needs a contiguous last dim")
    if not (g.is_contiguous() and beta.is_contiguous() and conv_input.is_contiguous()):
        raise ValueError("stash_nodes: conv_input, g and beta must be contiguous")
    rows = rows.contiguous()
    block_c = min(block_c, next_pow2(channels))
    _stash_kernel[(batch * n_slots, triton.cdiv(channels, block_c))](
        mixed_qkv, a, b, a_log, dt_bias, rows, conv_input, g, beta, channels, heads_v,
        mixed_qkv.stride(0), a.stride(0), b.stride(0), conv_input.stride(1), g.stride(1),
        BC=block_c, BH=next_pow2(heads_v),
    )  # fmt: skip


@triton.jit
def _conv_tap(acc, xv, cv, weight_ptr, offs, mask, j, W: tl.constexpr):
    """``acc`` plus lag ``j``'s input (``xv`` from a node, or ``cv`` from a cached column: the
    other is masked to 0) times its weight, in float32."""
    weight = tl.load(weight_ptr + offs * W + (W - 1 - j), mask=mask, other=0.0)
    return acc + (xv.to(tl.float32) + cv.to(tl.float32)) * weight.to(tl.float32)


@triton.jit
def _conv_finish(acc, bias_ptr, offs, mask, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The conv's bias and activation on its float32 sum."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _path_input(x_req, columns, path, p, offs, mask, s_xn, s_ct, W: tl.constexpr):
    """Input ``p`` of (cached columns, path) as ``(xv, cv)``: path node p's conv input when
    p >= 0, else cached column W - 1 + p (the other masked to 0)."""
    node = tl.load(path + tl.maximum(p, 0)).to(tl.int64)
    xv = tl.load(x_req + node * s_xn + offs, mask=mask & (p >= 0), other=0.0)
    cv = tl.load(columns + tl.maximum(W - 1 + p, 0) * s_ct, mask=mask & (p < 0), other=0.0)
    return xv, cv


@triton.jit
def _path_conv_kernel(
    x_ptr, conv_ptr, cells_ptr, path_ptr, lengths_ptr, weight_ptr, bias_ptr, out_ptr, channels,
    s_xb, s_xn, s_cs, s_cc, s_ct, s_pb, s_ob, s_ot,
    W: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    length = tl.load(lengths_ptr + req)
    if length == 0:
        return  # no tree this step: its conv columns are not touched
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = offs < channels
    cell = tl.load(cells_ptr + req).to(tl.int64)
    x_req = x_ptr + req * s_xb
    path = path_ptr + req * s_pb
    columns = conv_ptr + cell * s_cs + offs * s_cc
    for t in range(0, length):  # conv outputs along the path, summed as the verify's kernel
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(W):
            xv, cv = _path_input(x_req, columns, path, t - j, offs, mask, s_xn, s_ct, W)
            acc = _conv_tap(acc, xv, cv, weight_ptr, offs, mask, j, W)
        acc = _conv_finish(acc, bias_ptr, offs, mask, HAS_BIAS, SILU)
        tl.store(out_ptr + req * s_ob + t * s_ot + offs, acc.to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    # Then the columns after the path: column i is input length + i - (W - 1), an old column
    # > i or a path node, so rewriting them in increasing order reads no new value.
    for i in tl.static_range(W - 1):
        p = length + i - (W - 1)
        xv, cv = _path_input(x_req, columns, path, p, offs, mask, s_xn, s_ct, W)
        tl.store(columns + i * s_ct, tl.where(p >= 0, xv.to(cv.dtype), cv), mask=mask)


def path_conv_fused(
    conv_input: torch.Tensor,
    conv_cache: torch.Tensor,
    cells: torch.Tensor,
    path: torch.Tensor,
    lengths: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    out: torch.Tensor | None = None,
    block_c: int = 256,
) -> torch.Tensor:
    """The conv along each accepted path, and the conv state after it, in one launch: returns
    the conv outputs ``[b, L, C]`` (rows past ``lengths`` untouched) in ``conv_input``'s dtype
    and rewrites ``conv_cache[cells[r], :, :W-1]`` with the last ``W-1`` inputs of (cached
    columns, path). ``conv_input [b, N, C]``: the verify's per-node conv inputs (last dim
    contiguous); ``conv_cache [S, C, >= W-1]`` any strides, newest column last; ``path [b,
    L]`` accepted slots from the root then -1; ``lengths [b]`` how many (0: the request is left
    alone); ``weight [C, W]``. Torch reference: :func:`ddtree.gdn.path_conv1d`."""
    check_device(conv_input, conv_cache, cells, path, lengths, weight)
    check_activation(activation)
    batch, _, channels = conv_input.shape
    width = weight.shape[1]
    if conv_input.stride(-1) != 1 or tuple(weight.shape) != (channels, width):
        raise ValueError("path_conv_fused: conv_input needs a contiguous last dim, weight [C, W]")
    path, lengths = path.contiguous(), lengths.contiguous()
    weight, cells = weight.contiguous(), cells.contiguous()
    if out is None:
        out = torch.empty(batch, path.shape[1], channels, dtype=conv_input.dtype,
                          device=conv_input.device)  # fmt: skip
    block_c = min(block_c, next_pow2(channels))
    _path_conv_kernel[(batch, triton.cdiv(channels, block_c))](
        conv_input, conv_cache, cells, path, lengths, weight, weight if bias is None else bias,
        out, channels, conv_input.stride(0), conv_input.stride(1), conv_cache.stride(0),
        conv_cache.stride(1), conv_cache.stride(2), path.stride(0), out.stride(0),
        out.stride(1), W=width, BC=block_c, HAS_BIAS=bias is not None,
        SILU=activation is not None,
    )  # fmt: skip
    return out


@triton.jit
def _tree_conv_kernel(
    x_ptr, conv_ptr, slots_ptr, ancestors_ptr, depths_ptr, weight_ptr, bias_ptr, out_ptr,
    n_slots, channels, max_depth,
    s_xb, s_xn, s_cs, s_cc, s_ct, s_ab, s_an, s_db, s_ob, s_on,
    W: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    node = tl.program_id(0)
    req = node // n_slots
    slot = node % n_slots
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = offs < channels
    depth = tl.load(depths_ptr + req * s_db + slot)
    cell = tl.load(slots_ptr + req).to(tl.int64)
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(W):  # lag j: the j-th ancestor, or a cached column past the root
        on_path = j <= depth
        at = tl.load(ancestors_ptr + req * s_ab + slot * s_an + tl.minimum(j, max_depth))
        xv = tl.load(x_ptr + req * s_xb + at * s_xn + offs, mask=mask & on_path, other=0.0)
        column = tl.maximum(W - 1 - (j - depth), 0)
        cv = tl.load(conv_ptr + cell * s_cs + offs * s_cc + column * s_ct,
                     mask=mask & (j > depth), other=0.0)  # fmt: skip
        acc = _conv_tap(acc, xv, cv, weight_ptr, offs, mask, j, W)
    acc = _conv_finish(acc, bias_ptr, offs, mask, HAS_BIAS, SILU)
    tl.store(out_ptr + req * s_ob + slot * s_on + offs, acc.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def tree_conv_fused(
    x: torch.Tensor,
    conv_cache: torch.Tensor,
    state_slots: torch.Tensor,
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    out: torch.Tensor | None = None,
    block_c: int = 256,
) -> torch.Tensor:
    """The causal depthwise conv of every tree node over its root path, in one launch.

    ``x [b, N, C]`` conv inputs per slot (last dim contiguous); ``conv_cache [S, C, >= W-1]``
    (any strides: vLLM's conv state, newest column last) read at ``state_slots [b]`` above the
    root; ``ancestors [b, N, D+1]`` (k-th ancestor, saturating at the root) and ``depths [b, N]``
    of the tree tables, padding slots at depth 0; ``weight [C, W]``. Returns ``[b, N, C]`` in
    ``x``'s dtype, accumulated in float32. Torch reference: :func:`ddtree.gdn.tree_conv1d_table`.
    """
    check_device(x, conv_cache, state_slots, ancestors, depths, weight)
    check_activation(activation)
    batch, n_slots, channels = x.shape
    width = weight.shape[1]
    if x.stride(-1) != 1 or tuple(weight.shape) != (channels, width):
        raise ValueError("tree_conv_fused: x needs a contiguous last dim and weight [C, W]")
    weight = weight.contiguous()
    ancestors, depths = ancestors.contiguous(), depths.contiguous()
    if out is None:
        out = torch.empty_like(x)
    block_c = min(block_c, next_pow2(channels))
    grid = (batch * n_slots, triton.cdiv(channels, block_c))
    _tree_conv_kernel[grid](
        x, conv_cache, state_slots, ancestors, depths, weight,
        weight if bias is None else bias, out,
        n_slots, channels, ancestors.shape[2] - 1,
        x.stride(0), x.stride(1), conv_cache.stride(0), conv_cache.stride(1),
        conv_cache.stride(2), ancestors.stride(0), ancestors.stride(1), depths.stride(0),
        out.stride(0), out.stride(1),
        W=width, BC=block_c, HAS_BIAS=bias is not None, SILU=activation is not None,
    )  # fmt: skip
    return out
