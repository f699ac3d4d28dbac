"""When a sequence is done, and its text: EOS, stop tokens, stop strings, max_tokens, context."""
from __future__ import annotations

from typing import Optional

from eecore.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def detokenize(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def check(self, seq: Sequence) -> Optional[str]:
        """The finish reason after the last appended token, or None to go on. Updates the text
        when stop strings are watched (the text stops before the earliest stop string)."""
        p = seq.params
        token = seq.output_token_ids[-1]
        if p.stop:
            seq.output_text = self.detokenize(seq)
            hits = [(i, s) for s in p.stop if (i := seq.output_text.find(s)) >= 0]
            if hits:
                at, string = min(hits)
                seq.output_text = seq.output_text[:at]
                seq.stop_reason = string
                return "stop"
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            seq.stop_reason = token
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def final_text(self, seq: Sequence) -> str:
        # a stop string already cut the text where it began
        return seq.output_text if isinstance(seq.stop_reason, str) else self.detokenize(seq)
