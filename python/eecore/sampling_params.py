"""Per-request decoding options (named as in vLLM, so users feel at home)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence, Union

# Temperatures below this sample the argmax (vLLM's rule): dividing logits by a tinier one
# overflows fp32 into inf - inf = NaN.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 100.0       # past it every token is as likely as any other: a mistake, not a choice
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.Generator.manual_seed takes
MAX_STOP_STRINGS = 16         # stop strings are searched in every step's new text: bounded work
MAX_STOP_CHARS = 1024         # their total length


@dataclass
class SamplingParams:
    """How to decode one request.

    temperature 0 (or below 1e-5) is greedy; at most 100. top_k 0 and top_p 1 disable those
    filters (a top_k past the vocabulary keeps it all). `seed` (any int torch takes) makes a sampled
    request reproducible regardless of what else is in the batch. `stop` strings (at most 16, 1024
    characters in all) end the output (they are not included in the text); `stop_token_ids` end it
    too (the token is kept, as EOS is). `logprobs=k` returns, per generated token, the
    log-probabilities of the top-k tokens and of the sampled one.
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
        _require(_is_int(self.max_tokens) and self.max_tokens > 0, "max_tokens",
                 f"a positive int, got {self.max_tokens!r}")
        _require(_is_real(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
                 f"a finite number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        _require(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"an int >= 0, got {self.top_k!r}")
        _require(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
                 "seed", f"None or an int in [-2**63, 2**64 - 1], got {self.seed!r}")
        _require(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
                 f"None or an int >= 0, got {self.logprobs!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        _require(len(self.stop) <= MAX_STOP_STRINGS and sum(len(s) for s in self.stop) <= MAX_STOP_CHARS, "stop",
                 f"at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all, got "
                 f"{len(self.stop)} of {sum(len(s) for s in self.stop)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _require(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams: '{name}' must be {expected}")
