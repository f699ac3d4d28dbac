"""Passes on static buffers, captured as a CUDA graph per padded batch size: the full-depth decode
step, and self-speculation's verify pass.

A decode step launches a few hundred small kernels (SmolLM2: 30 layers of ~10 ops); launched one by
one from Python, the GPU waits on the host. As in vLLM, the step for a batch of B sequences runs
padded to the next capture size P >= B, with every input in a preallocated buffer at a fixed
address (engine.inputs pads the rows and widens the block tables to a width bucket: the attention
kernel plans its context splits by the tables' width), so one CUDA graph per (P, width) holds
the whole step (embedding, every layer, final norm, LM head, fp32 logits) and each later step of
that size replays it after copying its inputs in. The sampler then reads the first B rows of the
static logits.

The same static path runs eagerly where graphs do not exist (the CPU) or are turned off, which is
how the CPU tests check it: same tokens as the plain step, buffers reused, nothing reallocated.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import torch

from eecore import envs
from eecore.engine.inputs import Row, StepInputs
from eecore.engine.sequence import Sequence
from eecore.engine.transfer import device_tensor


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8 (vLLM's schedule, which keeps the
    padding under 8 rows), up to max_batch (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class StaticPass:
    """A pass over a step's rows on static buffers: the batch padded to a capture size P and every
    row to `width` tokens, the pass's output a buffer at a fixed address. `capture=True` (CUDA only)
    records each (P, width)'s pass as a CUDA graph the first time it runs and replays it from then
    on. Subclasses say what the pass computes (`_step`: only kernels on preallocated buffers,
    nothing that allocates, synchronizes or branches on data)."""

    def __init__(self, runner, max_batch: int, capture: bool, sizes: Optional[list[int]] = None):
        """`sizes`: the padded sizes, ascending (default: capture_sizes(max_batch), batch sizes)."""
        if capture and runner.model.device.type != "cuda":
            raise ValueError(f"{type(self).__name__}: CUDA graphs need a CUDA device")
        self.runner = runner
        self.sizes = capture_sizes(max_batch) if sizes is None else sizes
        self.capture = capture
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # (P, table width, then the pass's own: verify width or segment) -> the pass's static output
        self.outputs: dict[tuple, object] = {}
        self.captures = 0  # graphs recorded: a pass that recorded one paid a one-time cost

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def padded_size(self, batch: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def _run_padded(self, rows: list[Row], width: int, continues: bool = False) -> tuple[StepInputs, torch.Tensor]:
        inputs, key = self._build(rows, width, continues)
        return inputs, self._launch(key + (width,), inputs, self._step)

    def _build(self, rows: list[Row], width: int = 1, continues: bool = False) -> tuple[StepInputs, tuple[int, int]]:
        """The rows' inputs padded to a capture size and a table-width bucket, and (P, table width):
        the start of the pass's graph key. `continues`: the rows are likely the last pass's, one
        position further, with nothing scheduled since (a draft chain's next pass): built from that
        pass's arrays where they are (InputBuilder.advance)."""
        builder = self.runner.builder
        P = self.padded_size(len(rows))
        if continues and width == 1:
            advanced = builder.advance(rows, P)
            if advanced is not None:
                inputs, table_width = advanced
                return inputs, (P, table_width)
        table_width = builder.table_width_bucket(rows, width)
        return builder.build(rows, pad_to=P, width=width, table_width=table_width), (P, table_width)

    def _launch(self, key, inputs: StepInputs, step):
        """`step(inputs)`'s output: its graph replayed (captured the first time), or run eagerly."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        elif self.capture:
            self._capture(key, inputs, step)
            self.graphs[key].replay()
        else:
            self.outputs[key] = step(inputs)
        return self.outputs[key]

    def _step(self, inputs: StepInputs) -> torch.Tensor:
        """Every layer, final norm and LM head: fp32 logits of every padded row."""
        return self.runner.logits(self._all_layers(inputs))

    def _all_layers(self, inputs: StepInputs) -> torch.Tensor:
        """Embedding and every layer over the padded rows: the final residual stream."""
        return self._layers(self.runner.embed(inputs), inputs, range(self.runner.num_layers))

    def _layers(self, hidden: torch.Tensor, inputs: StepInputs, layers: range) -> torch.Tensor:
        """`layers` over the padded rows of `hidden`, in place (their work is counted by `_count`,
        on the real rows only)."""
        runner = self.runner
        for i in layers:
            runner.model.layer(i, hidden, inputs.attn, runner.kv.k(i), runner.kv.v(i), runner.ws)
        return hidden

    def _count(self, rows: list[Row], tokens_per_row: int, layers: Optional[range] = None) -> None:
        """Only the real rows' work counts (tests prove with it that no work is repeated)."""
        n = len(rows) if tokens_per_row == 1 else sum(min(len(r.tokens), tokens_per_row) for r in rows)
        for i in layers or range(self.runner.num_layers):
            self.runner.layer_tokens[i] += n

    def _capture(self, key, inputs: StepInputs, step) -> None:
        # One eager run first (on a CUDA side stream: cuBLAS handles and workspaces, lazy module
        # state, as torch.cuda.graphs recommends). A pass that reads state it updates in place (a
        # later early-exit segment continues the residual stream) gets that state back before the
        # recording, so the first replay computes what an eager run would.
        self.captures += 1
        saved = [t.clone() for t in self._state(key)]
        self._warm_up(step, inputs)
        for tensor, before in zip(self._state(key), saved):
            tensor.copy_(before)
        self.graphs[key], self.outputs[key] = self._record(key, step, inputs)

    def _state(self, key) -> list[torch.Tensor]:
        """The tensors the pass of `key` reads and updates in place (none: it starts from its inputs)."""
        return []

    def _warm_up(self, step, inputs: StepInputs) -> None:
        if self.runner.model.device.type != "cuda":
            step(inputs)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(inputs)
        torch.cuda.current_stream().wait_stream(side)

    def _record(self, key, step, inputs: StepInputs):
        """(graph, output): the pass recorded, not run; replaying the graph writes the output."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = step(inputs)
        return graph, output


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

    def run(self, rows: list[Row]) -> tuple[StepInputs, torch.Tensor]:
        inputs, logits = self._run_padded(rows, 1)
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
        logits = self._launch((self.padded_size(len(rows)), table_width, 1), inputs, self._step)
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
    """A self-speculation round's verify pass through every layer (lookup drafts and a draft copy's)
    on static buffers: each sequence's pending token and drafts padded to the round's verify width W,
    so one graph per padded batch holds the pass. `run(rows)`: the logits of every real token, in
    the rows' order (fp32 `[sum of row lengths, V]`). A padded token writes K/V into a slot the
    round reserved past its sequence's drafts, which a later step overwrites before any query
    reads it; its own output is dropped."""

    def __init__(self, runner, max_batch: int, capture: bool, width: int):
        super().__init__(runner, max_batch, capture)
        self.width = width

    def takes(self, rows: list[Row]) -> bool:
        return (0 < len(rows) <= self.max_batch and not self.runner.model.is_encoder_decoder
                and all(1 <= len(r.tokens) <= self.width and r.parents is None for r in rows))

    def run(self, rows: list[Row]) -> torch.Tensor:
        W = self.width
        _, logits = self._run_padded(rows, W)
        self._count(rows, W)
        if all(len(r.tokens) == W for r in rows):
            return logits[: len(rows) * W]
        index = [b * W + k for b, r in enumerate(rows) for k in range(len(r.tokens))]
        return logits.index_select(0, torch.tensor(index, device=logits.device))

    def run_with_tokens(self, rows: list[Row], values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """`run` with some tokens still on the device: `values` (int64, on the device) go to the
        padded pass's token slots `where` (row b's token k is slot b * width + k) behind the inputs'
        copy, on the stream, in place of the rows' placeholders. Returns every row's `width` logits
        rows, padding included (`[len(rows) * width, V]`: picking the real ones out would take an
        index from the host, which waits for the pass)."""
        W = self.width
        inputs, key = self._build(rows, W)
        inputs.token_ids.index_copy_(0, where, values)
        logits = self._launch(key + (W,), inputs, self._step)
        self._count(rows, W)
        return logits[: len(rows) * W]


class StaticLayers(StaticPass):
    """The first `num_layers` layers of the runner's model (default: all) over one token a sequence,
    on static buffers: a draft copy's pass (its E layers), or LayerSkip's draft pass through layers
    0..E-1 of the model itself (writing the shared KV cache). `run(rows)`: the residual stream after
    the last of them `[B, d]` (a view of the runner's workspace); the draft head reads it eagerly.

    `max_width` > 1 also takes rows of up to that many tokens, each pass padded to the next power of
    two (a graph per padded batch and width), returning the state of each row's last token. A draft
    copy catches up that way at the start of a round: on the last draft and the model's token after
    it when verification accepted every draft (a third of the layer preset's first passes), or on a
    round drafted by prompt lookup alone (the hybrid preset's, up to ~15 tokens); without it those
    passes ran op by op.

    `head` (a draft copy's DraftHead): the pass ends with the head, and returns its column logits of
    each row's last token `[B, K]` instead of the states, so that the head's half-dozen kernels are
    in the graph rather than launched one by one after every replay."""

    def __init__(self, runner, max_batch: int, capture: bool, num_layers: Optional[int] = None, max_width: int = 1,
                 head=None):
        super().__init__(runner, max_batch, capture)
        self.layers = range(runner.num_layers if num_layers is None else num_layers)
        self.max_width = max_width
        self.head = head
        model = runner.model
        self._last_rows = torch.zeros(max_batch, dtype=torch.int64, device=model.device)
        self._last_states = torch.empty(max_batch, model.config.hidden_size, dtype=model.dtype, device=model.device)

    def takes(self, rows: list[Row]) -> bool:
        if not (0 < len(rows) <= self.max_batch and all(r.parents is None for r in rows)):
            return False
        width = self._width(rows)
        if width == 1 or width > self.max_width:
            return width == 1
        # the padded pass must fit the runner's workspace, and a shorter row's padding (K/V written
        # past its tokens, into positions nothing has read yet) must lie in its blocks
        builder = self.runner.builder
        bs = builder.block_size
        return (self.padded_size(len(rows)) * width <= builder.max_tokens
                and all(r.start + width <= len(r.seq.block_table) * bs for r in rows))

    def run(self, rows: list[Row], continues: bool = False, one_token_each: bool = False) -> torch.Tensor:
        """Each row's last state `[B, d]` (with `head`: the head's logits of it). `continues`: see
        StaticPass._build. `one_token_each`: the caller knows that every row holds one token (no
        token trees), as `takes` would find (each check walks the rows)."""
        width = 1 if one_token_each else self._width(rows)
        if width == 1:
            _, out = self._run_padded(rows, width, continues)
            self._count(rows, width, self.layers)
            return out[: len(rows)]
        # each row's last token among the padded ones (a padding row's first), copied before the
        # launch (a copy from host memory after it would wait for the pass)
        P = self.padded_size(len(rows))
        self._last_rows[:P].copy_(torch.tensor([b * width + len(r.tokens) - 1 for b, r in enumerate(rows)] +
                                               [b * width for b in range(len(rows), P)]))
        _, out = self._run_padded(rows, width)
        self._count(rows, width, self.layers)
        if self.head is not None:  # the head read the last tokens inside the pass
            return out[: len(rows)]
        return torch.index_select(out, 0, self._last_rows[: len(rows)], out=self._last_states[: len(rows)])

    def run_with_tokens(self, rows: list[Row], tokens: torch.Tensor, continues: bool = False) -> torch.Tensor:
        """`run` over one-token rows whose tokens are still on the device, not read back (`tokens`
        `[B]` int64: the rows' own tokens are placeholders). They go into the pass's inputs behind
        the inputs' copy, on the stream, as decode ahead's do."""
        inputs, key = self._build(rows, 1, continues)
        inputs.token_ids[: len(rows)].copy_(tokens[: len(rows)])
        out = self._launch(key + (1,), inputs, self._step)
        self._count(rows, 1, self.layers)
        return out[: len(rows)]

    def _width(self, rows: list[Row]) -> int:
        longest = max(len(r.tokens) for r in rows)
        if longest == 1 or longest > self.max_width:
            return longest
        return min(1 << (longest - 1).bit_length(), self.max_width)  # a few widths: a few graphs a batch size

    def _step(self, inputs: StepInputs) -> torch.Tensor:
        hidden = self._layers(self.runner.embed(inputs), inputs, self.layers)
        if self.head is None:
            return hidden
        P = inputs.last_rows.shape[0]
        if hidden.shape[0] != P:  # rows of several tokens: each row's last (run sets _last_rows)
            hidden = torch.index_select(hidden, 0, self._last_rows[:P], out=self._last_states[:P])
        return self.head.columns(hidden)


class StaticExitVerify(StaticVerify):
    """LayerSkip's verify pass from the exit-query cache on static buffers: the layer-E states the
    draft passes stored (`exit_states [rows, W, d]`, a buffer at a fixed address) continue through
    layers E..L-1 over every sequence's W positions; positions past a sequence's drafts compute
    what is left there and are dropped, as StaticVerify's padded tokens are. `run(rows)`: the
    logits of every real token, in the rows' order."""

    def __init__(self, runner, max_batch: int, capture: bool, width: int, exit_layer: int,
                 exit_states: torch.Tensor):
        super().__init__(runner, max_batch, capture, width)
        self.exit_layer = exit_layer
        self.exit_states = exit_states

    def _count(self, rows: list[Row], tokens_per_row: int, layers: Optional[range] = None) -> None:
        super()._count(rows, tokens_per_row, range(self.exit_layer, self.runner.num_layers))

    def _step(self, inputs: StepInputs) -> torch.Tensor:
        runner = self.runner
        n = inputs.num_tokens  # padded batch x W
        hidden = runner.ws.hidden[:n]
        hidden.copy_(self.exit_states[: n // self.width].view(n, -1))
        return runner.logits(self._layers(hidden, inputs, range(self.exit_layer, runner.num_layers)))


def maybe_static_decode(runner, max_batch: int, enforce_eager: bool) -> Optional[StaticDecode]:
    """CUDA graphs of the decode step on a CUDA device unless `enforce_eager` (tests/test_engine_cuda.py
    holds them to eager mode there); none on the CPU."""
    if enforce_eager or runner.model.device.type != "cuda":
        return None
    return StaticDecode(runner, max_batch, capture=True)


# EECORE_LAYERSKIP_GRAPHS=0 runs LayerSkip's passes eagerly beside graphed decode steps, to time
# what their graphs gain (tests/test_engine_cuda.py holds the graphs to eager mode on a GPU).


def maybe_static_layerskip(runner, max_batch: int, exit_layer: int, width: int, exit_states: torch.Tensor
                           ) -> tuple[Optional[StaticLayers], Optional[StaticExitVerify]]:
    """LayerSkip's draft passes (layers 0..E-1, one token a sequence) and its verify pass from the
    exit-query cache `exit_states` as CUDA graphs, wherever the decode steps are graphs (unless
    EECORE_LAYERSKIP_GRAPHS=0); (None, None) otherwise."""
    static = runner.static_decode
    if static is None or not envs.flag("EECORE_LAYERSKIP_GRAPHS"):
        return None, None
    return (StaticLayers(runner, max_batch, capture=static.capture, num_layers=exit_layer),
            StaticExitVerify(runner, max_batch, static.capture, width, exit_layer, exit_states))


def maybe_static_verify(runner, max_batch: int, width: int, enforce_eager: bool) -> Optional[StaticVerify]:
    """The same for self-speculation's verify pass of `width` tokens a sequence (none for width 1:
    a strategy without drafts)."""
    if width < 2 or maybe_static_decode(runner, max_batch, enforce_eager) is None:
        return None
    return StaticVerify(runner, max_batch, capture=True, width=width)

