"""Any step's pass through every layer with everything but attention captured as CUDA graphs:
prefill chunks, and decodes with prompt chunks beside them (mixed steps).

A decode step has one shape per padded batch size, so engine.static_decode captures it whole. A
step that carries prompt chunks has query runs of any length, which the paged attention kernel
sizes its grid by, so as in vLLM's piecewise graphs only the token-wise work is captured: the
step's tokens are padded to a bucket size P (token_buckets), and for each P one graph per
*piece* holds what lies between two attentions (the embedding and layer 0 up to its attention;
layer i's output projection and MLP with layer i+1 up to its attention; the last layer's output
projection and MLP). Attention runs eagerly between the pieces, over the real tokens. A step then
launches L + 1 graphs and L attention kernels instead of ~10 kernels a layer.

Padding tokens belong to no sequence: they sit at position 0 and write their K/V into the KV
cache's pad block, and attention never reads them. Their rows of the residual stream are dropped.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from eecore import envs
from eecore.engine.inputs import Row, StepInputs
from eecore.engine.static_pass import StaticPass


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: 8, 16, 24, 32, 48, 64, 96, 128, 192, ... (powers of two and 1.5 times
    them, so that padding stays under a third of a step) below max_tokens, then max_tokens."""
    sizes = {8, 16}
    p = 16
    while p < max_tokens:
        sizes.update((p, p * 3 // 2))
        p *= 2
    return sorted(s for s in sizes if s < max_tokens) + [max_tokens]


class PiecewiseForward(StaticPass):
    """`run(rows)`: every layer over `rows` (each any number of tokens, no token trees), as
    ModelRunner.forward computes it: the step's inputs and the residual stream `[T, d]` of its
    real tokens."""

    def __init__(self, runner, max_tokens: int, capture: bool):
        super().__init__(runner, max_tokens, capture, sizes=token_buckets(max_tokens))  # padded token counts

    def takes(self, rows: list[Row]) -> bool:
        return (bool(rows) and not self.runner.model.is_encoder_decoder and self.runner.builder.pad_block >= 0
                and all(r.parents is None for r in rows)
                and sum(len(r.tokens) for r in rows) <= self.sizes[-1])

    def run(self, rows: list[Row]) -> tuple[StepInputs, torch.Tensor]:
        runner, L = self.runner, self.runner.num_layers
        T = sum(len(r.tokens) for r in rows)
        P = self.padded_size(T)
        inputs = runner.builder.build(rows, pad_tokens_to=P)
        hidden = None
        for piece in range(L + 1):
            hidden = self._launch((P, piece), inputs, functools.partial(self._piece, piece))
            if piece < L:
                runner.model.layer_attention(inputs.attn, runner.kv.k(piece), runner.kv.v(piece), runner.ws, T)
        for i in range(L):
            runner.layer_tokens[i] += T
        runner.mark_computed(rows)
        return inputs, hidden[:T]

    def _piece(self, piece: int, inputs: StepInputs) -> torch.Tensor:
        """The kernels between attention `piece - 1` and attention `piece`, over the padded tokens."""
        runner = self.runner
        if piece == 0:
            hidden = runner.embed(inputs)
        else:
            hidden = runner.ws.hidden[: inputs.num_tokens]
            runner.model.layer_output(piece - 1, hidden, runner.ws)
        if piece < runner.num_layers:
            runner.model.layer_qkv(piece, hidden, inputs.attn, runner.kv.k(piece), runner.kv.v(piece), runner.ws)
        return hidden

    def _state(self, key) -> list[torch.Tensor]:
        return [self.runner.ws.hidden[: key[0]]]  # a piece adds its layer's output to the residual stream


def maybe_piecewise(runner, enforce_eager: bool) -> Optional[PiecewiseForward]:
    """Piecewise graphs of the varlen passes on a CUDA device, for decoder-only models, unless
    `enforce_eager` or EECORE_PIECEWISE_GRAPHS=0; none on the CPU."""
    if (enforce_eager or runner.model.device.type != "cuda" or runner.model.is_encoder_decoder
            or not envs.flag("EECORE_PIECEWISE_GRAPHS")):
        return None
    return PiecewiseForward(runner, runner.builder.max_tokens, capture=True)
