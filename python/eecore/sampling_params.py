"""Per-request decoding options (named as in vLLM, so users feel at home)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Sequence, Union


@dataclass
class SamplingParams:
    """How to decode one request.

    temperature 0 is greedy. top_k 0 and top_p 1 disable those filters. `seed` makes a sampled
    request reproducible regardless of what else is in the batch. `stop` strings end the output
    (they are not included in the text); `stop_token_ids` end it too (the token is kept, as EOS
    is). `logprobs=k` returns, per generated token, the log-probabilities of the top-k tokens
    and of the sampled one.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Optional[Union[str, Sequence[str]]] = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop or ())
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        _require(isinstance(self.max_tokens, int) and self.max_tokens > 0, "max_tokens",
                 f"a positive int, got {self.max_tokens!r}")
        _require(self.temperature >= 0.0, "temperature", f">= 0, got {self.temperature!r}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"in (0, 1], got {self.top_p!r}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"an int >= 0, got {self.top_k!r}")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs",
                 f"None or an int >= 0, got {self.logprobs!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _require(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams: '{name}' must be {expected}")
