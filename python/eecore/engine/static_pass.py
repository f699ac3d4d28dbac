"""The base of every pass on static buffers (StaticPass), and the padded batch sizes they take.

A decode step launches a few hundred small kernels (SmolLM2: 30 layers of ~10 ops); launched one by
one from Python, the GPU waits on the host. As in vLLM, a pass over a batch of B sequences runs
padded to the next capture size P >= B, with every input in a preallocated buffer at a fixed
address (engine.inputs pads the rows and widens the block tables to a width bucket: the attention
kernel plans its context splits by the tables' width), so one CUDA graph per (P, width) holds the
whole pass and each later pass of that size replays it after copying its inputs in.

The passes themselves live with what uses them: the full-depth decode step and verify pass in
engine.static_decode, prefill and mixed steps in engine.piecewise, early exit's segments in
exits.static_segments, self-speculation's draft and exit-state verify passes in
speculative.static_passes.

The same static path runs eagerly where graphs do not exist (the CPU) or are turned off, which is
how the CPU tests check it: same tokens as the plain step, buffers reused, nothing reallocated.
"""
from __future__ import annotations

import bisect
from typing import Optional

import torch

from eecore import envs
from eecore.engine.inputs import Row, StepInputs


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8 (vLLM's schedule, which keeps the
    padding under 8 rows), up to max_batch (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class StaticPass:
    """A pass over a step's rows on static buffers: the batch padded to a capture size P and every
    row to `width` tokens, the pass's output a buffer at a fixed address. `capture=True` (CUDA only)
    records each (P, width)'s pass as a CUDA graph the first time it runs and replays it from then
    on. Subclasses say what the pass computes (`step`: only kernels on preallocated buffers,
    nothing that allocates, synchronizes or branches on data). `step` is what a graph records and
    a replay repeats; a benchmark of the host's part of a step (bench/cost_host.py) replaces it
    on an instance with a buffer that costs nothing."""

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
        # tapped passes (feature drafts' target states): their buffers by tapped layers, the
        # tokens a row holds (a verify pass's width), and whether taps run static at all (else the
        # caller's tapped passes run op by op: EECORE_FEATURE_GRAPHS, until a GPU has timed them)
        self._tapped: dict[tuple[int, ...], torch.Tensor] = {}
        self.tap_width = 1
        self.takes_taps = envs.flag("EECORE_FEATURE_GRAPHS")

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def padded_size(self, batch: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def _run_padded(self, rows: list[Row], width: int, continues: bool = False,
                    tap_points: Optional[tuple[int, ...]] = None,
                    tree: bool = False) -> tuple[StepInputs, torch.Tensor]:
        """The pass over `rows` padded to `width` tokens each; with `tap_points`, a pass of its own
        (a graph of its own) that also copies the streams after those layers into `tapped(points)`;
        `tree`: some rows are token trees (their masks are in other buffers: a graph of its own)."""
        inputs, key = self._build(rows, width, continues)
        key += (width,) + (("tree",) if tree else ())
        if tap_points is None:
            return inputs, self._launch(key, inputs, self.step)
        buffer = self.tapped(tap_points)  # (allocated here, never inside a recording)
        return inputs, self._launch(key + (tap_points,), inputs,
                                    lambda i: self.runner.logits(self._all_layers(i, (tap_points, buffer))))

    def tapped(self, points: tuple[int, ...]) -> torch.Tensor:
        """The pass's own buffer of tapped streams `[max_batch x width, len(points) x d]` (one row a
        padded token, row b * width + k for row b's token k), at a fixed address: what a tapped
        pass's graph writes."""
        buffer = self._tapped.get(points)
        if buffer is None:
            model = self.runner.model
            buffer = self._tapped[points] = torch.empty(
                self.max_batch * self.tap_width, len(points) * model.config.hidden_size, dtype=model.dtype,
                device=model.device)
        return buffer

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

    def step(self, inputs: StepInputs) -> torch.Tensor:
        """Every layer, final norm and LM head: fp32 logits of every padded row."""
        return self.runner.logits(self._all_layers(inputs))

    def _all_layers(self, inputs: StepInputs, tap=None) -> torch.Tensor:
        """Embedding and every layer over the padded rows: the final residual stream (the rows' work
        is counted by `_count`, on the real rows only); `tap` as ModelRunner.run_layers_tapped's."""
        runner = self.runner
        return runner.run_layers_tapped(runner.embed(inputs), inputs.attn, tap, count=False)

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
