"""Engine-free reference of a Gated DeltaNet (GDN) layer's core on a DDTree draft tree.

Qwen3.5 / Qwen3.6 targets are hybrid: most layers are GDN (linear attention with a recurrent
state, after a width-4 causal depthwise conv over q/k/v). A tree verify must give every node
the recurrence along its own root path: its parent's state updated with its own token, and a
conv window over its ancestors that falls back to the cached conv columns above the root.
This module is the exact, slow reference an engine kernel is checked against.

The math mirrors vLLM 0.26 (paths under ``vllm/``):

* Recurrence, per value head, state ``S [V, K]`` (vLLM's ``ssm_state`` layout ``[HV, V, K]``,
  ``third_party/flash_linear_attention/ops/fused_recurrent.py:
  fused_recurrent_gated_delta_rule_fwd_kernel`` and ``ops/fused_sigmoid_gating.py:
  fused_sigmoid_gating_delta_rule_update_kernel``, loop body)::

      q = q / sqrt(sum(q * q) + 1e-6) * scale     # use_qk_l2norm_in_kernel, scale = K ** -0.5
      k = k / sqrt(sum(k * k) + 1e-6)
      S = S * exp(g)                              # b_h *= exp(b_g)
      u = beta * (v - S @ k)                      # b_v -= sum(b_h * b_k); b_v *= b_beta
      S = S + outer(u, k)                         # b_h += b_v[:, None] * b_k[None, :]
      o = S @ q                                   # b_o = sum(b_h * b_q[None, :], 1)

  i.e. ``S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``, ``o_t = S_t q_t``.
  Value head ``hv`` reads q/k head ``hv // (HV // H)`` (``i_h = i_hv // (HV // H)``).
* Gating (``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py: fused_gdn_gating``):
  ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus threshold 20), ``beta = sigmoid(b)``.
* Conv (``model_executor/layers/mamba/ops/cpu/causal_conv1d.py: causal_conv1d_update_torch``,
  the torch twin of the Triton ``causal_conv1d_update``): ``conv_state [C, W-1]`` holds the
  last ``W-1`` inputs, newest in the last column; ``out_t = act(bias + sum_j weight[:, j] *
  window_t[j])`` over the window ``[inputs t-W+1 .. t]`` (``F.conv1d`` is a correlation, so
  ``weight[:, W-1]`` multiplies the current input); ``act`` is SiLU for "silu"/"swish".

What is run, not only read: ``tests/test_gdn.py`` checks :func:`chain_gdn` (outputs and the
state after every token) against vLLM's CPU kernels (``vllm._custom_ops``)
``fused_sigmoid_gating_delta_rule_update_spec_cpu`` (recurrent) and
``chunk_gated_delta_rule_cpu`` (chunked prefill), :func:`gdn_gating` against
``fused_gdn_gating_cpu`` and :func:`tree_conv1d` against ``causal_conv1d_update_torch``
(skipped where they cannot be imported). The CPU kernels take the state as ``[HV, K, V]``
(their shape check says so; ``ops/cpu/gdn_attention.py`` views the ``[HV, V, K]`` cache that
way): the tests transpose. The Triton (GPU) kernels are read, not run, here.

Trees are ``parents`` arrays long ``[b, N]`` as in :class:`ddtree.tree.DraftTree`: slot 0 is the
root (the last committed token, not yet run through the target), a parent precedes its
children, and a slot ``i > 0`` with parent -1 is padding. The root and padding start from the
cached state; padding outputs are finite but meaningless, and no node may hang under padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # vLLM's in-kernel q/k L2 norm: x / sqrt(sum(x^2) + eps)


def gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    softplus_threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token decay ``g`` and write strength ``beta`` from the layer's ``a``/``b`` projections.

    ``A_log, dt_bias [HV]``; ``a, b [..., HV]``. Returns ``(g, beta)``, both ``[..., HV]`` in
    float32 or wider: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.
    vLLM's prefill (``fused_gdn_gating``) and packed-decode kernels round ``beta`` to ``b``'s
    dtype, its spec-decode kernel does not: round the result to match the former.
    """
    dtype = _compute_dtype(A_log, a, b, dt_bias)
    x = a.to(dtype) + dt_bias.to(dtype)
    softplus = torch.where(x <= softplus_threshold, torch.log1p(torch.exp(x)), x)
    g = -torch.exp(A_log.to(dtype)) * softplus
    return g, torch.sigmoid(b.to(dtype))


