"""StopChecker.append (eecore.engine.stopping): a round's tokens appended at once must end a
sequence exactly where appending them one by one and checking after each would: at the first
EOS or stop token (unless ignore_eos), at max_tokens, at the context's end, or at a stop string,
with the same tokens, exit layers, log-probabilities, finish reason and stop reason."""
from __future__ import annotations

import random

import pytest

import eecore
from eecore.engine.decoding import Token
from eecore.engine.sequence import Sequence
from eecore.engine.stopping import StopChecker
from eecore.engine.tokens import TokenRun

EOS = 3


class LetterTokenizer:
    """Token i decodes to the i-th lowercase letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _params(rng: random.Random) -> eecore.SamplingParams:
    return eecore.SamplingParams(
        max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3,
        stop_token_ids=rng.sample(range(8), rng.randint(0, 2)),
        stop=rng.choice([None, None, ["ce"], ["b", "dd"]]))


def _one_by_one(checker: StopChecker, seq: Sequence, tokens: list[Token]):
    for token in tokens:
        seq.append_token(token.token_id, token.exit_layer, token.logprobs)
        reason = checker.check(seq)
        if reason is not None:
            return reason
    return None


def _state(seq: Sequence):
    return (seq.output_token_ids, seq.exit_layers, seq.logprobs, seq.stop_reason, seq.output_text)


def _random_round(rng: random.Random) -> list[Token]:
    return [Token(rng.randrange(8), rng.choice([4, 30]), {0: -1.0} if rng.random() < 0.5 else None)
            for _ in range(rng.randint(1, 5))]


def _token_run(rng: random.Random) -> TokenRun:
    """A TokenRun (ids of one exit layer, as fused rounds give them)."""
    return TokenRun([rng.randrange(8) for _ in range(rng.randint(1, 5))], rng.choice([4, 30]))


def _as_tokens(tokens) -> list[Token]:
    return [Token(t, tokens.exit_layer) for t in tokens] if isinstance(tokens, TokenRun) else tokens


@pytest.mark.parametrize("seed", range(200))
@pytest.mark.parametrize("make_round", [_random_round, _token_run], ids=["tokens", "token-run"])
def test_appending_a_round_at_once_stops_where_token_by_token_does(seed, make_round):
    rng = random.Random(seed)
    checker = StopChecker(LetterTokenizer(), eos_token_ids=(EOS,), max_model_len=rng.randint(4, 20))
    params = _params(rng)
    prompt = [rng.randrange(8) for _ in range(rng.randint(1, 3))]
    bulk, single = Sequence(prompt, params), Sequence(prompt, params)
    while True:
        tokens = make_round(rng)
        expected = _one_by_one(checker, single, _as_tokens(tokens))
        assert checker.append(bulk, tokens) == expected
        assert _state(bulk) == _state(single)
        if expected is not None:
            break


def test_a_stop_token_inside_a_round_drops_the_tokens_after_it():
    checker = StopChecker(None, eos_token_ids=(EOS,), max_model_len=100)
    seq = Sequence([1], eecore.SamplingParams(max_tokens=50, stop_token_ids=[7]))
    assert checker.append(seq, [Token(5, 30), Token(7, 30), Token(6, 30)]) == "stop"
    assert seq.output_token_ids == [5, 7] and seq.stop_reason == 7


def test_max_tokens_inside_a_round_cuts_it_there():
    checker = StopChecker(None, eos_token_ids=(EOS,), max_model_len=100)
    seq = Sequence([1], eecore.SamplingParams(max_tokens=2, ignore_eos=True))
    assert checker.append(seq, [Token(EOS, 30), Token(5, 30), Token(6, 30)]) == "length"
    assert seq.output_token_ids == [EOS, 5]
