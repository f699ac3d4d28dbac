"""When a sequence is done, and its text: EOS, stop tokens, stop strings, max_tokens, context."""
from __future__ import annotations

from typing import Optional

from eecore.engine.detokenizer import IncrementalDetokenizer
from eecore.engine.sequence import Sequence
from eecore.engine.tokens import TokenRun


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def detokenize(self, seq: Sequence) -> str:
        """The output's whole text, decoded at once."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def current_text(self, seq: Sequence) -> str:
        """The output's text so far, decoding only the tokens since the last call
        (engine.detokenizer): what stop strings and streaming read after every step."""
        if self.tokenizer is None:
            return ""
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer()
        return seq.detokenizer.update(self.tokenizer, seq.output_token_ids)

    def check(self, seq: Sequence) -> Optional[str]:
        """The finish reason after the last appended token, or None to go on. Updates the text
        when stop strings are watched (the text stops before the earliest stop string)."""
        p = seq.params
        if p.stop:
            seq.output_text = self.current_text(seq)
            # the text's start that this token left unchanged was searched at the last check
            searched = seq.detokenizer.unchanged_length if seq.detokenizer is not None else 0
            hits = [(i, s) for s in p.stop if (i := seq.output_text.find(s, max(0, searched - len(s) + 1))) >= 0]
            if hits:
                at, string = min(hits)
                seq.output_text = seq.output_text[:at]
                seq.stop_reason = string
                return "stop"
        return self._token_reason(seq)

    def append(self, seq: Sequence, tokens) -> Optional[str]:
        """Appends `tokens` (engine.decoding.Token objects, or a TokenRun of ids) to `seq` up to the
        first one that ends it; returns the finish reason, or None to go on. Without stop strings
        that token is found from the ids alone and the rest are appended at once (a
        self-speculation round brings several tokens a sequence, and a GPU waits while the host
        appends them)."""
        run = isinstance(tokens, TokenRun)
        if seq.params.stop:  # stop strings read the text after every token
            for token in tokens:
                if run:
                    seq.append_token(token, tokens.exit_layer)
                else:
                    seq.append_token(token.token_id, token.exit_layer, token.logprobs)
                reason = self.check(seq)
                if reason is not None:
                    return reason
            return None
        p = seq.params
        # tokens until max_tokens or the context is reached
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        # _stops_on, inlined: this runs for every sequence at every step
        stop_ids, eos = p.stop_token_ids, (() if p.ignore_eos else self.eos)
        for i, token in enumerate(tokens):
            token_id = token if run else token.token_id
            if token_id in stop_ids or token_id in eos or i + 1 >= room:
                seq.append_tokens(TokenRun(tokens[: i + 1], tokens.exit_layer) if run else tokens[: i + 1])
                return self._token_reason(seq)
        seq.append_tokens(tokens)
        return None

    def _stops_on(self, p, token: int) -> bool:
        """Whether `token` ends a request with parameters `p` (a stop token, or EOS unless ignored)."""
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos)

    def _token_reason(self, seq: Sequence) -> Optional[str]:
        """The finish reason that `seq`'s last token and length give, or None."""
        p, token = seq.params, seq.output_token_ids[-1]
        if self._stops_on(p, token):
            seq.stop_reason = token
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def final_text(self, seq: Sequence) -> str:
        # a stop string already cut the text where it began
        return seq.output_text if isinstance(seq.stop_reason, str) else self.detokenize(seq)
