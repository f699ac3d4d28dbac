"""Self-speculation's passes on static buffers (CUDA graphs on a GPU), which only its strategy
builds and runs: StaticLayers (a draft pass through layers 0..E-1 of the model, or through a
draft copy's E layers with its draft head), StaticFeatureSteps (a feature head's draft steps) and
StaticExitVerify (LayerSkip's verify pass from the exit-query cache through layers E..L-1). The
full-depth verify pass, StaticVerify, which the engine builds, is in engine.static_decode; the
graph machinery is engine.static_pass.
"""
from __future__ import annotations

from typing import Optional

import torch

from eecore import envs
from eecore.engine.inputs import Row, StepInputs
from eecore.engine.static_decode import StaticVerify
from eecore.engine.static_pass import StaticPass


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
        runner = self.runner
        bs = runner.block_size
        return (self.padded_size(len(rows)) * width <= runner.max_tokens
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
        out = self._launch(key + (1,), inputs, self.step)
        self._count(rows, 1, self.layers)
        return out[: len(rows)]

    def _width(self, rows: list[Row]) -> int:
        longest = max(len(r.tokens) for r in rows)
        if longest == 1 or longest > self.max_width:
            return longest
        return min(1 << (longest - 1).bit_length(), self.max_width)  # a few widths: a few graphs a batch size

    def step(self, inputs: StepInputs) -> torch.Tensor:
        hidden = self.runner.run_layers(self.runner.embed(inputs), inputs.attn, self.layers.start, self.layers.stop,
                                        count=False)
        if self.head is None:
            return hidden
        P = inputs.last_rows.shape[0]
        if hidden.shape[0] != P:  # rows of several tokens: each row's last (run sets _last_rows)
            hidden = torch.index_select(hidden, 0, self._last_rows[:P], out=self._last_states[:P])
        return self.head.columns(hidden)


class StaticFeatureSteps(StaticPass):
    """A feature head's draft steps (eecore.speculative.feature_drafts) on static buffers: step k
    over a padded batch of P windows is a pass (a graph) of its own, keyed (P, k), reading the
    target's tapped states and the steps' tokens from buffers at fixed addresses and its window so
    far from step k - 1's outputs. The host fills `features` and `tokens[0]` for the first n rows,
    then each later step's tokens (the drafts picked from the step before), and reads each step's
    logits. Padded rows and rows that stopped drafting compute on unread, so a step's shapes are
    its batch's whatever the drafts; the head has no cache, so nothing they write lasts."""

    def __init__(self, runner, head, max_batch: int, max_steps: int, capture: bool):
        super().__init__(runner, max_batch, capture)
        self.head = head  # a FeatureDraftHead: start, step, taps
        model = runner.model
        self.max_steps = max_steps
        self.features = torch.zeros(max_batch, len(head.taps) * model.config.hidden_size, dtype=model.dtype,
                                    device=model.device)
        self.tokens = torch.zeros(max_steps, max_batch, dtype=torch.int64, device=model.device)

    def run(self, n: int, k: int) -> torch.Tensor:
        """Step k of the first `n` rows: their fp32 logits over the draft vocabulary `[n, K]` (a view)."""
        P = self.padded_size(n)
        return self._launch((P, k), (P, k), self.step)[1][:n]

    def step(self, key: tuple[int, int]):
        P, k = key
        if k == 0:
            state, window = self.head.start(self.features[:P]), None
        else:
            state, _, keys, values = self.outputs[P, k - 1]  # the outputs step k - 1's graph writes
            window = (keys, values)
        state, logits, (keys, values) = self.head.step(state, self.tokens[k, :P], window)
        return state, logits, keys, values


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

    def step(self, inputs: StepInputs) -> torch.Tensor:
        runner = self.runner
        n = inputs.num_tokens  # padded batch x W
        hidden = runner.hidden_workspace(n)
        hidden.copy_(self.exit_states[: n // self.width].view(n, -1))
        return runner.logits(runner.run_layers(hidden, inputs.attn, self.exit_layer, runner.num_layers, count=False))


# EECORE_LAYERSKIP_GRAPHS=0 runs LayerSkip's passes eagerly beside graphed decode steps, to time
# what their graphs gain (tests/test_engine_cuda.py holds the graphs to eager mode on a GPU).


def maybe_static_layerskip(runner, max_batch: int, exit_layer: int, width: int, exit_states: torch.Tensor
                           ) -> tuple[Optional[StaticLayers], Optional[StaticExitVerify]]:
    """LayerSkip's draft passes (layers 0..E-1, one token a sequence) and its verify pass from the
    exit-query cache `exit_states` as CUDA graphs, wherever the decode steps are graphs (unless
    EECORE_LAYERSKIP_GRAPHS=0); (None, None) otherwise."""
    capture = runner.graph_capture
    if capture is None or not envs.flag("EECORE_LAYERSKIP_GRAPHS"):
        return None, None
    return (StaticLayers(runner, max_batch, capture=capture, num_layers=exit_layer),
            StaticExitVerify(runner, max_batch, capture, width, exit_layer, exit_states))
