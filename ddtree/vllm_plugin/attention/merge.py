"""Tree-masked attention for a batch of DDTree verify requests, backend-agnostic (pure torch).

A tree request's queries are its ``Q = 1 + B`` slots ``[root, node 1..B]``; slot i sees the
whole cached context plus its ancestors in the tree. The attention splits in two parts that
are merged with their log-sum-exps (as in cascade attention):

- prefix: every slot over the cached context only (non-causal). On the GPU one FlashAttention
  call over the paged cache for all requests (``flash.prefix_attention``); on
  the CPU an SDPA per request over K/V read back from the cache (the reference).
- suffix: every slot over the request's own ``Q`` new keys with the ancestor mask, dense, on
  the K/V the layer has just computed (not read back from the cache). Fixed shape
  ``[R, heads, Q, Q]``.
"""

from __future__ import annotations

import torch


def suffix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot over its own request's slots, as ``mask`` allows.

    ``query [T, H, hd]``, ``key/value [T, kvh, hd]``: the step's token rows; ``rows [R, Q]``:
    the token row of each slot; ``mask`` bool ``[R, Q, Q]`` (the diagonal set). Returns float32
    ``out [R*Q, H, hd]`` and ``lse [R*Q, H]``.
    """
    num_reqs, num_slots = rows.shape
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    flat = rows.flatten()
    q = query.index_select(0, flat).float()
    q = q.view(num_reqs, num_slots, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    k = key.index_select(0, flat).float().view(num_reqs, num_slots, num_kv_heads, 1, head_size)
    v = value.index_select(0, flat).float().view(num_reqs, num_slots, num_kv_heads, 1, head_size)
    k, v = k.permute(0, 2, 3, 1, 4), v.permute(0, 2, 3, 1, 4)  # [R, kvh, 1, Q, hd]
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [R, kvh, g, Q, Q]
    scores.masked_fill_(~mask[:, None, None], float("-inf"))
    lse = scores.logsumexp(-1)  # [R, kvh, g, Q]
    out = torch.matmul(scores.sub_(lse.unsqueeze(-1)).exp_(), v)  # [R, kvh, g, Q, hd]
    out = out.permute(0, 3, 1, 2, 4).reshape(num_reqs * num_slots, num_heads, head_size)
    return out, lse.permute(0, 3, 1, 2).reshape(num_reqs * num_slots, num_heads)


def attend_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal ``query [q, H, hd]`` over ``keys/values [L, kvh, hd]``: float32 ``out
    [q, H, hd]`` and ``lse [q, H]`` (``-inf`` rows when ``L == 0``)."""
    num_queries, num_heads, head_size = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    q = query.float().view(num_queries, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    k = keys.float().permute(1, 0, 2).unsqueeze(1)  # [kvh, 1, L, hd]
    v = values.float().permute(1, 0, 2).unsqueeze(1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [kvh, g, q, L]
    lse = scores.logsumexp(-1)  # [kvh, g, q]
    if keys.shape[0] == 0:
        out = torch.zeros(num_kv_heads, group, num_queries, head_size, device=query.device)
    else:
        out = torch.matmul((scores - lse.unsqueeze(-1)).exp(), v)  # [kvh, g, q, hd]
    out = out.permute(2, 0, 1, 3).reshape(num_queries, num_heads, head_size)
    return out, lse.permute(2, 0, 1).reshape(num_queries, num_heads)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each part's output
    ``[N, H, hd]`` and log-sum-exp ``[N, H]`` (float32)."""
    top = torch.maximum(lse_a, lse_b)
    weight_a = (lse_a - top).exp_().unsqueeze(-1)
    weight_b = (lse_b - top).exp_().unsqueeze(-1)
    return (out_a * weight_a + out_b * weight_b) / (weight_a + weight_b)
