"""Turns the rows of a step (which sequence, from which position, which tokens) into the tensors
the model reads: token ids, positions, slots, block tables, sequence lengths, query offsets.

The tensors live in buffers allocated once; each step fills a prefix of them from host arrays,
so stepping allocates no device memory.

A row may be a token tree (`Row.parents`): self-speculation verifies the draft's top-1 chain
together with alternative tokens in one pass. A tree's tokens take consecutive cache slots, but a
token's position (RoPE) is its depth in the tree, and it attends only to the context before the
row and to its own ancestors (paged_attention's `tree_mask`).

A static decode step (engine.static_decode) asks for the batch padded to a fixed size and the
block tables at their full width, so that every tensor of the step has the same shape and address
from one step to the next (what a captured CUDA graph reads). A padded row is a one-token sequence
that lives in the KV cache's pad block.

On a GPU the host arrays are pinned and copied asynchronously. A step's copy may still be queued
when the host builds the next step (self-speculation's last draft pass reads nothing back before
the verify pass is built), so `build` first waits for the previous step's copy: overwriting a
pinned buffer under a pending copy would hand the earlier step the later step's inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from eecore.engine.sequence import Sequence
from eecore.models.llama import AttentionInputs


# paged_attention's tree_mask is one int64 per query row: a tree row holds at most this many tokens
MAX_TREE_TOKENS = 64


@dataclass
class Row:
    """`tokens` of `seq` at positions start, start+1, ... (their K/V get written this step), or,
    with `parents`, a token tree: token j's parent is token parents[j] of this row (an earlier
    one), or the context for -1 (token 0's parent must be). Token j still takes slot start + j;
    its position is start + its depth, and it sees the context and its ancestors only."""
    seq: Sequence
    start: int
    tokens: list[int]
    parents: Optional[list[int]] = None


def tree_depths_and_masks(parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each token's depth in the tree (0 for a child of the context) and its ancestor-or-self
    bitmask over the row's tokens (paged_attention's tree_mask)."""
    n = len(parents)
    if not 0 < n <= MAX_TREE_TOKENS:
        raise ValueError(f"Row.parents: a token tree holds 1..{MAX_TREE_TOKENS} tokens, got {n}")
    if parents[0] != -1:
        raise ValueError(f"Row.parents: token 0's parent must be the context (-1), got {parents[0]}")
    depths = np.zeros(n, dtype=np.int64)
    masks = np.zeros(n, dtype=np.uint64)
    masks[0] = 1
    for j in range(1, n):
        parent = parents[j]
        if not 0 <= parent < j:
            raise ValueError(f"Row.parents: token {j}'s parent must be an earlier token of the row, got {parent}")
        depths[j] = depths[parent] + 1
        masks[j] = masks[parent] | np.uint64(1 << j)
    return depths, masks.view(np.int64)


@dataclass
class StepInputs:
    token_ids: torch.Tensor       # int64 [T]
    attn: AttentionInputs
    last_rows: torch.Tensor       # int64 [B]: the row of each sequence's last token
    row_lens: list[int]           # host copy of the per-sequence token counts

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


class InputBuilder:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, pad_block: int = -1):
        self.block_size = block_size
        self.pad_block = pad_block  # the KV cache's pad block (-1: none, padding unavailable)
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks_per_seq
        pin = device.type == "cuda"

        def host(n, dtype):
            return torch.empty(n, dtype=dtype, pin_memory=pin)

        self._h_tokens = host(max_tokens, torch.int64)
        self._h_positions = host(max_tokens, torch.int64)
        self._h_slots = host(max_tokens, torch.int64)
        self._h_seq_lens = host(max_seqs, torch.int32)
        self._h_qsl = host(max_seqs + 1, torch.int32)
        self._h_last = host(max_seqs, torch.int64)
        self._h_tree = host(max_tokens, torch.int64)
        self._h_tables = host(max_seqs * max_blocks_per_seq, torch.int32)
        # encoder-decoder models: each row's cross-attention blocks and encoder length
        self._h_cross_tables = host(max_seqs * max_blocks_per_seq, torch.int32)
        self._h_cross_lens = host(max_seqs, torch.int32)
        self.device = device
        if device.type == "cpu":
            self._d = self._copied = None
        else:
            self._d = {name: torch.empty_like(t, device=device) for name, t in self._host_buffers().items()}
            self._copied = torch.cuda.Event()  # recorded after each step's copies (module doc)

    def _host_buffers(self) -> dict[str, torch.Tensor]:
        return dict(tokens=self._h_tokens, positions=self._h_positions, slots=self._h_slots,
                    seq_lens=self._h_seq_lens, qsl=self._h_qsl, last=self._h_last, tables=self._h_tables,
                    tree=self._h_tree,
                    cross_tables=self._h_cross_tables, cross_lens=self._h_cross_lens)

    def build(self, rows: list[Row], pad_to: Optional[int] = None, width: int = 1) -> StepInputs:
        """`pad_to`: append rows in the pad block up to that many rows, and give the block tables their
        full width; every row then holds `width` tokens, a shorter one padded after its last token
        (a static step: see the module doc)."""
        real = [len(r.tokens) for r in rows]
        if pad_to is not None:
            self._check_padding(rows, pad_to, width)
            rows = [r if len(r.tokens) == width else Row(r.seq, r.start, r.tokens + [r.tokens[-1]] * (width - len(r.tokens)))
                    for r in rows]
        B = len(rows) if pad_to is None else pad_to
        lens = [len(r.tokens) for r in rows]
        T = sum(lens) + (B - len(rows)) * width
        if B > self.max_seqs or T > self.max_tokens:
            raise RuntimeError(f"step of {B} sequences / {T} tokens exceeds the engine's "
                               f"{self.max_seqs} / {self.max_tokens}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        tokens = self._h_tokens.numpy()
        positions = self._h_positions.numpy()
        slots = self._h_slots.numpy()
        qsl = self._h_qsl.numpy()
        seq_lens = self._h_seq_lens.numpy()
        table_width = self.max_blocks if pad_to is not None else \
            max((len(r.seq.block_table) for r in rows), default=1) or 1
        tables = self._h_tables.numpy()[: B * table_width].reshape(B, table_width)
        tables.fill(-1)
        qsl[0] = 0
        bs = self.block_size
        has_tree = any(r.parents is not None for r in rows)
        tree = self._h_tree.numpy()
        for b, row in enumerate(rows):
            lo, n = int(qsl[b]), lens[b]
            qsl[b + 1] = lo + n
            table = np.asarray(row.seq.block_table, dtype=np.int64)
            tables[b, : len(table)] = table
            pos = np.arange(row.start, row.start + n, dtype=np.int64)
            slots[lo: lo + n] = table[pos // bs] * bs + pos % bs
            tokens[lo: lo + n] = row.tokens
            if row.parents is not None:
                if len(row.parents) != n:
                    raise ValueError(f"Row.parents: {len(row.parents)} parents for {n} tokens")
                depths, tree[lo: lo + n] = tree_depths_and_masks(row.parents)
                pos = row.start + depths
            elif has_tree:  # a plain row of a step with trees: a chain
                if n > MAX_TREE_TOKENS:
                    raise ValueError(f"a step with token trees takes rows of at most {MAX_TREE_TOKENS} tokens, "
                                     f"got {n}")
                tree[lo: lo + n] = ((np.uint64(2) << np.arange(n, dtype=np.uint64)) - np.uint64(1)).view(np.int64)
            positions[lo: lo + n] = pos
            # a padded row's extra tokens write K/V after its own (slots the round reserved) but take
            # its last position for RoPE, which stays within the model's positions
            positions[lo + real[b]: lo + n] = row.start + real[b] - 1
            seq_lens[b] = row.start + n
        self._pad(len(rows), B, width, tables)
        last = self._h_last.numpy()
        last[:B] = qsl[1: B + 1] - 1
        views = dict(tokens=self._h_tokens[:T], positions=self._h_positions[:T], slots=self._h_slots[:T],
                     seq_lens=self._h_seq_lens[:B], qsl=self._h_qsl[: B + 1], last=self._h_last[:B],
                     tables=self._h_tables[: B * table_width].view(B, table_width))
        if has_tree:
            views["tree"] = self._h_tree[:T]
        if rows and rows[0].seq.encoder_token_ids is not None:
            views.update(self._cross_views(rows))
        if self._d is not None:
            views = {k: self._d[k][: v.numel()].view(v.shape).copy_(v, non_blocking=True) for k, v in views.items()}
            self._copied.record(torch.cuda.current_stream(self.device))
        attn = AttentionInputs(positions=views["positions"], slot_mapping=views["slots"], block_table=views["tables"],
                               seq_lens=views["seq_lens"], query_start_loc=views["qsl"],
                               max_query_len=max(lens, default=1),
                               cross_block_table=views.get("cross_tables"), cross_seq_lens=views.get("cross_lens"),
                               tree_mask=views.get("tree"))
        return StepInputs(token_ids=views["tokens"], attn=attn, last_rows=views["last"],
                          row_lens=lens + [width] * (B - len(rows)))

    def _check_padding(self, rows: list[Row], pad_to: int, width: int) -> None:
        if self.pad_block < 0:
            raise RuntimeError("InputBuilder: padding needs the KV cache's pad block")
        if pad_to < len(rows) or any(not 1 <= len(r.tokens) <= width or r.parents is not None for r in rows):
            raise ValueError(f"InputBuilder: padding to {pad_to} rows of {width} tokens takes at most that many "
                             f"rows of 1 to {width} tokens each (no token trees), got {len(rows)} rows")

    def _pad(self, first: int, end: int, width: int, tables: np.ndarray) -> None:
        """Rows first..end-1 of the host buffers as padding: each a `width`-token sequence in the pad
        block (wrapping around it), whose K/V lands there and whose attention sees only itself."""
        qsl, bs = self._h_qsl.numpy(), self.block_size
        j = np.arange(width)
        for b in range(first, end):
            lo = int(qsl[b])
            qsl[b + 1] = lo + width
            tables[b, : -(-width // bs)] = self.pad_block
            self._h_slots.numpy()[lo: lo + width] = self.pad_block * bs + j % bs
            self._h_tokens.numpy()[lo: lo + width] = 0
            self._h_positions.numpy()[lo: lo + width] = j
            self._h_seq_lens.numpy()[b] = width

    def _cross_views(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        """Cross-attention block tables and encoder lengths of the rows (encoder-decoder models)."""
        B = len(rows)
        width = max(len(r.seq.cross_block_table) for r in rows) or 1
        if width > self.max_blocks:
            raise RuntimeError(f"an encoder input needs {width} cross-attention blocks; the engine allows "
                               f"{self.max_blocks} per sequence")
        tables = self._h_cross_tables.numpy()[: B * width].reshape(B, width)
        tables.fill(-1)
        lens = self._h_cross_lens.numpy()
        for b, row in enumerate(rows):
            tables[b, : len(row.seq.cross_block_table)] = row.seq.cross_block_table
            lens[b] = len(row.seq.encoder_token_ids)
        return dict(cross_tables=self._h_cross_tables[: B * width].view(B, width), cross_lens=self._h_cross_lens[:B])
