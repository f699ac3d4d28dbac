"""What a decode step gives a sequence: its new tokens, as Token objects (an id, the layers that ran
for it, its log-probabilities where asked) or as a TokenRun (ids of one exit layer). A leaf module:
the sequence's stop checks read them as the strategies write them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(slots=True)
class Token:
    token_id: int
    exit_layer: int                               # layers that ran for it (L is full depth)
    logprobs: Optional[dict[int, float]] = None


class TokenRun(list):
    """A sequence's new tokens of one exit layer without log-probabilities, as their ids: what a
    strategy may return instead of Token objects (a fused self-speculation round gives each of its
    sequences up to d + 1 tokens, and a Token object each cost the host more than the append)."""

    __slots__ = ("exit_layer",)

    def __init__(self, token_ids, exit_layer: int):
        super().__init__(token_ids)
        self.exit_layer = exit_layer
