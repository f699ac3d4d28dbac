"""Paged KV bookkeeping: a free list of physical blocks and each sequence's block table.

One block table per sequence serves every layer (see DESIGN.md), so the bookkeeping is per token
position, never per layer. No tensor code here.

An encoder-decoder request (T5) also holds cross-attention blocks (`seq.cross_block_table`, one
slot per encoder token) from the same pool. They are counted in `extra_blocks_needed` and taken by
the first `grow` (the admission of its prefill), and freed with the rest, so the scheduler
admits, preempts and finishes such a request with no code of its own.
"""
from __future__ import annotations

from collections import deque

from eecore.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager: num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `seq` can hold `num_tokens` tokens (and its encoder output)."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table)) + self._cross_blocks_missing(seq)

    def _cross_blocks_missing(self, seq: Sequence) -> int:
        if seq.encoder_token_ids is None:
            return 0
        return self.blocks_for(len(seq.encoder_token_ids)) - len(seq.cross_block_table)

    def blocks_for_request(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` holds at `num_tokens` decoder tokens, its cross-attention blocks included."""
        cross = 0 if seq.encoder_token_ids is None else self.blocks_for(len(seq.encoder_token_ids))
        return self.blocks_for(num_tokens) + cross

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq`'s table cover `num_tokens` tokens. The caller checked `can_grow`."""
        need = self.extra_blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"BlockManager: sequence {seq.seq_id} needs {need} blocks, {len(self._free)} free")
        cross = self._cross_blocks_missing(seq)
        seq.cross_block_table.extend(self._free.popleft() for _ in range(cross))
        seq.block_table.extend(self._free.popleft() for _ in range(need - cross))

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks beyond what `num_tokens` tokens need (speculative rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._free.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        self._free.extend(seq.cross_block_table)
        seq.block_table = []
        seq.cross_block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
