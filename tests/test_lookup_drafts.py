"""Prompt-lookup (n-gram) drafts and the hybrid of lookup and layer-E drafts, on the batched paged engine."""
import random

import pytest
import torch

import eecore
from engine_utils import first_two_token_counts, greedy, law_p_value
from model_factory import make_tiny_hf_model
from eecore.text.ngram_index import NgramIndex, PromptLookup, lookup_reference

NUM_LAYERS = 4


@pytest.fixture(scope="module", params=["llama", "mistral"])
def tiny(request, tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=NUM_LAYERS)


def _llm(path, draft, E=2, d=4, layer=None, lookup=None, disable_by_batch_size=None, **kw):
    """draft "layer", "lookup" or "hybrid" (both); `layer` and `lookup`: options of LayerDrafts (at
    exit layer E) and LookupDrafts."""
    spec = eecore.SelfSpeculativeConfig(
        num_speculations=d, layer=None if draft == "lookup" else eecore.LayerDrafts(exit_layer=E, **(layer or {})),
        lookup=None if draft == "layer" else eecore.LookupDrafts(**(lookup or {})),
        disable_by_batch_size=disable_by_batch_size)
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4, speculative=spec, **kw)


def repetitive_prompts(vocab_size: int, batch: int, seed: int = 0) -> list[list[int]]:
    """Prompts made of a few short random phrases repeated in random order, so their n-grams recur
    (and the tiny model's output, which tends to loop, finds them)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(batch):
        phrases = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 5))] for _ in range(3)]
        prompt = []
        for _ in range(3 + i % 4):
            prompt += rng.choice(phrases)
        prompts.append(prompt)
    return prompts


# ---- the lookup itself -------------------------------------------------------------------------


def test_ngram_index_is_the_brute_force_lookup():
    rng = random.Random(0)
    for _ in range(2000):
        vocab, n = rng.choice([2, 3, 5, 20]), rng.randint(0, 40)
        tokens = [rng.randrange(vocab) for _ in range(n)]
        lo = rng.randint(1, 3)
        hi, k = rng.randint(lo, 5), rng.randint(0, 6)
        index = NgramIndex(lo, hi)
        cut = rng.randint(0, n)  # the index grows in two steps, with a lookup in between
        index.extend(tokens[:cut])
        index.propose(k)
        index.extend(tokens[cut:])
        assert index.propose(k) == lookup_reference(tokens, lo, hi, k), (tokens, lo, hi, k)
        # keyed on tokens drafted past the sequence (hybrid_switch="token")
        after = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        assert index.propose(k, after) == lookup_reference(tokens, lo, hi, k, after), (tokens, after, lo, hi, k)


def test_lookup_prefers_the_longest_ngram_and_the_most_recent_occurrence():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    assert lookup_reference(tokens, 1, 3, 2) == [9, 2]  # "1 2 3" occurred at 0, followed by 9 2
    assert lookup_reference(tokens, 1, 2, 2) == [7, 1]  # "2 3": the most recent earlier one, at 4
    assert lookup_reference(tokens, 1, 1, 9) == [7, 1, 2, 3]  # "3" at 5; the draft runs to the end
    assert lookup_reference(tokens, 4, 4, 2) == []  # no 4-gram recurs
    assert lookup_reference([5, 6, 7], 1, 3, 4) == []


def test_prompt_lookup_follows_a_growing_sequence():
    class Seq:
        seq_id = 0
        prompt_token_ids = [4, 5, 6, 4]
        output_token_ids: list = []

    lookup, seq = PromptLookup(1, 2), Seq()
    assert lookup.continuation(seq, 3) == [5, 6, 4]
    seq.output_token_ids = [5, 8]
    assert lookup.continuation(seq, 3) == []  # "5 8", "8": new
    seq.output_token_ids = [5, 8, 4, 5]
    assert lookup.continuation(seq, 3) == [8, 4, 5]  # "4 5" most recently at 3
    lookup.release(seq)
    assert len(lookup) == 0


# ---- greedy: exactly full depth ----------------------------------------------------------------


@pytest.mark.parametrize("draft", ["lookup", "hybrid"])
def test_greedy_lookup_drafts_are_full_depth_greedy(tiny, draft):
    path, hf = tiny
    full = eecore.LLM(path, dtype="float32", device="cpu", block_size=4)
    for batch in (1, 3, 8):
        prompts = repetitive_prompts(hf.config.vocab_size, batch, seed=batch)
        params = [greedy(12 + 5 * (i % 3)) for i in range(batch)]
        expected = [o.token_ids for o in full.generate(prompts, params)]
        for d in (1, 3, 6):
            llm = _llm(path, draft, E=2, d=d)
            outs = llm.generate(prompts, params)
            assert [o.token_ids for o in outs] == expected, (draft, batch, d)
            drafted = sum(o.metrics["num_lookup_drafted_tokens"] for o in outs)
            accepted = sum(o.metrics["num_lookup_accepted_tokens"] for o in outs)
            assert drafted > 0 and accepted > 0, (batch, d, drafted, accepted)
            for o in outs:
                assert o.metrics["num_lookup_accepted_tokens"] <= o.metrics["num_lookup_drafted_tokens"]
                assert o.metrics["num_lookup_drafted_tokens"] <= o.metrics["num_drafted_tokens"]
                assert 1.0 <= o.metrics["mean_accepted_tokens_per_step"] <= d + 1
                # rounds emit accepted drafts plus one token each (the prefill token aside)
                assert o.metrics["num_accepted_tokens"] + o.metrics["num_verify_steps"] == len(o.token_ids) - 1
            if draft == "lookup":
                assert all("num_layer_drafted_tokens" not in o.metrics for o in outs)
            else:
                assert sum(o.metrics["num_layer_drafted_tokens"] for o in outs) > 0


def test_lookup_only_needs_no_exit_layer_and_runs_every_position_once(tiny):
    path, hf = tiny
    prompts = repetitive_prompts(hf.config.vocab_size, 5, seed=4)
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(20))]
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4,
                     speculative=eecore.SelfSpeculativeConfig(num_speculations=4, lookup=eecore.LookupDrafts()))
    strategy = llm.engine.strategy
    assert strategy.draft_head is None and strategy.guard is None
    outs = llm.generate(prompts, greedy(20))
    assert [o.token_ids for o in outs] == expected
    # no layer ever drafted: every layer saw the same positions, and each accepted draft saved
    # one pass of the whole model
    counts = llm.engine.runner.layer_tokens
    assert len(set(counts)) == 1, counts
    assert sum(o.metrics["num_lookup_accepted_tokens"] for o in outs) > 0
    assert len(strategy.lookup) == 0  # finished sequences leave no index behind


def test_hybrid_mixes_lookup_and_layer_drafts_in_one_round(tiny):
    path, hf = tiny
    # half the prompts repeat themselves, half are a run of distinct tokens (no match at first)
    prompts = repetitive_prompts(hf.config.vocab_size, 4, seed=5)
    prompts += [list(range(3 + 11 * i, 3 + 11 * i + 9)) for i in range(4)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(16))]
    llm = _llm(path, "hybrid", E=2, d=3, lookup=dict(min_ngram=2))
    strategy, mixed = llm.engine.strategy, []
    propose = strategy.proposer.propose

    def spy(seqs, drafts, budgets, *rest):
        mixed.append(any(drafts) and any(budgets.tokens))  # the drafts hold the lookup tokens on the way in
        return propose(seqs, drafts, budgets, *rest)
    strategy.proposer.propose = spy
    outs = llm.generate(prompts, greedy(16))
    assert [o.token_ids for o in outs] == expected
    assert any(mixed), "no round had both lookup and layer drafts"
    # lookup rows ran layers 0..E-1 once in the first draft pass, then joined the verify pass:
    # every layer saw every position exactly once
    counts = llm.engine.runner.layer_tokens
    assert len(set(counts)) == 1, counts


def test_hybrid_layer_drafts_have_their_own_length(tiny):
    path, hf = tiny
    prompts = repetitive_prompts(hf.config.vocab_size, 4, seed=5)
    prompts += [list(range(3 + 11 * i, 3 + 11 * i + 9)) for i in range(4)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(16))]
    llm = _llm(path, "hybrid", E=2, d=4, layer=dict(max_length=1), lookup=dict(min_ngram=2))
    strategy, layer_lengths, lookup_lengths = llm.engine.strategy, [], []
    propose = strategy.proposer.propose

    def spy(seqs, drafts, budgets, *rest):
        lookup_lengths.extend(len(d) for d in drafts)  # the lookup tokens, before the layers add theirs
        layered = [b for b, n in enumerate(budgets.tokens) if n]
        propose(seqs, drafts, budgets, *rest)
        layer_lengths.extend(len(drafts[b]) for b in layered)
    strategy.proposer.propose = spy
    assert [o.token_ids for o in llm.generate(prompts, greedy(16))] == expected
    assert layer_lengths and max(layer_lengths) == 1
    assert max(lookup_lengths) > 1  # lookup drafts keep num_speculations
    for batch in (1, 3):  # batch invariance
        llm = _llm(path, "hybrid", E=2, d=4, layer=dict(max_length=2), max_num_seqs=batch)
        assert [o.token_ids for o in llm.generate(prompts, greedy(16))] == expected


def test_hybrid_guard_gates_layer_drafts_only(tiny):
    path, hf = tiny
    prompts = repetitive_prompts(hf.config.vocab_size, 4, seed=6)
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(30))]
    free = _llm(path, "hybrid", E=1, d=4).generate(prompts, greedy(30))
    # layer 1 of 4 random layers drafts hopelessly: with a floor of 1.0 the guard stops layer
    # drafts, while lookup drafts go on
    guard = eecore.AcceptanceGuard(min_acceptance=1.0, probe_every=8)
    guarded = _llm(path, "hybrid", E=1, d=4, layer=dict(guard=guard))
    outs = guarded.generate(prompts, greedy(30))
    assert [o.token_ids for o in outs] == expected
    layer_free = sum(o.metrics["num_layer_drafted_tokens"] for o in free)
    layer_guarded = sum(o.metrics["num_layer_drafted_tokens"] for o in outs)
    assert layer_guarded < layer_free / 2, (layer_guarded, layer_free)
    # lookup drafts are not gated, though their acceptance is below the floor too (round
    # boundaries move with the layer drafts, so the counts differ a little)
    lookup_free = sum(o.metrics["num_lookup_drafted_tokens"] for o in free)
    lookup_guarded = sum(o.metrics["num_lookup_drafted_tokens"] for o in outs)
    assert lookup_guarded > 0.8 * lookup_free > 0, (lookup_guarded, lookup_free)
    assert any(o.metrics["lookup_acceptance_rate"] < 1.0 for o in outs)
    assert len(guarded.engine.strategy.guard) == 0


def test_lookup_drafts_with_preemption_and_stop_tokens(tiny):
    path, hf = tiny
    prompts = repetitive_prompts(hf.config.vocab_size, 10, seed=9)
    params = [greedy(6 + i % 9) for i in range(10)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, params)]
    for num_blocks in (200, 16):
        llm = _llm(path, "hybrid", E=2, d=4, num_blocks=num_blocks, max_num_seqs=6)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.blocks.num_free_blocks == num_blocks
        if num_blocks == 16:
            assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    # a stop token inside an accepted lookup draft ends the output right there
    llm = _llm(path, "lookup", d=6)
    full = llm.generate(prompts[:1], greedy(20))[0]
    assert full.metrics["num_lookup_accepted_tokens"] > 0
    stop = full.token_ids[8]
    out = _llm(path, "lookup", d=6).generate(prompts[:1], greedy(20, stop_token_ids=[stop]))[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop) + 1]


def test_lookup_logprobs_are_the_full_models(tiny):
    path, hf = tiny
    prompts = repetitive_prompts(hf.config.vocab_size, 3, seed=10)
    params = greedy(12, logprobs=3)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, params)
    outs = _llm(path, "hybrid", d=3).generate(prompts, params)
    for o, f in zip(outs, full):
        assert o.token_ids == f.token_ids
        for a, b in zip(o.logprobs, f.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


# ---- sampling: the full model's law ------------------------------------------------------------


def _sample_first_two_tokens(llm, prompt, n, V):
    """Counts of (t1, t2) over n seeds at temperature 1 with max_tokens=3, so the second token comes
    out of a verify round that drafted (with 2 tokens, the last round has no room for a draft)."""
    params = [eecore.SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    outs = llm.generate([prompt] * n, params)
    return first_two_token_counts(outs, V), outs


def _conditionals(hf, prompt):
    """p(t1 | prompt) `[V]` and p(t2 | prompt, t1) `[V, V]` of the HF model at temperature 1."""
    V = hf.config.vocab_size
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = hf(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1].softmax(-1)
    return p1, p2


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("v12"), arch="llama", num_layers=NUM_LAYERS, vocab_size=12,
                              with_tokenizer=False)


def test_lookup_sampling_preserves_the_full_model_law(tiny_vocab):
    path, hf = tiny_vocab
    V = 12
    # every token occurs in the prompt with a token after it, so every t1 has a lookup draft
    prompt = [3, 7, 1, 5, 9, 0, 2, 4, 6, 8, 10, 11, 3]
    n = 3000
    # mixed_steps=False: steps of one kind, so that every request's second token comes from a round
    # (with mixed steps, requests this short, arriving all along, would take plain steps while
    # prompts wait)
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=64, mixed_steps=False,
                     speculative=eecore.SelfSpeculativeConfig(num_speculations=3, lookup=eecore.LookupDrafts()))
    counts, outs = _sample_first_two_tokens(llm, prompt, n, V)
    assert all(o.metrics["num_lookup_drafted_tokens"] >= 1 for o in outs)
    accepted = sum(o.metrics["num_lookup_accepted_tokens"] for o in outs)
    assert 0 < accepted < n
    p1, p2 = _conditionals(hf, prompt)
    assert law_p_value(counts, p1[:, None] * p2) > 1e-3
    # the test has power against the likely bug: accepting the draft y with probability p(y), but
    # drawing a rejected token from p itself instead of from p with y removed
    broken = p2.clone()
    for t1 in range(V):
        y = lookup_reference(prompt + [t1], 1, 3, 1)[0]
        broken[t1] = p2[t1, y] * torch.nn.functional.one_hot(torch.tensor(y), V) + (1 - p2[t1, y]) * p2[t1]
    assert law_p_value(counts, p1[:, None] * broken) < 1e-3


def test_hybrid_sampling_preserves_the_full_model_law(tiny_vocab):
    path, hf = tiny_vocab
    V = 12
    # t1 in {3, 7, 1, 5} has a lookup match (5 is the prompt's last token: it is followed by t1);
    # every other t1 drafts from layer 1
    prompt = [3, 7, 1, 3, 5]
    n = 3000
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=64,
                     speculative=eecore.SelfSpeculativeConfig(
                         num_speculations=3, layer=eecore.LayerDrafts(exit_layer=1), lookup=eecore.LookupDrafts()))
    counts, outs = _sample_first_two_tokens(llm, prompt, n, V)
    assert sum(o.metrics["num_lookup_drafted_tokens"] for o in outs) > 0
    assert sum(o.metrics["num_layer_drafted_tokens"] for o in outs) > 0
    p1, p2 = _conditionals(hf, prompt)
    assert law_p_value(counts, p1[:, None] * p2) > 1e-3


# ---- configuration and CLI ---------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["lookup", "hybrid", "layer"])
def test_disable_by_batch_size_runs_plain_mixed_steps_above_it(tiny, draft):
    path, hf = tiny
    prompts = repetitive_prompts(hf.config.vocab_size, 6, seed=11)
    # long enough that the batch drains through rounds that draft once the prompts are in
    params = [greedy(16 + 4 * (i % 3)) for i in range(6)]
    full = eecore.LLM(path, dtype="float32", device="cpu", block_size=4)
    expected = [o.token_ids for o in full.generate(prompts, params)]
    llm = _llm(path, draft, E=2, d=3, disable_by_batch_size=2, max_num_batched_tokens=16)
    engine, calls = llm.engine, {"plain": [], "mixed": [], "spec": []}
    for name, method in (("plain", "decode_plain"), ("mixed", "decode_mixed"), ("spec", "decode")):
        original = getattr(engine.strategy, method)
        setattr(engine.strategy, method,
                lambda seqs, *rest, _f=original, _n=name: (calls[_n].append(len(seqs)), _f(seqs, *rest))[1])
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    # above 2 decoding sequences: plain steps; while prompts wait: plain steps carrying their
    # chunks, whatever the batch; at 2 or fewer with no prompt waiting (the batch draining at the
    # end): speculation rounds
    assert calls["plain"] and all(n > 2 for n in calls["plain"]) and calls["mixed"]
    assert calls["spec"] and all(n <= 2 for n in calls["spec"])
    assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0
    for o in outs:  # plain rounds count as verify steps that emit one token
        assert o.metrics["num_accepted_tokens"] + o.metrics["num_verify_steps"] == len(o.token_ids) - 1
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_bad_lookup_config():
    from re import escape

    C, layer, lookup = eecore.SelfSpeculativeConfig, eecore.LayerDrafts, eecore.LookupDrafts
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=escape("SelfSpeculativeConfig: 'disable_by_batch_size' "
                                                    "(--disable-by-batch-size) must be an int >= 1 or None")):
            C(lookup=lookup(), disable_by_batch_size=bad)
    with pytest.raises(ValueError, match=escape("SelfSpeculativeConfig: drafts need a source: layer=LayerDrafts("
                                                "exit_layer=E) (or exit_layer=E), lookup=LookupDrafts()")):
        C()
    with pytest.raises(TypeError, match="exit_layer"):  # layer drafts (alone or in a hybrid) need their depth
        C(layer=layer(), lookup=lookup())
    with pytest.raises(ValueError, match=escape("LookupDrafts: 'min_ngram' (--lookup-min-ngram) must be an int >= 1, "
                                                "got 0")):
        C(lookup=lookup(min_ngram=0))
    with pytest.raises(ValueError, match=escape("LookupDrafts: 'max_ngram' (--lookup-max-ngram) must be an int >= "
                                                "min_ngram (3), got 2")):
        C(lookup=lookup(min_ngram=3, max_ngram=2))
    with pytest.raises(ValueError, match=escape("LookupDrafts: 'max_ngram' (--lookup-max-ngram) must be an int")):
        C(lookup=lookup(max_ngram=2.5))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=escape("LayerDrafts: 'max_length' (--layer-speculations) must be an int "
                                                    ">= 1 or None, got")):
            C(num_speculations=4, layer=layer(exit_layer=2, max_length=bad), lookup=lookup())
    with pytest.raises(ValueError, match=escape("LayerDrafts: 'max_length' (--layer-speculations) must be at most "
                                                "num_speculations (4), got 5")):
        C(num_speculations=4, layer=layer(exit_layer=2, max_length=5), lookup=lookup())
    assert C(layer=layer(exit_layer=2, max_length=2), lookup=lookup()).layer_draft_length == 2
    assert C(layer=layer(exit_layer=2), lookup=lookup()).layer_draft_length == 4
    assert C(layer=layer(exit_layer=2, max_length=1)).layer_draft_length == 1  # layer drafts alone too
    config = C(lookup=lookup())  # no exit layer needed
    assert config.exit_layer is None and not config.uses_layers
    config.validate_for(4)
    with pytest.raises(ValueError, match="'exit_layer' must be below"):
        C(layer=layer(exit_layer=4), lookup=lookup()).validate_for(4)


def test_cli_draft_flags(tiny, capsys, monkeypatch):
    from eecore import cli
    from eecore.cli import generate as generate_command

    path, _ = tiny
    seen = []
    build = cli.build_llm
    monkeypatch.setattr(generate_command, "build_llm", lambda args, **kw: (seen.append(args), build(args, **kw))[1])
    assert cli.main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                     "--draft", "lookup", "--lookup-min-ngram", "2", "--lookup-max-ngram", "4"]) == 0
    config = seen[-1] and cli.speculative_config(seen[-1])
    assert (config.draft, config.lookup.min_ngram, config.lookup.max_ngram, config.exit_layer) == ("lookup", 2, 4, None)
    assert config == eecore.SelfSpeculativeConfig(lookup=eecore.LookupDrafts(min_ngram=2, max_ngram=4))
    assert cli.main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                     "--draft", "hybrid", "--exit-layer", "2"]) == 0
    assert cli.speculative_config(seen[-1]) == eecore.SelfSpeculativeConfig(layer=eecore.LayerDrafts(exit_layer=2),
                                                                            lookup=eecore.LookupDrafts())
    assert cli.main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                     "--draft", "hybrid", "--exit-layer", "2", "--layer-speculations", "1"]) == 0
    assert cli.speculative_config(seen[-1]).layer.max_length == 1
    assert cli.main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                     "--draft", "lookup", "--disable-by-batch-size", "3"]) == 0
    assert cli.speculative_config(seen[-1]).disable_by_batch_size == 3
    with pytest.raises(SystemExit, match=r"'disable_by_batch_size' \(--disable-by-batch-size\) must be an int >= 1"):
        cli.main(["generate", "Hello", "--model", path, "--speculate", "--draft", "lookup",
                  "--disable-by-batch-size", "0"])
    with pytest.raises(SystemExit, match=r"'max_length' \(--layer-speculations\) must be at most num_speculations "
                                         r"\(4\), got 5"):
        cli.main(["generate", "Hello", "--model", path, "--speculate", "--exit-layer", "2", "--layer-speculations", "5"])
    with pytest.raises(SystemExit, match="--draft hybrid needs --exit-layer"):
        cli.main(["generate", "Hello", "--model", path, "--speculate", "--draft", "hybrid"])
    with pytest.raises(SystemExit, match="--speculate needs --exit-layer"):
        cli.main(["generate", "Hello", "--model", path, "--speculate"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "Hello", "--model", path, "--speculate", "--draft", "ngram"])
    assert exc.value.code == 2 and "--draft" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"LookupDrafts: 'max_ngram' \(--lookup-max-ngram\) must be an int >= "
                                         r"min_ngram \(3\), got 2"):
        cli.main(["generate", "Hello", "--model", path, "--speculate", "--draft", "lookup",
                  "--lookup-min-ngram", "3", "--lookup-max-ngram", "2"])
