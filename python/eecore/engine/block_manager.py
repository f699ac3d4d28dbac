"""Paged KV bookkeeping: a free list of physical blocks and each sequence's block table.

One block table per sequence serves every layer (docs/architecture.md), so the bookkeeping is per token
position, never per layer. No tensor code here.

An encoder-decoder request (T5) also holds cross-attention blocks (`seq.cross_block_table`, one
slot per encoder token) from the same pool. They are counted in `extra_blocks_needed` and taken by
the first `grow` (the admission of its prefill), and freed with the rest, so the scheduler
admits, preempts and finishes such a request with no code of its own.

Prefix caching (`prefix_caching=True`, vLLM's automatic prefix caching; decoder-only requests):
a full block of tokens that a prefill computed is named by a digest of its tokens and of every
token before it (a SHA-256 chain, so a crafted prompt cannot collide with another user's
prefix). A request admitted later whose first blocks have the same digests shares those blocks
(reference counts) and starts its prefill after them. Only prefill-computed blocks are named:
decode steps may write approximate K/V (early exit fills skipped layers from the exit state), and
a block that holds a full prefix of prompt tokens is never written again. A named block whose last
user leaves stays readable, evictable in least-recently-freed order, until a block is needed.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from eecore.engine.sequence import Sequence


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a block of `tokens` that follows the block named `parent` (b"" for the first)."""
    h = hashlib.sha256(parent)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager: num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks                     # sequences holding each block
        self._digest_of: dict[int, bytes] = {}            # named (cached) block -> its digest
        self._block_of: dict[bytes, int] = {}             # digest -> the block that holds it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, unheld: oldest first
        # prompt tokens looked up at admission, and those found cached
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._digest_of)

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the cached block unheld for longest
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._digest_of.pop(block)]
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._digest_of:
                self._evictable[block] = None
            else:
                # taken first again (last in, first out): its lines may still be cached, and the
                # blocks in use stay few, so the KV cache's memory (backed as it is first written,
                # see KVCache) does not grow past what the load needs
                self._free.appendleft(block)

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

    def covers(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` holds the blocks for `num_tokens` tokens (and its encoder output) already:
        a decode step's usual case, checked first because the scheduler asks it of every sequence
        every step."""
        return len(seq.block_table) * self.block_size >= num_tokens and \
            (seq.encoder_token_ids is None or not self._cross_blocks_missing(seq))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq`'s table cover `num_tokens` tokens. The caller checked `can_grow`."""
        need = self.extra_blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"BlockManager: sequence {seq.seq_id} needs {need} blocks, "
                               f"{self.num_free_blocks} free")
        cross = self._cross_blocks_missing(seq)
        seq.cross_block_table.extend(self._take() for _ in range(cross))
        seq.block_table.extend(self._take() for _ in range(need - cross))

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks beyond what `num_tokens` tokens need (speculative rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Gives back every block of `seq`; its prefill-computed full blocks stay cached."""
        self.cache_computed(seq)
        for block in seq.block_table + seq.cross_block_table:
            self._release(block)
        seq.block_table = []
        seq.cross_block_table = []
        seq.block_digests = []

    # ---- prefix caching --------------------------------------------------------------------
    def share_cached_prefix(self, seq: Sequence, max_tokens: int) -> int:
        """Admission of `seq` (no blocks yet): its longest run of first blocks that are cached,
        covering at most `max_tokens` tokens, goes into its table; returns the tokens covered
        (0 without prefix caching)."""
        if not self.prefix_caching or seq.encoder_token_ids is not None or seq.block_table:
            return 0
        bs, parent = self.block_size, b""
        for i in range(max_tokens // bs):
            digest = block_digest(parent, seq.token_slice(i * bs, (i + 1) * bs))
            block = self._block_of.get(digest)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            seq.block_table.append(block)
            seq.block_digests.append(digest)
            parent = digest
        return len(seq.block_table) * bs

    def record_prefix_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Counts an admitted request's lookup (a request that had to wait looks up again)."""
        if self.prefix_caching:
            self.prefix_query_tokens += query_tokens
            self.prefix_hit_tokens += hit_tokens

    def cache_computed(self, seq: Sequence) -> None:
        """Names the full blocks of `seq` that its prefill has computed, so later requests with
        the same first tokens can share them. Cheap to call every step: each block is named once."""
        if not self.prefix_caching or seq.encoder_token_ids is not None:
            return
        bs = self.block_size
        computed = min(seq.num_computed_tokens, seq.prefill_target, len(seq.block_table) * bs)
        for i in range(len(seq.block_digests), computed // bs):
            parent = seq.block_digests[-1] if seq.block_digests else b""
            digest = block_digest(parent, seq.token_slice(i * bs, (i + 1) * bs))
            seq.block_digests.append(digest)
            block = seq.block_table[i]
            # the same tokens may be cached already (two requests computed them side by side):
            # then this block stays unnamed and goes back to the free list when released
            if digest not in self._block_of and block not in self._digest_of:
                self._block_of[digest] = block
                self._digest_of[block] = digest

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
