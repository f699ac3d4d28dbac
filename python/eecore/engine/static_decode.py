"""The full-depth passes on static buffers, captured as a CUDA graph per padded batch size: the
decode step (StaticDecode, with decode ahead: a step launched before its predecessor's tokens are
read back) and the verify pass through every layer (StaticVerify). The graph machinery is
engine.static_pass.

A decode step's graph holds the whole step (embedding, every layer, final norm, LM head, fp32
logits); the sampler then reads the first B rows of the static logits.

StaticVerify stays in the engine although only self-speculation runs it: the engine builds it
(LLMEngine, from the strategy's lookahead, before the strategy exists), beside the decode step
and with the same switches, and the engine may not import eecore.speculative (the package floors,
docs/architecture.md). It is a full-depth pass too: every layer over each sequence's tokens, as
the decode step is over one. Self-speculation's own passes (layers 0..E-1, and the verify pass
that continues from the exit states) are in speculative.static_passes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eecore import envs
from eecore.engine.inputs import Row, StepInputs
from eecore.engine.sequence import Sequence
from eecore.engine.static_pass import StaticPass
from eecore.engine.step_buffers import tap_points
from eecore.engine.transfer import device_tensor


# Decode ahead: a decode step launches the next one before the host reads its tokens back (the
# tokens go from the argmax or the sampler's draw to the next step's inputs on the device), so the
# host's share of a step (reading back, appending, scheduling) runs while the GPU computes the next
# step. On an H200 it gave 1.13-1.21x end to end at batch 1-8 on SmolLM2's and Llama-1B's shapes,
# same tokens (docs/cuda.md), so it is on for a GPU; on the CPU a step runs on the host's own
# threads, nothing overlaps, and a step launched ahead is only lost work when the batch changes.
# LLM(decode_ahead=...) or EECORE_DECODE_AHEAD=1 / 0 forces it either way.
def decode_ahead_enabled(device: torch.device, option: Optional[bool] = None) -> bool:
    """Whether decode steps on `device` launch their successor ahead: `option` (the LLM's) where
    given, else the environment's switch (read at each step, like the kernel selectors), else
    on a GPU only."""
    if option is not None:
        return option
    switch = envs.raw("EECORE_DECODE_AHEAD")
    return switch == "1" if switch is not None else device.type == "cuda"


@dataclass
class AheadStep:
    """A decode step launched before the step it follows was read back: its sequences, their
    positions, and its logits (a static buffer the step's graph writes)."""
    seqs: list[Sequence]
    starts: list[int]
    tables: list[list[int]]  # each sequence's block_table list then (a freed sequence gets a new one)
    blocks: list[int]        # the block each row wrote its K/V into
    logits: torch.Tensor
    tokens: Optional[list[int]] = None  # the tokens it was given, once the host has read them


# EECORE_PREPARE_NEXT_STEP=1: while a decode step's graph runs, the host fills the next step's
# inputs (InputBuilder.prepare_decode), so the next step only writes its tokens before its replay.
# Off: decode ahead, the default on a GPU, prepares its own steps (alone this gave 0.99-1.12x at
# batch 1-8 on an H200; bench/results/nvidia-h200/nvidia-h200-2026-11-27-switches.md).


class StaticDecode(StaticPass):
    """`run(rows)`: the logits `[B, V]` (fp32, a view of a static buffer) of a full-depth decode step
    over `rows` (one token each). `prepare_next(rows)`, called once the step's inputs are no longer
    read on the host, fills the next step's inputs ahead where `prepare` is on (None: where the
    environment switch above is, read at each step as the kernel selectors are)."""

    def __init__(self, runner, max_batch: int, capture: bool, prepare: Optional[bool] = None):
        super().__init__(runner, max_batch, capture)
        self.prepare = prepare
        self.ahead_taken = 0  # steps whose logits came from a step launched ahead (tests read it)

    def takes(self, rows: list[Row]) -> bool:
        """Whether the static step can run these rows: a decode step (one token each, no token
        trees) of at most max_batch sequences, on a decoder-only model."""
        return (0 < len(rows) <= self.max_batch and not self.runner.model.is_encoder_decoder
                and all(len(r.tokens) == 1 and r.parents is None for r in rows))

    def run(self, rows: list[Row], tap=None) -> tuple[StepInputs, torch.Tensor]:
        """`tap` (where `takes_taps`): as ModelRunner.forward's, its `out` filled one row a sequence."""
        inputs, logits = self._run_padded(rows, 1, tap_points=None if tap is None else tap_points(tap))
        if tap is not None:
            tap[1][: len(rows)].copy_(self.tapped(tap_points(tap))[: len(rows)])
        self._count(rows, 1)
        self.runner.mark_computed(rows)
        return inputs, logits[: len(rows)]

    def prepare_next(self, rows: list[Row]) -> None:
        """The inputs of the step after `rows`' (run just now) filled in ahead, if `prepare`. On the
        CPU the step's inputs are those host arrays: call this once they are no longer read."""
        on = envs.flag("EECORE_PREPARE_NEXT_STEP", self.prepare)
        if on:
            self.runner.builder.prepare_decode(rows, self.padded_size(len(rows)))

    def launch_ahead(self, rows: list[Row], tokens: torch.Tensor) -> Optional[AheadStep]:
        """Launches the step after `rows` (run just now) with `tokens` (`[B]` int64 on the device,
        the rows' sampled tokens, not yet read back) as its inputs: the same sequences one position
        further. None where it cannot run yet (a row's next position needs a new block). Its work
        counts, and its rows' K/V counts as computed, only once `take_ahead` takes it."""
        builder = self.runner.builder
        builder.prepare_decode(rows, self.padded_size(len(rows)))
        built = builder.build_prepared_ahead()
        if built is None:
            return None
        inputs, table_width = built
        inputs.token_ids[: len(rows)].copy_(tokens[: len(rows)])  # behind the inputs' copy, on the stream
        logits = self._launch((self.padded_size(len(rows)), table_width, 1), inputs, self.step)
        bs = builder.block_size
        return AheadStep(seqs=[r.seq for r in rows], starts=[r.start + 1 for r in rows],
                         tables=[r.seq.block_table for r in rows],
                         blocks=[r.seq.block_table[(r.start + 1) // bs] for r in rows], logits=logits)

    def take_ahead(self, ahead: AheadStep, rows: list[Row]) -> Optional[torch.Tensor]:
        """The logits `[B, V]` of `rows` from a step launched ahead, if it computed each of them: the
        rows' sequences in the same order (some may have finished since), at the positions it ran,
        with the tokens it was given (the ones the step drew: a sequence appends nothing else), in
        the blocks it wrote their K/V into (a sequence preempted and recomputed since has new ones).
        None otherwise: the caller runs the step (its K/V writes repeat the ahead step's, or land
        in blocks a later step writes before reading)."""
        where = {id(seq): i for i, seq in enumerate(ahead.seqs)}
        bs = self.runner.builder.block_size
        index = []
        for row in rows:
            i = where.get(id(row.seq))
            if i is None or row.start != ahead.starts[i] or len(row.tokens) != 1 or row.parents is not None \
                    or ahead.tokens is None or row.tokens[0] != ahead.tokens[i] or (index and i <= index[-1]):
                return None
            table, block = row.seq.block_table, row.start // bs
            if table is not ahead.tables[i] or len(table) <= block or table[block] != ahead.blocks[i]:
                return None
            index.append(i)
        self._count(rows, 1)
        self.runner.mark_computed(rows)
        self.ahead_taken += 1
        if index == list(range(len(rows))):
            return ahead.logits[: len(rows)]
        return ahead.logits.index_select(0, device_tensor(index, ahead.logits.device))


class StaticVerify(StaticPass):
    """A self-speculation round's verify pass through every layer (lookup drafts, a draft copy's, a
    feature head's) on static buffers: each sequence's pending token and drafts (a chain, or with
    `takes_trees` a token tree) padded to the round's verify width W, so one graph per padded batch
    holds the pass (and one more for passes with trees). `run(rows)`: the logits of every real
    token, in the rows' order (fp32 `[sum of row lengths, V]`). A padded token writes K/V into a slot the
    round reserved past its sequence's drafts, which a later step overwrites before any query
    reads it; its own output is dropped."""

    def __init__(self, runner, max_batch: int, capture: bool, width: int):
        super().__init__(runner, max_batch, capture)
        self.width = self.tap_width = width
        # token trees too (each row's tree masks in the step's buffers; a graph of their own):
        # EECORE_TREE_GRAPHS, until a GPU has timed them
        self.takes_trees = envs.flag("EECORE_TREE_GRAPHS")

    def takes(self, rows: list[Row]) -> bool:
        return (0 < len(rows) <= self.max_batch and not self.runner.model.is_encoder_decoder
                and all(1 <= len(r.tokens) <= self.width and (r.parents is None or self.takes_trees) for r in rows))

    def run(self, rows: list[Row], tap=None) -> torch.Tensor:
        """`tap` (where `takes_taps`): as ModelRunner.forward's, its `out` filled one row a real
        token, in the order of the logits."""
        W = self.width
        _, logits = self._run_padded(rows, W, tap_points=None if tap is None else tap_points(tap),
                                     tree=any(r.parents is not None for r in rows))
        self._count(rows, W)
        tapped = None if tap is None else self.tapped(tap_points(tap))
        if all(len(r.tokens) == W for r in rows):
            if tapped is not None:
                tap[1][: len(rows) * W].copy_(tapped[: len(rows) * W])
            return logits[: len(rows) * W]
        index = torch.tensor([b * W + k for b, r in enumerate(rows) for k in range(len(r.tokens))],
                             device=logits.device)
        if tapped is not None:
            torch.index_select(tapped, 0, index, out=tap[1][: index.shape[0]])
        return logits.index_select(0, index)

    def run_with_tokens(self, rows: list[Row], values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """`run` with some tokens still on the device: `values` (int64, on the device) go to the
        padded pass's token slots `where` (row b's token k is slot b * width + k) behind the inputs'
        copy, on the stream, in place of the rows' placeholders. Returns every row's `width` logits
        rows, padding included (`[len(rows) * width, V]`: picking the real ones out would take an
        index from the host, which waits for the pass)."""
        W = self.width
        inputs, key = self._build(rows, W)
        inputs.token_ids.index_copy_(0, where, values)
        logits = self._launch(key + (W,), inputs, self.step)
        self._count(rows, W)
        return logits[: len(rows) * W]


def maybe_static_decode(runner, max_batch: int, enforce_eager: bool) -> Optional[StaticDecode]:
    """CUDA graphs of the decode step on a CUDA device unless `enforce_eager` (tests/test_engine_cuda.py
    holds them to eager mode there); none on the CPU."""
    if enforce_eager or runner.model.device.type != "cuda":
        return None
    return StaticDecode(runner, max_batch, capture=True)


def maybe_static_verify(runner, max_batch: int, width: int, enforce_eager: bool) -> Optional[StaticVerify]:
    """The same for self-speculation's verify pass of `width` tokens a sequence (none for width 1:
    a strategy without drafts)."""
    if width < 2 or maybe_static_decode(runner, max_batch, enforce_eager) is None:
        return None
    return StaticVerify(runner, max_batch, capture=True, width=width)
