"""Per-row-count views of a model's activation buffers, made once and reused.

A step runs every decoder layer over the same T rows, and each layer reads and writes the first T
rows of a dozen preallocated buffers (and head-shaped views of them). Making those views is a
Python-level tensor op each, and at decode sizes that is not small next to the layer's kernels:
on SmolLM2 (2 Zen 4 cores, fp32, one row) slicing them per layer cost 1.0 ms of a 14 ms pass of
30 layers, and a quarter of an 8-layer draft copy's pass. So a workspace keeps the views of each
row count it has seen.
"""
from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")

# Prefill chunks come in many sizes: past this many row counts the cache starts over.
MAX_CACHED_ROW_COUNTS = 64


class RowViewCache(Generic[V]):
    """`cache(T)`: the views `make(T)` builds for T rows (or for any other shape key, e.g. a step's
    (tokens, sequences, ...)), built once per key (a bounded cache: views made again are the same
    views, so starting over costs only their making)."""

    def __init__(self, make: Callable[..., V]):
        self._make = make
        self._views: dict[Hashable, V] = {}

    def __call__(self, rows: Hashable) -> V:
        views = self._views.get(rows)
        if views is None:
            if len(self._views) >= MAX_CACHED_ROW_COUNTS:
                self._views.clear()
            views = self._views[rows] = self._make(rows)
        return views
