"""ROUGE-L F1 between two texts, through Google's `rouge-score` package (the reference
implementation of the ROUGE paper's scores), on whitespace tokens.

Why whitespace tokens: rouge-score's default tokenizer lowercases and keeps only [a-z0-9] runs, so
`x = f(a)` and `x == f[a]` would score 1.0: wrong for code, where case and punctuation are the
output. Splitting on whitespace keeps every character, and matches the seed
paper's "To Full" column (ROUGE-L of an early-exit output against the full model's output).

Two empty texts are identical outputs and score 1.0 (rouge-score would say 0.0); one empty text
against a non-empty one scores 0.0.
"""
from __future__ import annotations

from functools import lru_cache

__all__ = ["rouge_l", "WhitespaceTokenizer"]


class WhitespaceTokenizer:
    """rouge-score's tokenizer interface: `tokenize(text) -> list[str]`, here `str.split()`."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


@lru_cache(maxsize=1)
def _scorer():
    # imported on first use: `import eecore` should not pay for nltk (which rouge-score imports)
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=WhitespaceTokenizer())


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of `candidate` against `reference`: from the longest common subsequence of their
    whitespace tokens, P = LCS / len(candidate), R = LCS / len(reference), F1 = 2PR / (P + R)."""
    if not isinstance(candidate, str) or not isinstance(reference, str):
        raise TypeError(f"rouge_l: expected two strings, got {type(candidate).__name__} and "
                        f"{type(reference).__name__}")
    if not candidate.split() and not reference.split():
        return 1.0
    return float(_scorer().score(reference, candidate)["rougeL"].fmeasure)
