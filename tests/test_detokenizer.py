"""The incremental detokenizer (eecore.engine.detokenizer) against decoding the whole output, after
every appended token or run of tokens, on the two kinds of vocabulary generation meets: byte-level
BPE (SmolLM2's, where a token can hold part of a character) and SentencePiece with byte fallback
(where the decoder drops the space that opens a decoded string). It must give the full decode's
text every time, and decode a bounded window each step, not the whole output."""
from __future__ import annotations

import random

import pytest

from eecore.engine.detokenizer import IncrementalDetokenizer
from eecore.models import default_model_path
from eecore.models.gguf_file import GGUFFile
from eecore.models.gguf_tokenizer import tokenizer_from_gguf
from model_factory import write_sentencepiece_gguf

TEXT = ("Early exit lets easy tokens leave after a few layers. café naïve résumé über straße, "
        "Привет мир 日本語 🦘🦘 emoji and\n\tcode: def f(x):\n    return x ** 2  # ok\n") * 3


def _tokenizer(path):
    return tokenizer_from_gguf(GGUFFile(path).metadata, path)


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
    if request.param == "byte-level":
        return _tokenizer(default_model_path())
    pytest.importorskip("sentencepiece")
    return _tokenizer(write_sentencepiece_gguf(tmp_path_factory.mktemp("spm"))[1])


class CountingTokenizer:
    """Counts the tokens each decode is given."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0
        self.byte_token_ids = inner.byte_token_ids

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def _follow(tokenizer, ids, steps):
    """Appends `ids` in runs of the given lengths, checking the text after each run."""
    counting, detok, at = CountingTokenizer(tokenizer), IncrementalDetokenizer(), 0
    for n in steps:
        at = min(at + n, len(ids))
        assert detok.update(counting, ids[:at]) == tokenizer.decode(ids[:at], skip_special_tokens=True), at
    return counting.decoded


def test_text_of_real_text_token_by_token_and_in_runs(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert _follow(tokenizer, ids, [1] * len(ids)) < 12 * len(ids), "decoded windows grew with the output"
    rng = random.Random(0)
    _follow(tokenizer, ids, [rng.randint(1, 5) for _ in range(len(ids))])  # speculation appends runs


def test_random_ids_with_special_and_partial_characters(tokenizer):
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 60))]
        _follow(tokenizer, ids, [rng.choice([1, 1, 1, 2, 4]) for _ in range(len(ids))])


def test_no_new_tokens_decodes_nothing(tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    counting, detok = CountingTokenizer(tokenizer), IncrementalDetokenizer()
    text = detok.update(counting, ids)
    decoded = counting.decoded
    assert detok.update(counting, ids) == text and counting.decoded == decoded


def test_byte_tokens_are_the_byte_fallback_vocabulary(tokenizer):
    sentencepiece = tokenizer.vocab_size == 400  # the fixture's SentencePiece vocabulary
    assert len(tokenizer.byte_token_ids) == (256 if sentencepiece else 0)
    assert all(tokenizer.id_to_token(i).startswith("<0x") for i in tokenizer.byte_token_ids)


class JoiningTokenizer:
    """A decoder that rewrites text across token boundaries ("a" then "b" reads "c")."""

    byte_token_ids = frozenset()
    pieces = {0: "a", 1: "b", 2: "x"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids).replace("ab", "c")


def test_a_decoder_that_rewrites_across_the_boundary_still_gives_the_full_text():
    tokenizer, detok, ids = JoiningTokenizer(), IncrementalDetokenizer(), [2, 0, 1, 2, 0, 1, 1, 0]
    for n in range(1, len(ids) + 1):
        assert detok.update(tokenizer, ids[:n]) == tokenizer.decode(ids[:n])


def test_a_stop_string_made_by_rewriting_text_already_searched_is_found():
    """"a" was searched (no stop there); "b" turns it into "c", the stop string: the check must
    look again where the rewrite happened, not only past the text it had searched."""
    import eecore
    from eecore.engine.sequence import Sequence
    from eecore.engine.stopping import StopChecker

    checker = StopChecker(JoiningTokenizer(), eos_token_ids=(), max_model_len=100)
    seq = Sequence([2], eecore.SamplingParams(max_tokens=10, stop=["c"]))
    reasons = []
    for token in (2, 2, 0, 1):
        seq.append_token(token, 1)
        reasons.append(checker.check(seq))
    assert reasons == [None, None, None, "stop"] and seq.output_text == "xx"
