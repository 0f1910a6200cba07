"""Small Triton helpers shared by the kernels: order-preserving float keys and sorted searches."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INDEX_MASK = (1 << 31) - 1  # low field of a packed int64 sort key
EMPTY_KEY = -(1 << 63)  # below every packed key: an empty slot


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def sort_size(n: int) -> int:
    """A bitonic network's size for ``n`` keys: a power of two, at least 16 (``tl.topk`` and
    ``tl.sort`` need two or more elements; tiny networks gain nothing)."""
    return max(16, next_pow2(n))


def _pdl_setting() -> bool:
    value = os.environ.get("DDTREE_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"DDTREE_PDL must be 0 or 1, got {value!r}")
    return value == "1"


PDL_SETTING = _pdl_setting()  # read once, at import


@functools.cache
def _pdl_device(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for a chain of our kernels: on sm_90+ (not under the
    interpreter; ``DDTREE_PDL=0`` turns it off). Each kernel of the chain may then be scheduled
    while its predecessor still runs (the launch latency, ~2-4 us a boundary, hidden at batch 1)
    and waits in :func:`pdl_enter` before touching memory."""
    if device.type != "cuda" or not PDL_SETTING:
        return False
    return _pdl_device(device)


def pdl_args(device: torch.device) -> dict:
    """Launch arguments of a kernel that starts with :func:`pdl_enter`."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch_pdl``: let the next kernel be
    scheduled, then wait until the previous one has finished and its writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def order_key(x):
    """int32 ordered like the float32 values ``x``, -0.0 folded into +0.0 (``tree._order_bits``)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def key_value(key):
    """The float32 value of an ``order_key`` (int32)."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pack_key(key, index):
    """int64 sort key: larger ``key`` (int32) first, then smaller ``index`` (< 2**31) first."""
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def packed_index(packed):
    return (0x7FFFFFFF - (packed & 0x7FFFFFFF)).to(tl.int32)


@triton.jit
def packed_value(packed):
    return key_value((packed >> 32).to(tl.int32))


@triton.jit
def count_le(sorted_vals, queries, N: tl.constexpr, STEPS: tl.constexpr):
    """#{i < N : sorted_vals[i] <= q} per query (``sorted_vals [N]`` non-decreasing), by a
    branch-free binary search of ``STEPS >= log2(N) + 1`` rounds of register gathers."""
    lo = tl.zeros(queries.shape, tl.int32)
    hi = tl.full(queries.shape, N, tl.int32)
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = lo < hi
        ok = tl.gather(sorted_vals, tl.minimum(mid, N - 1), 0) <= queries
        lo = tl.where(go & ok, mid + 1, lo)
        hi = tl.where(go & ~ok, mid, hi)
    return lo
