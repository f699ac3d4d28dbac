"""A sequence's block table: the list of the physical blocks that hold its K/V, one per
`block_size` positions (docs/architecture.md), with the same blocks kept in a numpy array.

Why the array: every step copies the block tables of its rows into the step's input arrays
(engine.inputs). Flattening the lists for that walked every block of every row in Python: at
batch 64 and 4,096 tokens of context (256 blocks a row) that took ~390 us a build, five builds a
self-speculation round, while the copy from arrays takes ~0.3 us a row whatever the context
(vLLM keeps its block tables in arrays for the same reason). The list stays the interface the
block manager, the scheduler and the tests use; every list method that changes it updates the
array too, so the two never part.
"""
from __future__ import annotations

from typing import Iterable, SupportsIndex

import numpy as np


class BlockTable(list):
    """A list of block ids whose first len(self) entries are also in `array` (int32). `version`
    counts its changes: a copy of the table taken at one version is still right at the same one
    (a fused round's inputs keep each row's table from round to round: speculative.round_inputs)."""

    __slots__ = ("array", "version")

    def __init__(self, blocks: Iterable[int] = ()):
        super().__init__(blocks)
        self.array = np.empty(max(8, 2 * len(self)), dtype=np.int32)
        self.version = 0
        self._sync()

    def _sync(self, start: int = 0) -> None:
        """Copies entries start.. of the list into the array (grown to hold them)."""
        self.version += 1
        n = len(self)
        if n > self.array.shape[0]:
            grown = np.empty(max(2 * self.array.shape[0], n), dtype=np.int32)
            grown[:start] = self.array[:start]
            self.array = grown
        if n > start:
            self.array[start:n] = self[start:]

    # the mutators the engine uses, kept cheap: a step appends a block now and then, and
    # speculative rollback pops the last ones
    def append(self, block: int) -> None:
        super().append(block)
        self._sync(len(self) - 1)

    def extend(self, blocks: Iterable[int]) -> None:
        start = len(self)
        super().extend(blocks)
        self._sync(start)

    def pop(self, index: SupportsIndex = -1) -> int:
        block = super().pop(index)
        if index != -1 and int(index) != len(self):  # not the last: the entries after it moved
            self._sync(int(index) if int(index) >= 0 else 0)
        else:
            self.version += 1
        return block

    def clear(self) -> None:
        super().clear()
        self.version += 1

    # every other way a list changes but clear (which leaves nothing to keep in step): rewrite the
    # array from the list
    def __setitem__(self, index, value) -> None:
        super().__setitem__(index, value)
        self._sync()

    def __delitem__(self, index) -> None:
        super().__delitem__(index)
        self._sync()

    def __iadd__(self, blocks):
        self.extend(blocks)
        return self

    def __imul__(self, times):
        result = super().__imul__(times)
        self._sync()
        return result

    def insert(self, index: SupportsIndex, block: int) -> None:
        super().insert(index, block)
        self._sync()

    def remove(self, block: int) -> None:
        super().remove(block)
        self._sync()

    def sort(self, *args, **kwargs) -> None:
        super().sort(*args, **kwargs)
        self._sync()

    def reverse(self) -> None:
        super().reverse()
        self._sync()