def chain_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    l2norm_eps: float = L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``T`` tokens of ``b`` sequences, one token at a time.

    Args:
        q, k: ``[b, T, H, K]``; v: ``[b, T, HV, V]`` with ``HV`` a multiple of ``H``.
        g, beta: ``[b, T, HV]``: log-decay (<= 0) and write strength per token and value head.
        state: ``[b, HV, V, K]`` before the first token (vLLM's layout); None: zeros.
        scale: on the normalized q; None: ``K ** -0.5`` (vLLM's default).

    Returns ``(out [b, T, HV, V], states [b, T, HV, V, K])``: ``states[:, t]`` is the state
    after token t (vLLM's ``inplace_final_state=False`` output), computed in float32 or wider.
    """
    q, k = _normalize_qk(q, k, v, scale, use_qk_l2norm, l2norm_eps)
    state = _initial_state(state, k, v)
    outs, states = [], []
    for t in range(k.shape[1]):
        out, state = _step(state, k[:, t], v[:, t], g[:, t], beta[:, t], q[:, t])
        outs.append(out)
        states.append(state)
    batch, _, heads_v, dim_v = v.shape
    if not outs:
        empty = state.new_zeros(batch, 0, heads_v, dim_v)
        return empty, state.new_zeros(batch, 0, *state.shape[1:])
    return torch.stack(outs, 1), torch.stack(states, 1)


def tree_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    parents: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    l2norm_eps: float = L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule on a batch of trees: each node continues its parent's state.

    Inputs as in :func:`chain_gdn` with ``T = N`` slots, plus ``parents`` long ``[b, N]``.
    Slots are visited in order (a parent precedes its children), keeping every node's state.

    Returns ``(out [b, N, HV, V], node_states [b, N, HV, V, K])``: node i's output and state
    equal the last ones of :func:`chain_gdn` over its root path (root first).
    """
    check_parents(parents)
    q, k = _normalize_qk(q, k, v, scale, use_qk_l2norm, l2norm_eps)
    state = _initial_state(state, k, v)
    batch, n_slots = parents.shape
    rows = torch.arange(batch, device=parents.device)
    node_states = state.new_zeros(batch, n_slots, *state.shape[1:])  # [b, N, HV, V, K]
    outs = []
    for slot in range(n_slots):
        parent = parents[:, slot]  # [b]
        parent_state = node_states[rows, parent.clamp(min=0)]  # [b, HV, V, K]
        before = torch.where((parent >= 0)[:, None, None, None], parent_state, state)
        out, after = _step(before, k[:, slot], v[:, slot], g[:, slot], beta[:, slot], q[:, slot])
        node_states[:, slot] = after
        outs.append(out)
    return torch.stack(outs, 1), node_states


def tree_gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    parents: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    l2norm_eps: float = L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tree_gdn` in parallel form: the chunked delta rule with an ancestor mask.

    Unrolling one root path from the cached state ``S0`` gives, with ``G_t`` the sum of ``g``
    over the path up to t and ``u_t = beta_t (v_t - exp(g_t) S_{t-1} k_t)`` (the kernel's
    ``b_v`` after the delta step)::

        S_t = exp(G_t) S0 + sum_{s <=anc t} exp(G_t - G_s) u_s k_s^T
        u_t + beta_t sum_{s <anc t} exp(G_t - G_s) (k_t . k_s) u_s = beta_t (v_t - exp(G_t) S0 k_t)
        o_t = exp(G_t) S0 q_t + sum_{s <=anc t} exp(G_t - G_s) (k_s . q_t) u_s

    where ``s <anc t`` runs over t's proper ancestors (``<=anc``: and t itself). The system is
    unit lower triangular in slot order, so one triangular solve per head gives every ``u``:
    exact, since each root path is a chain. This is the form a tree-masked chunk kernel takes.
    Returns ``(out [b, N, HV, V], node_states [b, N, HV, V, K])`` like :func:`tree_gdn`.
    """
    check_parents(parents)
    q, k = _normalize_qk(q, k, v, scale, use_qk_l2norm, l2norm_eps)
    state = _initial_state(state, k, v)  # [b, HV, V, K]
    dtype = state.dtype
    k, v, q = k.to(dtype), v.to(dtype), q.to(dtype)
    g, beta = g.to(dtype), beta.to(dtype)
    n_slots = parents.shape[1]
    self_or_ancestor = ancestor_mask(parents)  # bool [b, N, N]: [t, s] s is t or its ancestor
    log_decay = torch.einsum("bts,bsh->bth", self_or_ancestor.to(dtype), g)  # [b, N, HV]: G
    gap = log_decay[:, :, None] - log_decay[:, None]  # [b, N(t), N(s), HV]: G_t - G_s
    # exp only where s is on t's path: elsewhere G_t - G_s may be > 0 and overflow.
    decay = torch.where(self_or_ancestor[..., None], gap, -torch.inf).exp()  # [b, N, N, HV]
    strict = ~torch.eye(n_slots, dtype=torch.bool, device=parents.device)
    kk = torch.einsum("bthd,bshd->btsh", k, k)  # [b, N, N, HV]
    system = beta[:, :, None] * decay * kk * strict[None, :, :, None]  # strictly lower: A
    cached_k = torch.einsum("bhvd,bthd->bthv", state, k)  # [b, N, HV, V]: S0 k_t
    growth = log_decay.exp()  # [b, N, HV]: exp(G_t)
    rhs = beta[..., None] * (v - growth[..., None] * cached_k)  # [b, N, HV, V]
    eye = torch.eye(n_slots, dtype=dtype, device=parents.device)
    lower = eye + system.permute(0, 3, 1, 2)  # [b, HV, N, N]: I + A
    deltas = torch.linalg.solve_triangular(
        lower, rhs.permute(0, 2, 1, 3), upper=False, unitriangular=True
    ).permute(0, 2, 1, 3)  # [b, N, HV, V]: u
    qk = torch.einsum("bthd,bshd->btsh", q, k)  # [b, N(t), N(s), HV]: k_s . q_t
    cached_q = torch.einsum("bhvd,bthd->bthv", state, q)  # [b, N, HV, V]: S0 q_t
    out = growth[..., None] * cached_q + torch.einsum("btsh,bshv->bthv", decay * qk, deltas)
    node_states = growth[..., None, None] * state[:, None] + torch.einsum(
        "btsh,bshv,bshd->bthvd", decay, deltas, k
    )
    return out, node_states


def tree_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    parents: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """The causal depthwise conv of every tree node over its root path.

    Args:
        x: ``[b, N, C]`` conv inputs per slot (the packed q/k/v projection).
        conv_state: ``[b, C, W-1]``: the last ``W-1`` inputs before the root, newest last
            (vLLM's ``(dim, state_len)`` layout).
        parents: long ``[b, N]``.
        weight: ``[C, W]``; bias: ``[C]`` or None; activation: None, "silu" or "swish".

    Node i's window holds its ``W-1`` nearest ancestors (parent last) and itself; where the
    chain is shorter than ``W-1`` it continues with the newest cached columns. Gathered through
    the ancestor table, as a kernel would. Returns ``[b, N, C]``.
    """
    check_parents(parents)
    check_activation(activation)
    width = weight.shape[1]
    if conv_state.shape[-1] != width - 1:
        raise ValueError(f"conv_state must hold W-1 = {width - 1} columns, got {conv_state.shape}")
    ancestors = ancestor_table(parents, width - 1)  # [b, N, W]: j-th ancestor, -1 past the root
    depth_in_window = (ancestors >= 0).sum(-1, keepdim=True) - 1  # [b, N, 1]: depth, capped
    lag = torch.arange(width, device=parents.device)  # [W]: j
    # Rows of [conv_state columns (W-1), x slots (N)]: ancestor j of slot i is row W-1 + a_j;
    # past the root (j > depth d) it is cached column W-1 - (j - d).
    rows = torch.where(ancestors >= 0, width - 1 + ancestors, width - 1 - (lag - depth_in_window))
    return _conv_over_rows(x, conv_state, rows, weight, bias, activation)


def tree_conv1d_table(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """:func:`tree_conv1d` from the tree tables an engine keeps (``ancestors [b, N, D+1]``: the
    j-th ancestor, saturating at the root; ``depths [b, N]``) instead of ``parents``: fixed
    shapes, no checks, no host read, so a CUDA graph can capture it. Padding slots must
    have depth 0 (they read the cached columns, as a root does). Returns ``[b, N, C]``."""
    width = weight.shape[1]
    lag = torch.arange(width, device=x.device)  # [W]: j
    depth = depths.long()[..., None]  # [b, N, 1]
    up = ancestors.long().gather(2, lag.clamp(max=ancestors.shape[2] - 1).expand(
        *ancestors.shape[:2], width))  # fmt: skip
    rows = torch.where(lag <= depth, width - 1 + up, width - 1 - (lag - depth))  # [b, N, W]
    return _conv_over_rows(x, conv_state, rows, weight, bias, activation)


def check_activation(activation: str | None) -> None:
    """The conv activations vLLM's GDN layers use."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def _conv_over_rows(x, conv_state, rows, weight, bias, activation) -> torch.Tensor:
    """The conv of every slot over its window ``rows [b, N, W]`` (lag j = 0 first) of the
    history ``[conv_state columns (W-1), x slots (N)]``. Returns ``[b, N, C]``."""
    history = torch.cat([conv_state.transpose(1, 2), x.to(conv_state.dtype)], 1)  # [b, W-1+N, C]
    batch = rows.shape[0]
    windows = history[torch.arange(batch, device=x.device)[:, None, None], rows]  # [b, N, W, C]
    # weight[:, W-1] multiplies the current input (j = 0): flip the lag axis.
    out = torch.einsum("bnjc,cj->bnc", windows, weight.flip(1).to(history.dtype))
    if bias is not None:
        out = out + bias.to(out.dtype)
    return F.silu(out) if activation is not None else out


def _conv_state_after(
    conv_state: torch.Tensor, path_inputs: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``history [b, C, W-1+L]`` = the cached columns ``conv_state [b, C, W-1]`` then the path's
    inputs ``path_inputs [b, L, C]``, and the conv state after ``lengths [b]`` path nodes: its
    columns ``len .. len + W-2``."""
    window = conv_state.shape[-1]
    history = torch.cat([conv_state, path_inputs.to(conv_state.dtype).transpose(1, 2)], -1)
    columns = lengths.long()[:, None] + torch.arange(window, device=history.device)  # [b, W-1]
    return history, history.gather(2, columns[:, None].expand(-1, history.shape[1], -1))


def path_conv1d(
    path_inputs: torch.Tensor,
    conv_state: torch.Tensor,
    lengths: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv along accepted paths, for a commit that replays them.

    ``path_inputs [b, L, C]``: the conv inputs of each path's nodes from the root (rows past
    ``lengths [b]`` are ignored); ``conv_state [b, C, W-1]`` before the root. Returns the conv
    outputs ``[b, L, C]`` (what the tree verify computed at those nodes) and the conv state
    after the path ``[b, C, W-1]`` (the last ``W-1`` inputs). Fixed shapes, no host read."""
    history, new_state = _conv_state_after(conv_state, path_inputs, lengths)
    out = F.conv1d(history, weight[:, None, :].to(history.dtype), groups=history.shape[1])
    if bias is not None:
        out = out + bias.to(out.dtype)[:, None]
    out = F.silu(out) if activation is not None else out  # [b, C, L]
    return out.transpose(1, 2), new_state


@dataclass
class GDNStash:
    """What a tree verify keeps per node so that the accepted path can be committed later.

    Instead of ``N`` states per layer (``[N, HV, V, K]``, ~3 MiB each on Qwen3.6-27B), the
    engine keeps these small per-node inputs and replays the accepted path.
    """

    k: torch.Tensor  # [b, N, H, K]: the k fed to the recurrence (after the conv)
    v: torch.Tensor  # [b, N, HV, V]
    g: torch.Tensor  # [b, N, HV]
    beta: torch.Tensor  # [b, N, HV]
    conv_input: torch.Tensor  # [b, N, C]: the conv inputs (before the conv)
    parents: torch.Tensor  # long [b, N]: the tree they belong to


def replay_path(
    stash: GDNStash,
    path: torch.Tensor,
    state: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
    l2norm_eps: float = L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit an accepted path: the states after it, as a chain over its tokens would leave them.

    Args:
        stash: the tree verify's per-node inputs.
        path: long ``[b, L]``: accepted slots from the root (``path[:, 0] == 0``), each the
            child of the one before, then -1 padding (a request accepts ``(path >= 0).sum()``).
        state: ``[b, HV, V, K]`` before the root; None: zeros.
        conv_state: ``[b, C, W-1]`` before the root.

    Returns ``(state [b, HV, V, K], conv_state [b, C, W-1])`` after the last accepted slot.
    The same state is ``exp(G_t) S0 + sum_s exp(G_t - G_s) u_s k_s^T`` over the path
    (:func:`tree_gdn_chunked`): an engine that stashes ``u`` and ``G`` may use that instead.
    """
    lengths = check_path(path, stash.parents)  # [b]
    batch = path.shape[0]
    rows = torch.arange(batch, device=path.device)[:, None]
    slots = path.clamp(min=0)  # [b, L]
    k = stash.k[rows, slots]  # [b, L, H, K]
    v, g, beta = stash.v[rows, slots], stash.g[rows, slots], stash.beta[rows, slots]
    _, k = _normalize_qk(None, k, v, None, use_qk_l2norm, l2norm_eps)
    state = _initial_state(state, k, v)
    for t in range(path.shape[1]):
        _, after = _step(state, k[:, t], v[:, t], g[:, t], beta[:, t], None)
        state = torch.where((t < lengths)[:, None, None, None], after, state)
    _, new_conv_state = _conv_state_after(conv_state, stash.conv_input[rows, slots], lengths)
    return state, new_conv_state


def check_parents(parents: torch.Tensor) -> None:
    """Reject a ``parents [b, N]`` array that is not a batch of trees in slot order."""
    if parents.dim() != 2 or parents.dtype != torch.long or parents.shape[1] == 0:
        raise ValueError(f"parents must be long [b, N>=1], got {parents.dtype} {parents.shape}")
    slot = torch.arange(parents.shape[1], device=parents.device)
    if (parents[:, 0] != -1).any():
        raise ValueError("slot 0 (the root) must have parent -1")
    if ((parents < -1) | (parents >= slot)).any():
        raise ValueError("every parent must be -1 or an earlier slot")
    padding = (parents < 0) & (slot > 0)  # [b, N]
    if padding.gather(1, parents.clamp(min=0)).logical_and(parents >= 0).any():
        raise ValueError("a node hangs under a padding slot")


def check_path(path: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Validate an accepted ``path [b, L]`` in the tree ``parents``; returns its lengths ``[b]``."""
    check_parents(parents)
    if path.dim() != 2 or path.dtype != torch.long or path.shape[1] == 0:
        raise ValueError(f"path must be long [b, L>=1], got {path.dtype} {path.shape}")
    if path.shape[0] != parents.shape[0]:
        raise ValueError("path and parents disagree on the batch size")
    if (path[:, 0] != 0).any():
        raise ValueError("an accepted path starts at the root, slot 0")
    valid = path >= 0
    lengths = valid.sum(1)
    if (valid != (torch.arange(path.shape[1], device=path.device) < lengths[:, None])).any():
        raise ValueError("path padding (-1) must come after the accepted slots")
    if (path >= parents.shape[1]).any():
        raise ValueError("path holds a slot outside the tree")
    parent_of = parents.gather(1, path[:, 1:].clamp(min=0))  # [b, L-1]
    if ((parent_of != path[:, :-1]) & valid[:, 1:]).any():
        raise ValueError("each accepted slot must be the child of the one before")
    return lengths


def ancestor_table(parents: torch.Tensor, steps: int) -> torch.Tensor:
    """long ``[b, N, steps+1]``: the j-th ancestor of each slot (j = 0: itself), -1 past the
    root (padding counts as a root)."""
    chain = [torch.arange(parents.shape[1], device=parents.device).expand_as(parents)]
    for _ in range(steps):
        above = chain[-1]
        chain.append(torch.where(above >= 0, parents.gather(1, above.clamp(min=0)), -1))
    return torch.stack(chain, 2)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """bool ``[b, N, N]``: ``[i, j]`` is true iff j is i or one of its ancestors."""
    batch, n_slots = parents.shape
    ancestors = ancestor_table(parents, n_slots - 1)  # [b, N, N]
    mask = torch.zeros(batch, n_slots, n_slots + 1, dtype=torch.bool, device=parents.device)
    mask.scatter_(2, torch.where(ancestors >= 0, ancestors, n_slots), True)  # -1 -> spare column
    return mask[..., :n_slots]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 or wider, like vLLM's kernels (which load bf16 inputs into float32)."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _normalize_qk(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
    eps: float,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """q, k in the compute dtype, L2-normalized if asked, q scaled; k/q heads repeated so that
    value head ``hv`` sees head ``hv // (HV // H)``: ``[b, T, HV, K]`` each."""
    heads, heads_v = k.shape[2], v.shape[2]
    if heads_v % heads:
        raise ValueError(f"value heads ({heads_v}) must be a multiple of key heads ({heads})")
    dtype = _compute_dtype(k, v) if q is None else _compute_dtype(q, k, v)

    def prepare(x: torch.Tensor) -> torch.Tensor:
        x = x.to(dtype)
        if use_qk_l2norm:
            x = x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)
        return x.repeat_interleave(heads_v // heads, dim=2)

    k = prepare(k)
    if q is None:
        return None, k
    return prepare(q) * (k.shape[-1] ** -0.5 if scale is None else scale), k


def _initial_state(state: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[b, HV, V, K]`` in the compute dtype (zeros for None)."""
    batch, _, heads_v, dim_k = k.shape
    shape = (batch, heads_v, v.shape[-1], dim_k)
    if state is None:
        return k.new_zeros(shape)
    if tuple(state.shape) != shape:
        raise ValueError(f"state must be [b, HV, V, K] = {list(shape)}, got {list(state.shape)}")
    return state.to(torch.promote_types(state.dtype, k.dtype))


def _step(
    state: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    q: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One token: ``state [b, HV, V, K]``, prepared ``k, q [b, HV, K]``, ``v [b, HV, V]``,
    ``g, beta [b, HV]``. Returns ``(out [b, HV, V] or None, new state)``."""
    dtype = state.dtype
    k, v = k.to(dtype), v.to(dtype)
    decayed = state * g.to(dtype).exp()[..., None, None]
    delta = beta.to(dtype)[..., None] * (v - torch.einsum("bhvk,bhk->bhv", decayed, k))
    new_state = decayed + delta[..., :, None] * k[..., None, :]
    out = None if q is None else torch.einsum("bhvk,bhk->bhv", new_state, q.to(dtype))
    return out, new_state
