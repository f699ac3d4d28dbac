"""What a decode step returns, and the full-depth decode step every other strategy builds on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eecore.engine.inputs import Row
from eecore.engine.runner import ModelRunner
from eecore.engine.sampler import Sampler
from eecore.engine.sequence import Sequence


@dataclass
class Token:
    token_id: int
    exit_layer: int                               # layers that ran for it (L is full depth)
    logprobs: Optional[dict[int, float]] = None


class DecodeStrategy:
    """One model iteration for every running sequence; returns the tokens each one gained.

    `lookahead` is how many KV slots past the pending token a step may write (1 here; d + 1 for
    self-speculation), so the scheduler reserves them.
    """

    lookahead = 1

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler
        self.num_layers = runner.num_layers

    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        raise NotImplementedError

    def release(self, seq: Sequence) -> None:
        """Drop any per-sequence state once `seq` finished."""

    def metrics(self, seq: Sequence) -> dict[str, float]:
        """Strategy-specific per-request metrics (merged into the output's metrics)."""
        return {}


class FullDepthDecoder(DecodeStrategy):
    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        return self.step(seqs)[0]

    def step(self, seqs: list[Sequence], tap=None) -> tuple[list[list[Token]], torch.Tensor]:
        """The step's tokens and its fp32 logits `[B, V]`; `tap` as in ModelRunner.forward."""
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs]
        inputs, hidden = self.runner.forward(rows, tap)
        logits = self.runner.logits(hidden)
        tokens, logprobs = self.sampler.sample(logits, seqs)
        return [[Token(t, self.num_layers, lp)] for t, lp in zip(tokens, logprobs)], logits
