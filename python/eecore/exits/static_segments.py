"""Early exit's decode iteration on static buffers (the seed's batch rule "all", or a static exit
layer), as CUDA graphs: one per padded batch size and *segment*, the layers between two checks
together with the check that ends them (the confidence measure and `accept_update`). Between two
segments only the check's count of unconfident rows reaches the host, which decides whether the
next segment runs; with a static exit layer the iteration is one segment. The last segment also
computes the logits at its end (where no exit adapter reads them instead), as the full-depth step's
graph does: an iteration that runs to its end needs no eager launch before sampling.

Padded rows are inactive: `accept_update` never counts them, so they cannot hold the batch back,
and their K/V lands in the KV cache's pad block. The kv fill of the skipped layers, and the logits
of an iteration that stopped at a check, run eagerly after the last segment, over the real rows.
"""
from __future__ import annotations

from typing import Optional

import torch

from eecore import ops
from eecore.engine.inputs import Row, StepInputs
from eecore.engine.sequence import Sequence
from eecore.engine.static_pass import StaticPass


class StaticExitSegments(StaticPass):
    def __init__(self, decoder, max_batch: int, capture: bool):
        super().__init__(decoder.runner, max_batch, capture)
        self.decoder = decoder
        L = self.runner.num_layers
        if decoder.measure is None:  # a static exit: one segment, no check
            ends, checked = [decoder.config.exit_layer], [False]
        else:
            checks = sorted(decoder.checks)
            ends, checked = checks + [L], [True] * len(checks) + [False]
        # (first layer, layer after the last, whether a check ends it)
        self.segments = [(start, end, c) for start, end, c in zip([0] + ends[:-1], ends, checked)]
        self.final_logits = decoder._head_layer(ends[-1]) is None  # the last segment's graph holds them

    def takes(self, rows: list[Row]) -> bool:
        return (0 < len(rows) <= self.max_batch and not self.runner.model.is_encoder_decoder
                and all(len(r.tokens) == 1 for r in rows))

    def run(self, seqs: list[Sequence], rows: list[Row]
            ) -> tuple[StepInputs, torch.Tensor, int, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The iteration over `rows` (one per sequence): its inputs, the residual stream of the real
        rows where they exited `[B, d]`, the exit layer (L: none), the top-1 tokens of the exiting
        check where the measure gives them, and the real rows' logits `[B, V]` where the last
        segment ran and computed them."""
        dec, B = self.decoder, len(rows)
        P = self.padded_size(B)
        inputs, key = self._build(rows)
        dec._status[:P].zero_()
        dec._wasted[:P].zero_()
        dec._active[:P].fill_(True)
        dec._active[B:P].fill_(False)
        dec.thresholds.start_iteration(seqs, num_rows=P)
        if dec.measure is not None:
            dec.measure.start_iteration(seqs, num_rows=P)
        for j, (start, end, checked) in enumerate(self.segments):
            remaining, top1, logits = self._launch(key + (j,), inputs, lambda inp, j=j: self._segment(j, inp))
            self._count(rows, 1, range(start, end))
            if checked and int(remaining) == 0:  # the one host sync of a check
                return inputs, self.runner.hidden_workspace(B), end, top1, None
        return inputs, self.runner.hidden_workspace(B), self.segments[-1][1], None, None if logits is None else logits[:B]

    def _state(self, key) -> list[torch.Tensor]:
        P = key[0]
        return [self.runner.hidden_workspace(P), self.decoder._status[:P], self.decoder._wasted[:P]]

    def _segment(self, j: int, inputs: StepInputs):
        """Layers start..end-1 and the check at `end` over the padded rows: kernels on static
        buffers only. Returns the check's count of unconfident rows, the measure's top-1, and
        (the last segment) the logits at its end."""
        start, end, checked = self.segments[j]
        dec, runner = self.decoder, self.runner
        P = inputs.attn.seq_lens.shape[0]
        hidden = runner.embed(inputs) if start == 0 else runner.hidden_workspace(P)
        status, wasted = dec._status[:P], dec._wasted[:P]
        previous = None

        def before(i: int) -> None:  # the check's bookkeeping before layer i, i.e. at exit layer E = i + 1
            nonlocal wasted, previous
            wasted += status  # rows already confident run this layer for nothing
            previous = dec._remember(hidden, i + 1)

        runner.run_layers(hidden, inputs.attn, start, end, count=False,
                          before=None if dec.measure is None else before)
        if not checked:
            last = j == len(self.segments) - 1
            return None, None, runner.logits(hidden) if last and self.final_logits else None
        confidence = dec.measure(end, hidden, previous)
        remaining = ops.accept_update(status, confidence, dec.thresholds.at(end), dec._active[:P])
        return remaining, getattr(dec.measure, "top1", None), None
