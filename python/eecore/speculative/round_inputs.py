"""The inputs of every pass of a fused self-speculation round (eecore.speculative.fused_round),
filled on the host in one go and, on a GPU, copied to the device in one copy.

A round of d drafts from a draft copy runs d copy passes and one verify pass over the same
sequences, in blocks the scheduler reserved before the round: where each pass's tokens sit in the
cache is known before the first pass starts. Building each pass when it is launched (as the
op-by-op round does) costs a build and a copy a pass, and on a GPU the host waits for the pass
before to finish reading the buffers it would refill. Here one fill writes them all:

- pass 0 of the copy: two tokens a row, the token before the pending one and the pending one (the
  copy's cache then never needs to be more than one token behind: after a round that accepted every
  draft it has not run the last draft; rewriting a right K/V writes the same values);
- pass k = 1..d-1: draft k, one token a row, at pending + k;
- the verify pass: the pending token and the d drafts, W = d + 1 tokens a row.

Only the draft tokens are unknown on the host; the passes read them from the round's device
buffer of drafts, which the passes before wrote. Rows past the batch, up to the padded size P, are
padding rows in the KV cache's pad block, as engine.inputs pads a static step.

A layout's arrays keep their addresses from round to round (one layout per padded size and table
width), as a captured CUDA graph needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from eecore.engine.inputs import StepInputs
from eecore.engine.sequence import Sequence
from eecore.models.llama import AttentionInputs


@dataclass
class RoundLayout:
    """One (P, table width)'s arrays: `arrays` (numpy, host), `host` / `device` (the same bytes as
    torch tensors), and the StepInputs each pass reads (views of the device side)."""
    P: int
    table_width: int
    arrays: dict[str, np.ndarray]
    host_bytes: torch.Tensor
    device_bytes: Optional[torch.Tensor]
    first: StepInputs             # the copy's pass 0
    chain: list[StepInputs]       # the copy's passes 1..D-1
    verify: dict[int, StepInputs]  # the verify pass by width W = 2..D+1
    padded: tuple = (-1, -1)      # (real rows, W) the padding rows were last written for
    # each row's block table when its row of `tables` was written, and that table's version then
    held: list = None
    versions: list = None

    def __post_init__(self):
        self.held, self.versions = [None] * self.P, [0] * self.P


def _prev_token(seq: Sequence) -> int:
    """The token before the pending one (the last prompt token right after the prefill)."""
    out = seq.output_token_ids
    return out[-2] if len(out) >= 2 else seq.prompt_token_ids[-1]


class RoundInputs:
    def __init__(self, max_batch: int, max_drafts: int, block_size: int, max_blocks: int, pad_block: int,
                 drafts: torch.Tensor, verify_tokens: torch.Tensor, device: torch.device):
        """`drafts` `[D + 1, max_batch]` int64 on the device: row 0 the pending tokens, row k draft k
        (what the copy's passes write); `verify_tokens` `[max_batch * (D + 1)]` int64: the verify
        pass's token ids (its first op copies them out of `drafts`)."""
        if pad_block < 0:
            raise ValueError("RoundInputs: a fused round pads its batch and needs the KV cache's pad block")
        self.max_batch, self.max_drafts = max_batch, max_drafts
        self.block_size, self.max_blocks, self.pad_block = block_size, max_blocks, pad_block
        self.drafts, self.verify_tokens, self.device = drafts, verify_tokens, device
        self._layouts: dict[tuple[int, int], RoundLayout] = {}
        self.layouts_made = 0  # a round that made one paid a one-time cost (as a graph's recording)
        self._offsets = np.arange(-1, max_drafts + 1, dtype=np.int64)  # pass 0's first token .. draft D
        cuda = device.type == "cuda"
        self._copied = torch.cuda.Event() if cuda else None

    def table_width(self, most_blocks: int, width: int) -> int:
        """The tables' width bucket for rows of up to `most_blocks` blocks (engine.inputs.InputBuilder's:
        a power of two of at least 8 blocks, holding a padding row of `width` tokens)."""
        need = max(most_blocks, -(-width // self.block_size), 8)
        return min(1 << (need - 1).bit_length(), self.max_blocks)

    def fill(self, seqs: list[Sequence], P: int, drafts: int) -> Optional[RoundLayout]:
        """Every pass's inputs for `seqs` (padded to P rows) and a round of `drafts` drafts, copied to
        the device; None where a row's last position lies past its block table (a fused round
        writes W positions a row: the caller runs the round op by op)."""
        n, W, bs = len(seqs), drafts + 1, self.block_size
        # one walk over the rows: pending position, blocks, the tokens pass 0 runs
        tables_now = [s.block_table for s in seqs]
        rows = np.array([(s.num_computed_tokens, len(t), _prev_token(s), s.last_token_id)
                         for s, t in zip(seqs, tables_now)], dtype=np.int64)
        starts, table_lens = rows[:, 0], rows[:, 1]
        most = int(table_lens.max())
        table_width = self.table_width(most, W)
        if most > table_width or ((starts + drafts) // bs >= table_lens).any() or (starts < 1).any():
            return None
        layout = self._layout(P, table_width)
        if self._copied is not None:
            self._copied.synchronize()  # the last round's copy has read the host buffers
        h = layout.arrays
        if layout.padded != (n, W):  # rows past the batch (and the verify pass's offsets) as this shape needs
            self._pad(layout, n, W)
        tables = h["tables"]
        held, versions = layout.held, layout.versions
        for b, table in enumerate(tables_now):  # the rows whose block tables changed since this layout held them
            if table is not held[b] or table.version != versions[b]:
                tables[b] = -1
                tables[b, : len(table)] = table.array[: len(table)]
                held[b], versions[b] = table, table.version
        positions = starts[:, None] + self._offsets[: W + 1]  # [n, W + 1]: pending - 1 .. pending + d
        slots = tables[np.arange(n)[:, None], positions // bs] * bs + positions % bs
        # the copy's pass 0: the token before the pending one, and the pending one
        h["first_tokens"].reshape(P, 2)[:n] = rows[:, 2:]
        h["first_positions"].reshape(P, 2)[:n] = positions[:, :2]
        h["first_slots"].reshape(P, 2)[:n] = slots[:, :2]
        h["first_lens"][:n] = starts + 1
        # the copy's passes 1..d-1: draft k at pending + k
        if drafts > 1:
            h["chain_positions"][: drafts - 1, :n] = positions[:, 2: W].T
            h["chain_slots"][: drafts - 1, :n] = slots[:, 2: W].T
            h["chain_lens"][: drafts - 1, :n] = starts + self._offsets[3: W + 1, None]
        # the verify pass: the pending token and the drafts
        h["verify_positions"][: n * W].reshape(n, W)[:] = positions[:, 1:]
        h["verify_slots"][: n * W].reshape(n, W)[:] = slots[:, 1:]
        h["verify_lens"][:n] = starts + W
        if layout.device_bytes is not None:
            layout.device_bytes.copy_(layout.host_bytes, non_blocking=True)
            self._copied.record()
        return layout

    def _pad(self, layout: RoundLayout, n: int, W: int) -> None:
        """Rows n..P-1 of every pass as padding rows in the pad block (engine.inputs pads a static step
        so), and the verify pass's query offsets for W tokens a row: what stays from round to round
        while the batch and the round's width do."""
        h, P, bs = layout.arrays, layout.P, self.block_size
        pad_slots = self.pad_block * bs + np.arange(W) % bs
        h["tables"][n:P] = -1
        h["tables"][n:P, : -(-W // bs)] = self.pad_block
        layout.held[n:P] = [None] * (P - n)
        h["first_tokens"].reshape(P, 2)[n:] = 0
        h["first_positions"].reshape(P, 2)[n:] = (0, 1)
        h["first_slots"].reshape(P, 2)[n:] = pad_slots[:2]
        h["first_lens"][n:] = 2
        h["chain_positions"][:, n:] = 0
        h["chain_slots"][:, n:] = pad_slots[0]
        h["chain_lens"][:, n:] = 1
        h["verify_positions"][n * W: P * W].reshape(P - n, W)[:] = np.arange(W)
        h["verify_slots"][n * W: P * W].reshape(P - n, W)[:] = pad_slots
        h["verify_lens"][n:] = W
        h["verify_qsl"][: P + 1] = np.arange(P + 1) * W
        h["verify_last"][:P] = np.arange(1, P + 1) * W - 1
        layout.padded = (n, W)

    # ---- layouts -------------------------------------------------------------------------------
    def _layout(self, P: int, table_width: int) -> RoundLayout:
        layout = self._layouts.get((P, table_width))
        if layout is None:
            layout = self._layouts[(P, table_width)] = self._make_layout(P, table_width)
            self.layouts_made += 1
        return layout

    def _make_layout(self, P: int, table_width: int) -> RoundLayout:
        D, Wmost = self.max_drafts, self.max_drafts + 1
        chained = max(D - 1, 1)
        spec = (("first_tokens", np.int64, (2 * P,)), ("first_positions", np.int64, (2 * P,)),
                ("first_slots", np.int64, (2 * P,)), ("first_last", np.int64, (P,)),
                ("chain_positions", np.int64, (chained, P)), ("chain_slots", np.int64, (chained, P)),
                ("chain_last", np.int64, (P,)),
                ("verify_positions", np.int64, (P * Wmost,)), ("verify_slots", np.int64, (P * Wmost,)),
                ("verify_last", np.int64, (P,)),
                ("first_lens", np.int32, (P,)), ("first_qsl", np.int32, (P + 1,)),
                ("chain_lens", np.int32, (chained, P)), ("chain_qsl", np.int32, (P + 1,)),
                ("verify_lens", np.int32, (P,)), ("verify_qsl", np.int32, (P + 1,)),
                ("tables", np.int32, (P, table_width)))
        total = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for _, dtype, shape in spec)
        cuda = self.device.type == "cuda"
        host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
        device = torch.empty(total, dtype=torch.uint8, device=self.device) if cuda else None
        arrays, views, offset = {}, {}, 0
        for name, dtype, shape in spec:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            arrays[name] = host.numpy()[offset: offset + nbytes].view(dtype).reshape(shape)
            source = host if device is None else device
            views[name] = source[offset: offset + nbytes].view(torch.int64 if dtype == np.int64 else torch.int32) \
                .view(shape)
            offset += nbytes
        # what no round changes: each pass's query offsets and last rows (the verify pass's depend on W)
        arrays["first_qsl"][:] = np.arange(P + 1) * 2
        arrays["first_last"][:] = np.arange(1, P + 1) * 2 - 1
        arrays["chain_qsl"][:] = np.arange(P + 1)
        arrays["chain_last"][:] = np.arange(P)

        def inputs(tokens, positions, slots, lens, qsl, last, width) -> StepInputs:
            attn = AttentionInputs(positions=positions, slot_mapping=slots, block_table=views["tables"],
                                   seq_lens=lens, query_start_loc=qsl, max_query_len=width)
            return StepInputs(token_ids=tokens, attn=attn, last_rows=last, row_lens=[width] * P)

        first = inputs(views["first_tokens"], views["first_positions"], views["first_slots"], views["first_lens"],
                       views["first_qsl"], views["first_last"], 2)
        chain = [inputs(self.drafts[k, :P], views["chain_positions"][k - 1], views["chain_slots"][k - 1],
                        views["chain_lens"][k - 1], views["chain_qsl"], views["chain_last"], 1) for k in range(1, D)]
        verify = {W: inputs(self.verify_tokens[: P * W], views["verify_positions"][: P * W],
                            views["verify_slots"][: P * W], views["verify_lens"], views["verify_qsl"],
                            views["verify_last"], W) for W in range(2, Wmost + 1)}
        return RoundLayout(P, table_width, arrays, host, device, first, chain, verify)
