"""The full-depth decode step on static buffers, captured as a CUDA graph per padded batch size.

A decode step launches a few hundred small kernels (SmolLM2: 30 layers of ~10 ops); launched one by
one from Python, the GPU waits on the host. As in vLLM, the step for a batch of B sequences runs
padded to the next capture size P >= B, with every input in a preallocated buffer at a fixed
address (engine.inputs pads the rows and widens the block tables), so one CUDA graph per P holds
the whole step (embedding, every layer, final norm, LM head, fp32 logits) and each later step of
that size replays it after copying its inputs in. The sampler then reads the first B rows of the
static logits.

The same static path runs eagerly where graphs do not exist (the CPU) or are turned off, which is
how the CPU tests check it: same tokens as the plain step, buffers reused, nothing reallocated.
"""
from __future__ import annotations

import bisect
import os
from typing import Optional

import torch

from eecore.engine.inputs import Row, StepInputs


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8 (vLLM's schedule, which keeps the
    padding under 8 rows), up to max_batch (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class StaticDecode:
    """`run(rows)`: the logits `[B, V]` (fp32, a view of a static buffer) of a full-depth decode step
    over `rows` (one token each). `capture=True` (CUDA only) records each padded size's step as a
    CUDA graph the first time it runs and replays it from then on."""

    def __init__(self, runner, max_batch: int, capture: bool):
        if capture and runner.model.device.type != "cuda":
            raise ValueError("StaticDecode: CUDA graphs need a CUDA device")
        self.runner = runner
        self.sizes = capture_sizes(max_batch)
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._logits: dict[int, torch.Tensor] = {}  # P -> the step's logits [P, V] (a static buffer)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def takes(self, rows: list[Row]) -> bool:
        """Whether the static step can run these rows: a decode step (one token each, no token
        trees) of at most max_batch sequences, on a decoder-only model."""
        return (0 < len(rows) <= self.max_batch and not self.runner.model.is_encoder_decoder
                and all(len(r.tokens) == 1 and r.parents is None for r in rows))

    def padded_size(self, batch: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def run(self, rows: list[Row]) -> tuple[StepInputs, torch.Tensor]:
        runner = self.runner
        size = self.padded_size(len(rows))
        inputs = runner.builder.build(rows, pad_to=size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        elif self.capture:
            self._capture(size, inputs)
            self.graphs[size].replay()
        else:
            self._logits[size] = self._step(inputs)
        B = len(rows)
        for i in range(runner.num_layers):
            runner.layer_tokens[i] += B
        for row in rows:
            row.seq.num_computed_tokens = max(row.seq.num_computed_tokens, row.start + 1)
        return inputs, self._logits[size][:B]

    def _step(self, inputs: StepInputs) -> torch.Tensor:
        """Embedding, every layer, final norm and LM head over the padded rows: only kernels on
        preallocated buffers (nothing here allocates, synchronizes or branches on data)."""
        runner = self.runner
        model = runner.model
        hidden = runner.embed(inputs)
        for i in range(runner.num_layers):
            model.layer(i, hidden, inputs.attn, runner.kv.k(i), runner.kv.v(i), runner.ws)
        return runner.logits(hidden)

    def _capture(self, size: int, inputs: StepInputs) -> None:
        # One eager run on a side stream first (cuBLAS handles and workspaces, lazy module state),
        # as torch.cuda.graphs recommends; it computes what the replay will: the same K/V into the
        # same slots.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._logits[size] = self._step(inputs)
        self.graphs[size] = graph


# The graphs have not yet run on a GPU (tests/test_engine_cuda.py holds them to eager mode there):
# until they have, they are opt-in with EECORE_CUDA_GRAPHS=1, and the plain step stays the default.
GRAPHS_ENV = "EECORE_CUDA_GRAPHS"


def maybe_static_decode(runner, max_batch: int, enforce_eager: bool) -> Optional[StaticDecode]:
    """CUDA graphs of the decode step on a CUDA device (with EECORE_CUDA_GRAPHS=1, for now) unless
    `enforce_eager`; none on the CPU."""
    if enforce_eager or runner.model.device.type != "cuda" or os.environ.get(GRAPHS_ENV) != "1":
        return None
    return StaticDecode(runner, max_batch, capture=True)
