"""The prompt-lookup (n-gram) index, vLLM's `ngram` method: self-speculation's drafts that run no
layer (eecore.speculative), and an input of the exit decision (eecore.exits.decision, .agreement).
This package imports no other eecore package.

A sequence drafts the tokens that followed the most recent earlier occurrence of its last n tokens,
in its prompt and output so far, trying n from `max_ngram` down to `min_ngram`. On text that
repeats itself (code, edits, quoting, extraction) these drafts are often right, and they cost no
weight reads at all: only the verification pass, which reads the weights once whether it checks 1
or d+1 tokens when decoding is bound by memory bandwidth.

Each sequence keeps an index, per n, from n-gram to the start of its most recent occurrence whose
continuation is known. A sequence's tokens only grow (rejected drafts never enter it, preemption
keeps them), so the index is updated with each round's new tokens only: O(new tokens) per round,
not a scan of the whole context.
"""
from __future__ import annotations

from typing import Sequence as Seq


class NgramIndex:
    """The prompt-lookup index of one token sequence (see the module doc)."""

    __slots__ = ("min_n", "max_n", "tables", "tokens", "indexed")

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_n, self.max_n = min_ngram, max_ngram
        self.tables: list[dict[tuple, int]] = [dict() for _ in range(max_ngram - min_ngram + 1)]
        self.tokens: list[int] = []
        # n-grams ending before position `indexed` are in the tables (the last token's are not:
        # nothing follows them yet)
        self.indexed = 0

    def extend(self, new_tokens: Seq[int]) -> None:
        """Append `new_tokens` to the sequence and index what they complete."""
        self.tokens.extend(new_tokens)
        toks = self.tokens
        end = len(toks) - 1  # n-grams ending at positions < end have a continuation
        for stop in range(self.indexed + 1, end + 1):  # the n-gram toks[stop-n:stop]
            for j, n in enumerate(range(self.min_n, self.max_n + 1)):
                if stop >= n:
                    self.tables[j][tuple(toks[stop - n: stop])] = stop - n
        self.indexed = max(self.indexed, end)

    def follow(self, prompt: Seq[int], output: Seq[int]) -> None:
        """Index what a sequence of `prompt` then `output` gained since the last call."""
        have = len(self.tokens)
        if have < len(prompt):
            self.extend(prompt[have:])
            have = len(prompt)
        self.extend(output[have - len(prompt):])

    def propose(self, max_tokens: int, after: Seq[int] = ()) -> list[int]:
        """Up to `max_tokens` draft tokens (none without a match). `after`: tokens drafted past the
        sequence already; the n-gram to match then ends with them (its occurrences are still looked
        up in the sequence alone)."""
        toks = self.tokens
        if max_tokens <= 0:
            return []
        tail = toks[max(0, len(toks) - self.max_n):] + list(after)
        for n in range(min(self.max_n, len(toks) + len(after) - 1), self.min_n - 1, -1):
            start = self.tables[n - self.min_n].get(tuple(tail[len(tail) - n:]))
            if start is not None:
                return toks[start + n: start + n + max_tokens]
        return []


def lookup_reference(tokens: Seq[int], min_ngram: int, max_ngram: int, max_tokens: int,
                     after: Seq[int] = ()) -> list[int]:
    """The same proposal by brute force (the tests' oracle)."""
    tokens = list(tokens)
    L = len(tokens)
    key = tokens + list(after)
    for n in range(min(max_ngram, len(key) - 1), min_ngram - 1, -1):
        suffix = key[len(key) - n:]
        for start in range(L - n - 1, -1, -1):  # most recent occurrence with a continuation first
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + max_tokens] if max_tokens > 0 else []
    return []


class PromptLookup:
    """Prompt-lookup drafts for the sequences of an engine, one NgramIndex per live sequence."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._index: dict[int, NgramIndex] = {}

    def continuation(self, seq, max_tokens: int, after: Seq[int] = ()) -> list[int]:
        """Draft tokens for `seq` (an engine Sequence) from its prompt and output so far; `after`:
        tokens already drafted past it this round (see NgramIndex.propose)."""
        index = self._index.get(seq.seq_id)
        if index is None:
            index = self._index[seq.seq_id] = NgramIndex(self.min_ngram, self.max_ngram)
        index.follow(seq.prompt_token_ids, seq.output_token_ids)
        return index.propose(max_tokens, after)

    def release(self, seq) -> None:
        self._index.pop(seq.seq_id, None)

    def __len__(self) -> int:
        return len(self._index)
