"""Steps built from a prediction rather than from scratch: what InputBuilder (engine.inputs) does
when the step it is asked for is one it could see coming.

A decode step's successor is predictable: the same sequences, each one position further, in the
same blocks unless one crosses into a new block. `prepare_decode` fills the next step's arrays
(all but the tokens, which the GPU has not sampled yet) while the GPU runs the current one;
`build` then checks that the rows are the predicted ones and only writes the tokens and the rows
that gained a block, instead of building the step from scratch while the GPU waits.

Within a self-speculation round nothing is scheduled between a draft chain's passes: each pass
runs the same sequences as the last, one position past the last one's tokens, in blocks the round
reserved. `advance` builds such a pass from the last one's arrays, which already hold every row's
block table, so it touches no row in Python but to read its token (`build` copies each row's
table). The last pass may have held several tokens a row (a draft copy's catch-up at the start of
a round, padded to a width).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from eecore.engine.sequence import Sequence
from eecore.engine.step_buffers import PaddedStep, Row, StepBuffers, StepInputs


@dataclass
class PreparedDecode:
    """A decode step filled in ahead (InputBuilder.prepare_decode): valid for the next `build` of
    the same sequences in the same order, each at `starts`, with block tables that still begin with
    the blocks it read."""
    key: tuple                # the step's buffers: (tokens, rows, table width, trees)
    seqs: list[Sequence]
    tables: list[list[int]]   # each sequence's block_table list (a freed sequence gets a new one)
    table_lens: list[int]     # the blocks each table held
    last_blocks: list[int]    # each table's last block then (a table shrinks and grows at its end)
    starts: list[int]
    buffers: "StepBuffers"


def _positions_among(seqs: list[Sequence], among: list[Sequence]) -> Optional[np.ndarray]:
    """Where each of `seqs` is in `among`, if they are some of its sequences in its order; else None."""
    index, j, end = [], 0, len(among)
    for seq in seqs:
        while j < end and among[j] is not seq:
            j += 1
        if j == end:
            return None
        index.append(j)
        j += 1
    return np.array(index, dtype=np.int64)


class StepPrediction:
    """InputBuilder's predicted steps (module doc): a decode step's successor filled in ahead
    (`prepare_decode`, then taken by `build` or by `build_prepared_ahead`), and a draft chain's next
    pass continued from the last build (`advance`). A mixin of InputBuilder: it uses the builder's
    buffers and helpers (`_buffers`, `_copied`, `_finish`, `_pad`, `_copy_tables`, `_width_bucket`)
    and keeps its state there (`_prepared`, `_last_padded`, `prepared_steps`, `advanced_steps`)."""

    def advance(self, rows: list[Row], pad_to: int) -> Optional[tuple[StepInputs, int]]:
        """The one-token step that follows the last build, padded to `pad_to` rows, and its table
        width (see the module doc): `rows` hold the last build's sequences in its order, or some of
        them (the chains that go on), each with one token at the position after its last one then,
        their block tables unchanged since but for blocks appended. None where the last build was
        no padded step without token trees, the rows are not among its own, or a row's position
        lies past the blocks its table held then: `build` it."""
        last, self._last_padded = self._last_padded, None
        n = len(rows)
        if last is None or not 0 < n <= pad_to or any(len(r.tokens) != 1 or r.parents is not None for r in rows):
            return None
        index = _positions_among([r.seq for r in rows], last.seqs)
        if index is None:
            return None
        # then the rows stay where they are
        same = index.size == len(last.seqs) and pad_to == last.key[1] and last.one_token_each
        bs = self.block_size
        starts = np.fromiter((r.start for r in rows), np.int64, n)
        table_lens = last.table_lens if same else last.table_lens[index]
        block_index = starts // bs
        if not np.array_equal(starts, last.ends if same else last.ends[index]) or (block_index >= table_lens).any():
            return None
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host buffers
        key, buffers = last.key, last.buffers
        if not same:  # the rows that go on, moved up; their tables copied out first (every shape's
            # arrays share the one host buffer)
            tables = buffers.arrays["tables"][index]
            key = (pad_to, pad_to, key[2], False)
            buffers = self._buffers(key)
            h = buffers.arrays
            h["tables"].fill(-1)
            h["tables"][:n] = tables
            h["qsl"][: n + 1] = np.arange(n + 1)
            self._pad(n, pad_to, 1, h)
            h["last"][:pad_to] = np.arange(pad_to)
        h = buffers.arrays
        h["tokens"][:n] = np.fromiter((r.tokens[0] for r in rows), np.int64, n)
        h["positions"][:n] = starts
        h["slots"][:n] = h["tables"][np.arange(n), block_index] * bs + starts % bs
        h["seq_lens"][:n] = starts + 1
        self._last_padded = PaddedStep(key, last.seqs if same else [r.seq for r in rows], starts + 1, table_lens,
                                       buffers)
        self.advanced_steps += 1
        return self._finish(buffers, rows, [1] * n, pad_to, 1), key[2]

    # ---- the next decode step, filled in while the GPU runs this one (module doc) ------------------
    def prepare_decode(self, rows: list[Row], pad_to: int) -> None:
        """Fills the arrays of the static decode step that would follow `rows` (a decode step just
        launched, padded to `pad_to` rows): the same sequences, each one position further, in the
        blocks their tables hold now. The tokens stay for `build`, and so does the slot of a row
        whose next position lies past its table (the scheduler gives it the block first)."""
        self._prepared = self._last_padded = None
        n = len(rows)
        if not 0 < n <= pad_to or self.pad_block < 0 or pad_to > self.max_seqs or \
                any(len(r.tokens) != 1 or r.parents is not None or not r.seq.block_table for r in rows):
            return
        bs = self.block_size
        starts = np.fromiter((r.start + 1 for r in rows), np.int64, n)
        table_lens = np.fromiter((len(r.seq.block_table) for r in rows), np.int64, n)
        inside = starts // bs < table_lens
        most_blocks = int(np.maximum(table_lens, starts // bs + 1).max())
        table_width = self._width_bucket(most_blocks, 1)
        if most_blocks > table_width:
            return
        if self._copied is not None:
            self._copied.synchronize()  # this step's copy has read the host buffers
        key = (pad_to, pad_to, table_width, False)
        buffers = self._buffers(key)
        h = buffers.arrays
        tables = h["tables"]
        tables.fill(-1)
        self._copy_tables(rows, tables)
        h["qsl"][: n + 1] = np.arange(n + 1)
        h["tokens"][:n] = 0
        h["positions"][:n] = starts
        block = tables[np.arange(n), np.minimum(starts // bs, table_lens - 1)]
        h["slots"][:n] = np.where(inside, block.astype(np.int64) * bs + starts % bs, -1)
        h["seq_lens"][:n] = starts + 1
        self._pad(n, pad_to, 1, h)
        h["last"][:pad_to] = h["qsl"][1: pad_to + 1] - 1
        self._prepared = PreparedDecode(
            key=key, seqs=[r.seq for r in rows], tables=[r.seq.block_table for r in rows],
            table_lens=table_lens.tolist(), last_blocks=[r.seq.block_table[-1] for r in rows],
            starts=starts.tolist(), buffers=buffers)

    def build_prepared_ahead(self) -> Optional[tuple[StepInputs, int]]:
        """The prepared step as it stands, before its tokens are known on the host (decode ahead:
        the caller copies them in on the device): its inputs and table width, or None where a row's
        next position lies past its block table. Consumes the prepared step."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        bs = self.block_size
        if any(start // bs >= held for start, held in zip(prepared.starts, prepared.table_lens)):
            return None
        rows = [Row(seq, start, [0]) for seq, start in zip(prepared.seqs, prepared.starts)]
        pad_to, table_width = prepared.key[1], prepared.key[2]
        return self._finish(prepared.buffers, rows, [1] * len(rows), pad_to, 1), table_width

    def _build_prepared(self, prepared: PreparedDecode, rows: list[Row], pad_to: Optional[int],
                        table_width: Optional[int]) -> Optional[StepInputs]:
        """The step from its prepared arrays if `rows` are the predicted ones (else None: build it
        anew): their tokens written, and the rows whose tables grew since given their new blocks."""
        n = len(rows)
        if prepared.key != (pad_to, pad_to, table_width, False) or len(prepared.seqs) != n:
            return None
        bs = self.block_size
        grown = []
        for i, row in enumerate(rows):
            table, held = row.seq.block_table, prepared.table_lens[i]
            if (row.seq is not prepared.seqs[i] or row.start != prepared.starts[i] or len(row.tokens) != 1
                    or row.parents is not None or table is not prepared.tables[i] or len(table) < held
                    or table[held - 1] != prepared.last_blocks[i]):
                return None
            if len(table) != held:
                grown.append(i)
            elif row.start // bs >= held:
                return None  # no block for the row's token: a fresh build names the error
        h = prepared.buffers.arrays
        for i in grown:
            table, start = rows[i].seq.block_table, rows[i].start
            if len(table) > table_width or start // bs >= len(table):
                return None
            h["tables"][i, : len(table)] = table
            h["slots"][i] = table[start // bs] * bs + start % bs
        h["tokens"][:n] = np.fromiter((r.tokens[0] for r in rows), np.int64, n)
        self.prepared_steps += 1
        return self._finish(prepared.buffers, rows, [1] * n, pad_to, 1)
