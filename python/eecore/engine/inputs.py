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

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from eecore.engine.sequence import Sequence
from eecore.models.llama import AttentionInputs
from eecore.models.workspace import RowViewCache


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


@dataclass
class PaddedStep:
    """The last `build` when it was a padded step without token trees (InputBuilder.advance)."""
    key: tuple                # its buffers: (tokens, rows, table width, trees)
    seqs: list[Sequence]
    ends: np.ndarray          # each row's position after its last token
    table_lens: np.ndarray    # the blocks each row's table held (what the buffers' tables hold)
    buffers: "StepBuffers"

    @property
    def one_token_each(self) -> bool:
        return self.key[0] == self.key[1]


class StepBuffers:
    """One step shape's arrays, packed one after another at the start of the builder's buffer
    (int64 arrays first, so that each starts aligned): `arrays` (numpy, filled by the host),
    `host` (the same memory as torch tensors), and on a GPU `device` (the same layout in the device
    buffer), which one copy of `host_bytes` into `device_bytes` fills. A shape's tensors keep their
    addresses from one step to the next, as a captured CUDA graph needs."""

    # The token arrays come first: their addresses then depend on the token count alone, which
    # piecewise graphs (keyed by tokens, not sequences) rely on.
    LAYOUT = (("tokens", np.int64), ("positions", np.int64), ("slots", np.int64), ("last", np.int64),
              ("tree", np.int64), ("seq_lens", np.int32), ("qsl", np.int32), ("tables", np.int32))

    def __init__(self, host: torch.Tensor, device: Optional[torch.Tensor], T: int, B: int, table_width: int,
                 has_tree: bool):
        shapes = self.shapes(T, B, table_width, has_tree)
        self.arrays: dict[str, np.ndarray] = {}
        self.host: dict[str, torch.Tensor] = {}
        self.device: Optional[dict[str, torch.Tensor]] = None if device is None else {}
        host_np, offset = host.numpy(), 0
        for name, dtype in self.LAYOUT:
            shape = shapes[name]
            if shape is None:
                continue
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.arrays[name] = host_np[offset: offset + nbytes].view(dtype).reshape(shape)
            self.host[name] = torch.from_numpy(self.arrays[name])
            if device is not None:
                self.device[name] = device[offset: offset + nbytes].view(_TORCH_DTYPES[dtype]).view(shape)
            offset += nbytes
        self.host_bytes = host[:offset]
        self.device_bytes = None if device is None else device[:offset]

    @staticmethod
    def shapes(T: int, B: int, table_width: int, has_tree: bool) -> dict[str, Optional[tuple]]:
        return dict(tokens=(T,), positions=(T,), slots=(T,), last=(B,), tree=(T,) if has_tree else None,
                    seq_lens=(B,), qsl=(B + 1,), tables=(B, table_width))

    @classmethod
    def nbytes_of(cls, max_tokens: int, max_seqs: int, max_blocks: int, has_tree: bool) -> int:
        shapes = cls.shapes(max_tokens, max_seqs, max_blocks, has_tree)
        return sum(int(np.prod(shapes[name])) * np.dtype(dtype).itemsize
                   for name, dtype in cls.LAYOUT if shapes[name] is not None)


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


class InputBuilder:
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
        (bench/host_overhead.py). The tensors returned are valid until the next `build`."""
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
        if padded_T > T:
            h["tokens"][T:padded_T] = 0
            h["positions"][T:padded_T] = 0
            h["slots"][T:padded_T] = self.pad_block * bs + np.arange(padded_T - T) % bs
        h["last"][:B] = qsl[1: B + 1] - 1
        if pad_to is not None and padded_T == T and not has_tree:
            self._last_padded = PaddedStep((padded_T, B, table_width, has_tree), [r.seq for r in rows],
                                           starts + np.array(real, dtype=np.int64), table_lens, buffers)
        return self._finish(buffers, rows, lens, B, width)

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
            lo, n = int(qsl[b]), int(qsl[b + 1] - qsl[b])
            if row.parents is not None:
                if len(row.parents) != n:
                    raise ValueError(f"Row.parents: {len(row.parents)} parents for {n} tokens")
                depths, tree[lo: lo + n] = tree_depths_and_masks(row.parents)
                positions[lo: lo + n] = row.start + depths
            else:
                if n > MAX_TREE_TOKENS:
                    raise ValueError(f"a step with token trees takes rows of at most {MAX_TREE_TOKENS} tokens, "
                                     f"got {n}")
                tree[lo: lo + n] = ((np.uint64(2) << np.arange(n, dtype=np.uint64)) - np.uint64(1)).view(np.int64)

    def _check_padding(self, rows: list[Row], pad_to: int, width: int) -> None:
        if self.pad_block < 0:
            raise RuntimeError("InputBuilder: padding needs the KV cache's pad block")
        if pad_to < len(rows) or any(not 1 <= len(r.tokens) <= width or r.parents is not None for r in rows):
            raise ValueError(f"InputBuilder: padding to {pad_to} rows of {width} tokens takes at most that many "
                             f"rows of 1 to {width} tokens each (no token trees), got {len(rows)} rows")

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
