"""Turns the rows of a step (which sequence, from which position, which tokens) into the tensors
the model reads: token ids, positions, slots, block tables, sequence lengths, query offsets.

The tensors live in buffers allocated once; each step fills a prefix of them from host arrays,
so stepping allocates no device memory.

A row may be a token tree (`Row.parents`): self-speculation verifies the draft's top-1 chain
together with alternative tokens in one pass. A tree's tokens take consecutive cache slots, but a
token's position (RoPE) is its depth in the tree, and it attends only to the context before the
row and to its own ancestors (paged_attention's `tree_mask`).

A static decode step (engine.static_decode) asks for the batch padded to a fixed size and the
block tables widened to a width bucket, so that every tensor of the step has the same shape and
address from one step of that size to the next (what a captured CUDA graph reads). A padded row is
a one-token sequence that lives in the KV cache's pad block.

On a GPU the host arrays are pinned and copied asynchronously. A step's copy may still be queued
when the host builds the next step (self-speculation's last draft pass reads nothing back before
the verify pass is built), so `build` first waits for the previous step's copy: overwriting a
pinned buffer under a pending copy would hand the earlier step the later step's inputs.

A step that follows a predictable one (decode ahead's next step, a draft chain's next pass) is
built from the prediction instead: engine.step_prediction. The rows and buffers themselves are in
engine.step_buffers; Row and StepInputs are importable from here too.
"""
from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import torch

from eecore.engine.step_buffers import (MAX_TREE_TOKENS, PaddedStep, Row, StepBuffers, StepInputs,
                                        tree_depths_and_masks)
from eecore.engine.step_prediction import PreparedDecode, StepPrediction
from eecore.models.llama import AttentionInputs
from eecore.models.workspace import RowViewCache

__all__ = ["MAX_TREE_TOKENS", "InputBuilder", "Row", "StepInputs", "tree_depths_and_masks"]


