"""DDTree's own fixed-shape step pieces as CUDA graphs: one replay instead of ~100 launches.

vLLM graphs the target's forward; DDTree's per-step work around it (the tree build from the
drafter's ranked tokens, the KV commit over every layer) is many small kernels whose launch
cost, not their GPU time, is what the step pays. Each piece is a function of fixed-shape
tensors once the number of requests is rounded up to a bucket (:func:`bucket`), so it is
captured once per shape and replayed after that. On the CPU, or with ``DDTREE_CUDA_GRAPHS=0``
(``enabled=False``), the same function runs eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def bucket(num_reqs: int) -> int:
    """Requests rounded up to a power of two: the batch sizes graphs are captured for."""
    return 1 << max(num_reqs - 1, 0).bit_length()


def buckets(max_reqs: int) -> list[int]:
    """Every bucket a step of up to ``max_reqs`` requests can fall in: 1, 2, 4, ..."""
    return [1 << k for k in range(bucket(max_reqs).bit_length())]


@contextlib.contextmanager
def sync_allowed():
    """Code that synchronizes by design (graph capture; the host reads of the V1 runner's
    request options and grammar, which only their requests pay): DDTREE_SYNC_DEBUG must not
    flag it."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class Pool:
    """One CUDA graph memory pool for an engine's DDTree graphs (they never replay
    concurrently), made at the first capture."""

    def __init__(self):
        self._handle = None

    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle


@dataclasses.dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Any


class GraphCache:
    """``fn(*tensors, **options)`` replayed from a CUDA graph captured per (shapes, dtypes,
    options). The inputs are copied into the graph's own tensors (with ``inputs_in_place``
    the graph reads the tensors it was captured with, which the caller passes every time and
    refills itself: no copies); the outputs returned are the graph's, overwritten by its next
    replay (copy what must outlive it).

    Before a capture ``fn`` runs once eagerly (lazy initialisations must not happen inside the
    capture) on ``warmup(inputs)``: for functions with side effects, inputs that make that run
    harmless.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        warmup: Callable[..., list] | None = None,
        pool: Pool | None = None,
        enabled: bool = True,
        inputs_in_place: bool = False,
    ):
        self.fn = fn
        self.warmup = warmup
        self.pool = pool or Pool()
        self.enabled = enabled
        self.inputs_in_place = inputs_in_place
        self.entries: dict[tuple, _Entry] = {}

    def __call__(self, *inputs: torch.Tensor, **options: Any) -> Any:
        if not (self.enabled and inputs[0].is_cuda):
            return self.fn(*inputs, **options)
        entry = self._entry(inputs, options)
        for static, value in zip(entry.inputs, inputs, strict=True):
            if static is not value:
                if self.inputs_in_place:
                    raise ValueError("GraphCache(inputs_in_place=True): pass the same tensors")
                static.copy_(value, non_blocking=True)
        entry.graph.replay()
        return entry.outputs

    def prepare(self, *inputs: torch.Tensor, **options: Any) -> None:
        """Capture the graph for these inputs' shapes now (at start-up: no capture, nor the
        eager run before it, in a served step), without replaying it. A no-op where
        ``__call__`` runs eagerly."""
        if self.enabled and inputs[0].is_cuda:
            self._entry(inputs, options)

    def _entry(self, inputs, options) -> _Entry:
        key = (tuple((t.shape, t.dtype) for t in inputs), tuple(sorted(options.items())))
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._capture(inputs, options)
        return entry

    def _capture(self, inputs, options) -> _Entry:
        static = list(inputs) if self.inputs_in_place else [t.clone() for t in inputs]
        with sync_allowed():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fn(*(self.warmup(*static) if self.warmup else static), **options)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self.pool.handle(), capture_error_mode="thread_local"
            ):
                outputs = self.fn(*static, **options)
        return _Entry(graph, static, outputs)
