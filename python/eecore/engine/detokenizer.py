"""A sequence's output text kept up to date token by token, at a cost that does not grow with it.

Decoding the whole output after every step (for stop strings, for streaming) costs time in its
length: ~0.14 us a token for SmolLM2's tokenizer, so 32 streams of 2,000 tokens spent ~9 ms a
step on it. Only the last few tokens are decoded here. A token's text depends on its neighbours
(a byte-level token may hold part of a character; a SentencePiece decoder drops the space that
opens the decoded string), so the tail is decoded together with a few tokens before it and
that prefix's own text is cut off again: the text of tokens [prefix, read) was already added, and
decode(ids[prefix:]) minus decode(ids[prefix:read]) is what the newer tokens add. The tail is
added for good once it ends in a whole character and not in a byte-fallback token (whose run a
following byte token can still turn into U+FFFD, as a whole); until then it is shown as the full
decode would show it but decoded again at the next step.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self):
        self._committed = ""   # text of ids[:read]
        self._prefix = 0       # where the decoded window starts (a token before read, for context)
        self._read = 0         # ids before it are in _committed
        self._text = ""
        # characters at the start of the text that the last update left as they were
        self.unchanged_length = 0

    def update(self, tokenizer, ids: list[int]) -> str:
        """The text of `ids` (the same list as before, with tokens appended) as
        `tokenizer.decode(ids, skip_special_tokens=True)` gives it (`tokenizer`: an
        eecore.models.Tokenizer, or anything with its `decode` and `byte_token_ids`)."""
        if len(ids) == self._read:
            self.unchanged_length = len(self._text)
            return self._text
        self.unchanged_length = len(self._committed)
        before = tokenizer.decode(ids[self._prefix: self._read], skip_special_tokens=True)
        window = tokenizer.decode(ids[self._prefix:], skip_special_tokens=True)
        if not window.startswith(before):  # a decoder that rewrites across the boundary: start over
            self._committed, self._prefix, self._read, self.unchanged_length = "", 0, 0, 0
            before, window = "", tokenizer.decode(ids, skip_special_tokens=True)
        tail = window[len(before):]
        self._text = self._committed + tail
        if not tail.endswith("\ufffd") and ids[-1] not in getattr(tokenizer, "byte_token_ids", ()):
            self._committed = self._text
            self._prefix, self._read = self._read, len(ids)
        return self._text
