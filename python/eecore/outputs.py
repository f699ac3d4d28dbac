"""What `LLM.generate` returns (one per prompt) and what streaming yields (one per new tokens)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestOutput:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    # per generated token: the layers that ran for it (L = full depth; docs/architecture.md, "Exit layers")
    exit_layers: list[int]
    # per generated token, when SamplingParams.logprobs is set: {token_id: logprob}
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RequestDelta:
    """New tokens of one request since its previous delta (streaming)."""
    index: int                 # the prompt's position in the generate call
    token_ids: list[int]
    text: str
    exit_layers: list[int]
    finished: bool
    finish_reason: Optional[str] = None
    # per new token, when SamplingParams.logprobs is set: {token_id: logprob}
    logprobs: Optional[list[dict[int, float]]] = None
    # on the last delta of a request, when the streamer asked for them: as RequestOutput.metrics
    metrics: Optional[dict[str, float]] = None
