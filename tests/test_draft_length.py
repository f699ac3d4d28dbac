"""Adaptive draft length per sequence (LayerDrafts(long_draft_acceptance=a),
eecore.speculative.draft_length): full-length drafts while first drafts are accepted, one token a
round while they are not; outputs stay full depth's."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

import eecore
from eecore.engine.sequence import Sequence
from eecore.speculative.draft_length import DraftLength
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model
from test_speculative import _with_identity_tail

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("draft-length"), arch="llama", num_layers=NUM_LAYERS)


def _spec(path, long_draft_acceptance=None, E=1, d=4, **layer):
    """`layer`: more LayerDrafts options."""
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8,
                      speculative=eecore.SelfSpeculativeConfig(num_speculations=d, layer=eecore.LayerDrafts(
                          exit_layer=E, long_draft_acceptance=long_draft_acceptance, **layer)))


def test_chains_go_on_while_first_drafts_are_accepted_or_sure():
    rule = DraftLength(min_acceptance=0.5)
    seq, other = Sequence([1, 2], eecore.SamplingParams()), Sequence([3], eecore.SamplingParams())
    assert rule.goes_on(seq, 0.0)  # a new sequence trusts its drafts
    rule.record(seq, False)
    assert not rule.goes_on(seq, 0.49) and rule.goes_on(other, 0.0)  # per sequence
    assert rule.goes_on(seq, 0.5)  # a sure first draft keeps the chain going all the same
    # trusted again once the running rate reaches 0.5: 0.15, 0.28, 0.39, 0.48, 0.56
    trusted = []
    for _ in range(5):
        rule.record(seq, True)
        trusted.append(rule.goes_on(seq, 0.0))
    assert trusted == [False, False, False, False, True]
    rule.record(seq, False)  # 0.47: one miss after a long recovery is enough
    assert not rule.goes_on(seq, 0.0)
    rule.release(seq)
    assert rule.goes_on(seq, 0.0) and len(rule) == 0
    assert DraftLength(0.0).goes_on(seq, 0.0)  # 0 turns the rule off


@pytest.mark.parametrize("copy", [None, eecore.DraftCopy()], ids=["shared", "separate"])
def test_rejected_first_drafts_end_unsure_chains_and_greedy_stays_exact(tiny, copy):
    # layer 1 of 4 random layers drafts badly. With a = 1.0 the first rejected first draft makes
    # a sequence verify one draft a round for good (the running rate never gets back to 1), unless
    # a first draft is certain (top-1 probability 1.0, which random layers do not give)
    path, hf = tiny
    for batch in (1, 3):
        prompts = random_prompts(hf.config.vocab_size, [3 + 5 * i for i in range(batch)], seed=batch)
        params = [greedy(24 + 2 * i) for i in range(batch)]
        full = eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
        free = _spec(path, copy=copy).generate(prompts, params)
        short_llm = _spec(path, 1.0, copy=copy)
        short = short_llm.generate(prompts, params)
        assert [o.token_ids for o in short] == [o.token_ids for o in full]
        assert [o.token_ids for o in free] == [o.token_ids for o in full]
        for f, s in zip(free, short):
            assert f.metrics["num_accepted_tokens"] < f.metrics["num_drafted_tokens"]  # else nothing to shorten
            # chains of 4 only while every first draft so far was accepted (each such round emits at
            # least 2 tokens, so at most 12 of them), then one draft a round
            assert s.metrics["num_drafted_tokens"] <= s.metrics["num_verify_steps"] + 3 * 12, s.metrics
            assert s.metrics["num_drafted_tokens"] < f.metrics["num_drafted_tokens"]
            assert s.metrics["num_drafted_tokens"] / s.metrics["num_verify_steps"] < 1.5, s.metrics
            # no threshold: every layer proposal is drafted (the metric counts the draft heads paid)
            assert s.metrics["num_layer_proposals"] == s.metrics["num_layer_drafted_tokens"] \
                == s.metrics["num_drafted_tokens"]
        assert len(short_llm.engine.strategy.draft_length) == 0  # finished sequences leave no state


def test_accepted_first_drafts_keep_the_chains_long(tiny, tmp_path):
    # layers 2-3 are identities: layer 2's draft is always the model's token, so every chain is long
    path, hf = tiny
    exact = _with_identity_tail(hf, 2, tmp_path / "identity-tail")
    prompts = random_prompts(hf.config.vocab_size, [4, 9, 1], seed=12)
    full = eecore.LLM(exact, dtype="float32", device="cpu").generate(prompts, greedy(21))
    outs = _spec(exact, 1.0, E=2).generate(prompts, greedy(21))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    for o in outs:  # 20 decoded tokens: 4 rounds of 4 accepted drafts + the model's token
        assert o.metrics["acceptance_rate"] == 1.0
        assert o.metrics["num_verify_steps"] == 4 and o.metrics["num_drafted_tokens"] == 4 * 4


def test_sure_first_drafts_keep_the_chains_long(tiny):
    # a = 1.0 after rejected first drafts: the chain goes on only past a first draft whose top-1
    # probability reaches 1.0. Faking that probability for every draft (its token unchanged) must
    # bring the chains of 4 back; faking it below 1.0 must keep them at one draft a round
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 8], seed=21)
    drafted = {}
    for fake in (1.0, 0.99):
        llm = _spec(path, 1.0)
        strategy = llm.engine.strategy
        propose = strategy.picker.propose
        strategy.picker.propose = lambda logits, seqs, drafted=None, _fake=fake: dataclasses.replace(
            propose(logits, seqs, drafted), confidence=[_fake] * len(seqs))
        outs = llm.generate(prompts, greedy(30))
        drafted[fake] = [o.metrics["num_drafted_tokens"] / o.metrics["num_verify_steps"] for o in outs]
    assert all(r > 2.5 for r in drafted[1.0]) and all(r < 1.5 for r in drafted[0.99]), drafted


def test_a_draft_the_threshold_dropped_counts_as_a_rejected_first_draft(tiny):
    # stop_below=0.99 drops (nearly) every draft of random layers; each such round is a
    # rejected first draft, so the rule's running rate for the sequence falls to 0
    path, hf = tiny
    llm = _spec(path, 0.5, E=2, stop_below=0.99)
    rule, rates = llm.engine.strategy.draft_length, []
    record = rule.record
    rule.record = lambda seq, first_accepted: (rates.append(first_accepted), record(seq, first_accepted))[1]
    out = llm.generate(random_prompts(hf.config.vocab_size, [7], seed=13), greedy(10))[0]
    assert out.metrics["num_drafted_tokens"] == 0
    # the rounds with room for a draft: 8 of the 9 after the prefill's token, each a miss whose
    # dropped proposal was paid for
    assert rates == [False] * 8
    assert out.metrics["num_layer_proposals"] == 8


@pytest.mark.parametrize("value, match", [
    (1.5, r"LayerDrafts: 'long_draft_acceptance' \(--long-draft-acceptance\) must be a number in \[0, 1\] or None, "
          r"got 1.5"),
    (-0.1, r"'long_draft_acceptance' \(--long-draft-acceptance\) must be a number in \[0, 1\]"),
    ("often", r"'long_draft_acceptance' \(--long-draft-acceptance\) must be a number"),
    (True, r"'long_draft_acceptance' \(--long-draft-acceptance\) must be a number"),
])
def test_bad_config(value, match):
    """(A lookup-only config has no layer drafts to set it on; the deprecated flat spelling that
    tried: test_speculative_config.py.)"""
    with pytest.raises(ValueError, match=match):
        eecore.LayerDrafts(exit_layer=2, long_draft_acceptance=value)


def test_presets_and_cli_flag(tiny, capsys):
    from eecore.cli import main, parse_args, speculative_config

    for preset in ("layer", "hybrid"):
        assert eecore.SelfSpeculativeConfig.exit_ready(preset).layer.long_draft_acceptance == 0.5
        config = eecore.SelfSpeculativeConfig.exit_ready(preset)
        changed = replace(config, layer=replace(config.layer, long_draft_acceptance=0.0))
        assert changed.layer.long_draft_acceptance == 0.0
    args = parse_args(["generate", "x", "--exit-ready", "--long-draft-acceptance", "0.3"])
    assert speculative_config(args).layer.long_draft_acceptance == 0.3
    path, _ = tiny
    assert main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                 "--exit-layer", "2", "--long-draft-acceptance", "0.5"]) == 0
    with pytest.raises(SystemExit, match=r"'long_draft_acceptance' \(--long-draft-acceptance\) must be a number in"):
        main(["generate", "Hello", "--model", path, "--speculate", "--exit-layer", "2", "--long-draft-acceptance", "2"])