class InputBuilder(StepPrediction):
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, pad_block: int = -1):
        self.block_size = block_size
        self.pad_block = pad_block  # the KV cache's pad block (-1: none, padding unavailable)
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks_per_seq
        pin = device.type == "cuda"
        # One buffer holds a step's arrays, packed in the step's own shapes, so that a GPU step takes
        # one host-to-device copy (StepBuffers); its size is the largest step's.
        most = StepBuffers.nbytes_of(max_tokens, max_seqs, max_blocks_per_seq, has_tree=True)
        self._host = torch.empty(most, dtype=torch.uint8, pin_memory=pin)
        self.device = device
        if device.type == "cpu":
            self._device = self._copied = None
        else:
            self._device = torch.empty(most, dtype=torch.uint8, device=device)
            self._copied = torch.cuda.Event()  # recorded after each step's copy (module doc)
        # encoder-decoder models: each row's cross-attention blocks and encoder length, copied apart
        self._cross_host = {name: torch.empty(n, dtype=torch.int32, pin_memory=pin)
                            for name, n in (("tables", max_seqs * max_blocks_per_seq), ("lens", max_seqs))}
        self._cross_device = None if self._device is None else \
            {name: torch.empty_like(t, device=device) for name, t in self._cross_host.items()}
        # a step's arrays by shape (tokens, sequences, table width, token trees), made once per
        # shape (slicing costs microseconds the host pays on every step); a shape's layout is fixed,
        # so arrays made again after the bounded cache starts over sit at the same addresses
        self._buffers: RowViewCache[StepBuffers] = RowViewCache(
            lambda key: StepBuffers(self._host, self._device, *key))
        # predicted steps (engine.step_prediction)
        self._prepared: Optional[PreparedDecode] = None
        self.prepared_steps = 0  # builds that found their step prepared (tests and benchmarks read it)
        self._last_padded: Optional[PaddedStep] = None  # the last build, where advance may follow it
        self.advanced_steps = 0  # steps built by advance (tests and benchmarks read it)

    def table_width_bucket(self, rows: list[Row], width: int = 1) -> int:
        """The block-table width a static step over `rows` (padded to `width` tokens) takes: the
        next power of two of blocks (at least 8) that holds every row's table and a padding row,
        at most the full width. A captured step plans its attention for its tables' width (the
        context splits a CUDA graph keeps), so a step of short sequences gets a narrow table."""
        return self._width_bucket(max((len(r.seq.block_table) for r in rows), default=1), width)

    def _width_bucket(self, most_blocks: int, width: int) -> int:
        need = max(most_blocks, -(-width // self.block_size), 8)
        return min(1 << (need - 1).bit_length(), self.max_blocks)

    def build(self, rows: list[Row], pad_to: Optional[int] = None, width: int = 1,
              pad_tokens_to: Optional[int] = None, table_width: Optional[int] = None) -> StepInputs:
        """`pad_to`: append rows in the pad block up to that many rows, and give the block tables
        `table_width` columns (default: the full width); every row then holds `width` tokens, a
        shorter one padded after its last token (a static step: see the module doc).
        `pad_tokens_to`: append tokens of no sequence up to that many, at position 0, writing their
        K/V into the pad block (the token-wise parts of a piecewise pass run over them; its
        attention over the rows' own tokens).

        The host arrays are filled with whole-array numpy operations: on a GPU whose step is one
        graph replay, this is most of the host's share of the step, which the GPU waits out
        (bench/cost_host.py). The tensors returned are valid until the next `build`."""
        prepared, self._prepared = self._prepared, None  # the next build uses it or no build does
        self._last_padded = None
        if prepared is not None and width == 1 and pad_tokens_to is None:
            inputs = self._build_prepared(prepared, rows, pad_to, table_width)
            if inputs is not None:
                return inputs
        n = len(rows)
        real = [len(r.tokens) for r in rows]
        if pad_to is not None:
            self._check_padding(rows, pad_to, width)
        B = n if pad_to is None else pad_to
        lens = real if pad_to is None else [width] * n
        T = sum(lens) + (B - n) * width
        if pad_tokens_to is not None:
            self._check_token_padding(rows, pad_to, pad_tokens_to, T)
        padded_T = T if pad_tokens_to is None else pad_tokens_to
        if B > self.max_seqs or padded_T > self.max_tokens:
            raise RuntimeError(f"step of {B} sequences / {padded_T} tokens exceeds the engine's "
                               f"{self.max_seqs} / {self.max_tokens}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        bs = self.block_size
        table_lens = np.fromiter((len(r.seq.block_table) for r in rows), np.int64, n)
        if pad_to is None:
            table_width = int(table_lens.max(initial=1))
        elif table_width is None:
            table_width = self.max_blocks
        elif not (int(table_lens.max(initial=0)) <= table_width <= self.max_blocks
                  and table_width * self.block_size >= width):
            raise ValueError(f"InputBuilder: 'table_width' must hold every row's block table and a padding row "
                             f"of {width} tokens, within {self.max_blocks} blocks, got {table_width}")
        has_tree = any(r.parents is not None for r in rows)
        buffers = self._buffers((padded_T, B, table_width, has_tree))
        h = buffers.arrays
        tables = h["tables"]
        tables.fill(-1)
        starts = np.fromiter((r.start for r in rows), np.int64, n)
        qsl = h["qsl"]
        qsl[0] = 0
        if T == B and max(lens, default=1) == 1:  # one token a row (decode steps): no runs to spread over
            used, row_of, slot_pos = n, np.arange(n), starts
            qsl[1: n + 1] = row_of + 1
            h["tokens"][:n] = np.fromiter((r.tokens[0] for r in rows), np.int64, n)
            h["positions"][:n] = starts
        else:
            qsl[1: n + 1] = np.cumsum(lens)
            used = int(qsl[n])
            # each token's row and offset in it; a padded row's extra tokens repeat its last token
            # and write K/V after its own (slots the round reserved), but take its last position for
            # RoPE, which stays within the model's positions
            row_of = np.repeat(np.arange(n), lens)
            offset = np.arange(used) - qsl[row_of]
            h["tokens"][:used] = np.fromiter(itertools.chain.from_iterable(
                r.tokens + [r.tokens[-1]] * (width - len(r.tokens)) if pad_to is not None else r.tokens
                for r in rows), np.int64, used)
            h["positions"][:used] = starts[row_of] + np.minimum(offset, np.array(real)[row_of] - 1)
            slot_pos = starts[row_of] + offset
        self._copy_tables(rows, tables)
        block_index = slot_pos // bs
        outside = block_index >= table_lens[row_of]
        if outside.any():
            first = outside.argmax()
            b = int(row_of[first])
            raise RuntimeError(f"InputBuilder: row {b} writes position {int(slot_pos[first])}, "
                               f"past the {int(table_lens[b])} blocks of its sequence's block table")
        h["slots"][:used] = tables[row_of, block_index] * bs + slot_pos % bs
        h["seq_lens"][:n] = starts + np.array(lens, dtype=np.int64)
        if has_tree:
            self._trees(rows, h)
        self._pad(n, B, width, h)
        if has_tree and B > n:  # padding rows are chains of `width` tokens
            h["tree"][int(qsl[n]): int(qsl[B])] = np.tile(_chain_masks(width), B - n)
        if padded_T > T:
            h["tokens"][T:padded_T] = 0
            h["positions"][T:padded_T] = 0
            h["slots"][T:padded_T] = self.pad_block * bs + np.arange(padded_T - T) % bs
        h["last"][:B] = qsl[1: B + 1] - 1
        if pad_to is not None and padded_T == T and not has_tree:
            self._last_padded = PaddedStep((padded_T, B, table_width, has_tree), [r.seq for r in rows],
                                           starts + np.array(real, dtype=np.int64), table_lens, buffers)
        return self._finish(buffers, rows, lens, B, width)

    def _finish(self, buffers: StepBuffers, rows: list[Row], lens: list[int], B: int, width: int) -> StepInputs:
        """The filled arrays of a step as its tensors: copied to the device where there is one."""
        views = buffers.host if self._device is None else buffers.device
        if self._device is not None:
            buffers.device_bytes.copy_(buffers.host_bytes, non_blocking=True)
        if rows and rows[0].seq.encoder_token_ids is not None:
            views = dict(views, **self._cross_views(rows))
        if self._device is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        attn = AttentionInputs(positions=views["positions"], slot_mapping=views["slots"], block_table=views["tables"],
                               seq_lens=views["seq_lens"], query_start_loc=views["qsl"],
                               max_query_len=max(lens, default=1),
                               cross_block_table=views.get("cross_tables"), cross_seq_lens=views.get("cross_lens"),
                               tree_mask=views.get("tree"))
        return StepInputs(token_ids=views["tokens"], attn=attn, last_rows=views["last"],
                          row_lens=lens + [width] * (B - len(rows)))

    @staticmethod
    def _copy_tables(rows: list[Row], tables: np.ndarray) -> None:
        """Each row's block table into its row of the step's `tables` (filled with -1 before): one
        copy from the table's array a row (engine.block_table), whatever the context's length."""
        for b, row in enumerate(rows):
            table = row.seq.block_table
            tables[b, : len(table)] = table.array[: len(table)]

    @staticmethod
    def _trees(rows: list[Row], h: dict[str, np.ndarray]) -> None:
        """Token trees' masks and their tokens' positions (depths) into the step's arrays `h`; every
        other row of the step is a chain (each token sees the ones before it)."""
        qsl, tree, positions = h["qsl"], h["tree"], h["positions"]
        for b, row in enumerate(rows):
            lo, n = int(qsl[b]), int(qsl[b + 1] - qsl[b])  # (a padded step's rows all hold `width` tokens)
            if row.parents is not None:
                real = len(row.tokens)
                if len(row.parents) != real:
                    raise ValueError(f"Row.parents: {len(row.parents)} parents for {real} tokens")
                depths, tree[lo: lo + real] = tree_depths_and_masks(row.parents)
                positions[lo: lo + real] = row.start + depths
                # a padded step's tokens past the tree's: each sees the context and itself alone,
                # at the tree's deepest position (their K/V goes to slots the round reserved, their
                # outputs are dropped)
                positions[lo + real: lo + n] = row.start + int(depths.max())
                tree[lo + real: lo + n] = (np.uint64(1) << np.arange(real, n, dtype=np.uint64)).view(np.int64)
            else:
                if n > MAX_TREE_TOKENS:
                    raise ValueError(f"a step with token trees takes rows of at most {MAX_TREE_TOKENS} tokens, "
                                     f"got {n}")
                tree[lo: lo + n] = _chain_masks(n)

    def _check_padding(self, rows: list[Row], pad_to: int, width: int) -> None:
        if self.pad_block < 0:
            raise RuntimeError("InputBuilder: padding needs the KV cache's pad block")
        if pad_to < len(rows) or any(not 1 <= len(r.tokens) <= width for r in rows) or \
                (width > MAX_TREE_TOKENS and any(r.parents is not None for r in rows)):
            raise ValueError(f"InputBuilder: padding to {pad_to} rows of {width} tokens takes at most that many "
                             f"rows of 1 to {width} tokens each (token trees: rows of at most {MAX_TREE_TOKENS}), "
                             f"got {len(rows)} rows")

    def _check_token_padding(self, rows: list[Row], pad_to: Optional[int], pad_tokens_to: int, T: int) -> None:
        if self.pad_block < 0:
            raise RuntimeError("InputBuilder: padding needs the KV cache's pad block")
        if pad_to is not None or pad_tokens_to < T or any(r.parents is not None for r in rows):
            raise ValueError(f"InputBuilder: 'pad_tokens_to' pads the {T} tokens of unpadded rows without token "
                             f"trees to at least that many, got {pad_tokens_to} (pad_to={pad_to})")

    def _pad(self, first: int, end: int, width: int, h: dict[str, np.ndarray]) -> None:
        """Rows first..end-1 of the step's arrays `h` as padding: each a `width`-token sequence in the
        pad block (wrapping around it), whose K/V lands there and whose attention sees only itself."""
        count = end - first
        if count <= 0:
            return
        bs = self.block_size
        lo = int(h["qsl"][first])
        hi = lo + count * width
        h["qsl"][first + 1: end + 1] = np.arange(lo + width, hi + 1, width)
        h["tables"][first:end, : -(-width // bs)] = self.pad_block
        j = np.arange(width)
        h["slots"][lo:hi] = np.tile(self.pad_block * bs + j % bs, count)
        h["tokens"][lo:hi] = 0
        h["positions"][lo:hi] = np.tile(j, count)
        h["seq_lens"][first:end] = width

    def _cross_views(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        """Cross-attention block tables and encoder lengths of the rows (encoder-decoder models), on
        the device where there is one."""
        B = len(rows)
        width = max(len(r.seq.cross_block_table) for r in rows) or 1
        if width > self.max_blocks:
            raise RuntimeError(f"an encoder input needs {width} cross-attention blocks; the engine allows "
                               f"{self.max_blocks} per sequence")
        tables = self._cross_host["tables"][: B * width].view(B, width)
        lens = self._cross_host["lens"][:B]
        tables_np, lens_np = tables.numpy(), lens.numpy()
        tables_np.fill(-1)
        for b, row in enumerate(rows):
            tables_np[b, : len(row.seq.cross_block_table)] = row.seq.cross_block_table
            lens_np[b] = len(row.seq.encoder_token_ids)
        if self._cross_device is not None:
            tables = self._cross_device["tables"][: B * width].view(B, width).copy_(tables, non_blocking=True)
            lens = self._cross_device["lens"][:B].copy_(lens, non_blocking=True)
        return dict(cross_tables=tables, cross_lens=lens)


def _chain_masks(n: int) -> np.ndarray:
    """The tree masks of a chain of `n` tokens: each sees every one before it and itself."""
    return ((np.uint64(2) << np.arange(n, dtype=np.uint64)) - np.uint64(1)).view(np.int64)
