"""The target's processed distribution: temperature, then top-k, then top-p (engine-free).

One definition for the reference loop (``ddtree.generate``) and the engine's tree sampler, so
that both sample exactly the distribution vLLM's own sampler would for these options.
"""

from __future__ import annotations

import torch


def _per_row(value, rows: int, device, dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((rows,), value, device=device, dtype=dtype)


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """float32 ``[n, V]`` logits of the distribution each row samples from (-inf outside it).

    ``logits [n, V]``; ``temperature`` ``[n]`` or a number (> 0 where rows are sampled; rows at
    0 are divided by 1: the caller takes their argmax); ``top_k`` ``[n]`` or a number (<= 0 or
    >= V: off); ``top_p`` ``[n]`` or a number (>= 1: off); ``min_p`` ``[n]`` or a number (0:
    off). vLLM's order: temperature, min-p (drop tokens whose probability is below min_p times
    the row's largest), top-k, top-p. Top-k keeps every token tied with the k-th; top-p keeps
    the smallest prefix of the sorted distribution whose mass reaches p, the token that
    crosses p included.
    """
    rows, vocab = logits.shape
    temperature = _per_row(temperature, rows, logits.device, torch.float32)
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if min_p is not None:
        probs = scaled.softmax(-1)
        floor = (
            probs.amax(-1, keepdim=True)
            * _per_row(min_p, rows, logits.device, torch.float32)[:, None]
        )
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if top_k is None and top_p is None:
        return scaled
    ordered, order = scaled.sort(-1, descending=True)  # [n, V]
    if top_k is not None:
        k = _per_row(top_k, rows, logits.device, torch.long)
        k = torch.where((k <= 0) | (k > vocab), vocab, k)
        kth = ordered.gather(1, (k - 1)[:, None])  # [n, 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p is not None:
        p = _per_row(top_p, rows, logits.device, torch.float32)[:, None]
        probs = ordered.softmax(-1)
        drop = (probs.cumsum(-1) - probs >= p) & (p < 1)
        ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
