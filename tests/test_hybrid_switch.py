"""Hybrid drafts that pick their source per drafted position (SelfSpeculativeConfig(layer=...,
lookup=..., hybrid_switch="token")): lookup continuations while the draft ends in an n-gram match, a token of
the separate draft copy where it does not, both kinds in one round's chain."""
from __future__ import annotations

import pytest
import torch

import eecore
from eecore.models.exit_adapter import ExitAdapters, model_fingerprint
from engine_utils import assert_copy_logits_match, greedy, law_p_value
from model_factory import random_lora
from test_lookup_drafts import repetitive_prompts, tiny_vocab  # noqa: F401 (a fixture)
from test_separate_draft_layers import VOCAB, tiny  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def lora_file(tiny, tmp_path_factory):
    """(file, lora): LoRA pairs for the draft copy alone, drawn so that the tiny model's chains mix
    the sources both ways (a copy token opening a match, a lookup run the copy continues)."""
    path, hf = tiny
    lora = random_lora(hf, seed=7)
    file = str(tmp_path_factory.mktemp("switchfile") / "draft.safetensors")
    ExitAdapters({}, None, model_fingerprint(eecore.LLM(path, dtype="float32", device="cpu").model), {}, lora).save(file)
    return file, lora


def _switching(path, file=None, E=2, d=4, max_length=2, layer=None, lookup=None, **kw):
    """Per-token hybrid drafts: a copy of layers 0..E-1 (`layer`: more LayerDrafts options) and
    prompt lookup (`lookup`: LookupDrafts options; min_ngram 2 unless given)."""
    spec = eecore.SelfSpeculativeConfig(
        num_speculations=d, hybrid_switch="token",
        layer=eecore.LayerDrafts(exit_layer=E, max_length=max_length, copy=eecore.DraftCopy(), **(layer or {})),
        lookup=eecore.LookupDrafts(**{"min_ngram": 2, **(lookup or {})}))
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file, speculative=spec, **kw)


def _prompts(batch: int) -> list[list[int]]:
    """Half repeat themselves (lookup matches), half are runs of distinct tokens (none at first)."""
    prompts = repetitive_prompts(VOCAB, (batch + 1) // 2, seed=batch)
    return (prompts + [list(range(3 + 13 * i, 3 + 13 * i + 7)) for i in range(batch // 2)])[:batch]


def _record_chains(llm) -> list[list[bool]]:
    """Each drafted chain's sources (True: lookup), round by round."""
    strategy, chains = llm.engine.strategy, []
    original = strategy.proposer.propose

    def spy(seqs, drafts, budgets, *rest):
        original(seqs, drafts, budgets, *rest)
        chains.extend(d.from_lookup for d in drafts if d.from_lookup)

    strategy.proposer.propose = spy
    return chains


@pytest.mark.parametrize("stop_below", [None, 0.3])
def test_greedy_is_full_depth_with_both_sources_in_one_chain(tiny, lora_file, stop_below):
    path, _ = tiny
    file, _ = lora_file
    full = eecore.LLM(path, dtype="float32", device="cpu", block_size=4)
    every_chain = []
    for batch in (1, 3, 8):
        prompts = _prompts(batch)
        params = [greedy(12 + 3 * i) for i in range(batch)]
        expected = [o.token_ids for o in full.generate(prompts, params)]
        llm = _switching(path, file, layer=dict(stop_below=stop_below), max_num_seqs=8)
        chains = _record_chains(llm)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        assert sum(o.metrics["num_lookup_drafted_tokens"] for o in outs) > 0
        assert sum(o.metrics["num_layer_drafted_tokens"] for o in outs) > 0
        for o in outs:
            m = o.metrics
            assert m["num_drafted_tokens"] == m["num_lookup_drafted_tokens"] + m["num_layer_drafted_tokens"]
            assert m["num_accepted_tokens"] == m["num_lookup_accepted_tokens"] + m["num_layer_accepted_tokens"]
        every_chain += chains
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
        assert llm.engine.strategy.draft_stack.tracked() == 0
    # a layer token followed by a lookup continuation, and a lookup run continued by the copy
    assert any(c[i] is False and c[i + 1] is True for c in every_chain for i in range(len(c) - 1))
    assert any(c[i] is True and c[i + 1] is False for c in every_chain for i in range(len(c) - 1))
    assert all(len(c) <= 4 and c.count(False) <= 2 for c in every_chain)


def test_copy_drafts_after_lookup_tokens_see_them(tiny, lora_file):
    """Every copy token is what HF's truncated, LoRA-merged model says after the sequence and the
    draft so far, lookup tokens included: the copy ran those tokens into its own KV cache first
    (and caught up on what earlier lookup rounds left it behind on)."""
    path, hf = tiny
    file, lora = lora_file
    llm = _switching(path, file, max_num_seqs=8, max_num_batched_tokens=9)  # catch-ups go in chunks
    strategy, seen = llm.engine.strategy, []
    take = strategy.picker.take

    def spy(logits, rows, seqs, drafts, *rest, **kw):
        for row, b in zip(logits, rows):
            seq = seqs[b]
            seen.append((seq.token_slice(0, seq.num_computed_tokens + 1) + drafts[b].tokens, row.clone()))
        return take(logits, rows, seqs, drafts, *rest, **kw)

    strategy.picker.take = spy
    chains = _record_chains(llm)
    llm.generate(_prompts(8), [greedy(12 + 3 * i) for i in range(8)])
    assert len(seen) > 10
    assert any(c[i] is True and c[i + 1] is False for c in chains for i in range(len(c) - 1))
    assert_copy_logits_match(hf, lora, 2, seen)


def _layer_tokens_cut_while_lookup_goes_on(tiny, lora_file, layer):
    """Greedy runs with `layer` (LayerDrafts options: a rule that cuts layer drafts) against the same
    runs without it: outputs
    stay full depth's, fewer layer tokens are drafted, and lookup still drafts. Returns the LLM and
    its drafted chains."""
    path, _ = tiny
    file, _ = lora_file
    prompts = _prompts(4)
    params = greedy(40)
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, params)]
    free = _switching(path, file).generate(prompts, params)
    llm = _switching(path, file, layer=layer)
    chains = _record_chains(llm)
    cut = llm.generate(prompts, params)
    assert [o.token_ids for o in cut] == expected
    layer = lambda outs: sum(o.metrics["num_layer_drafted_tokens"] for o in outs)  # noqa: E731
    assert layer(cut) < layer(free)
    assert sum(o.metrics["num_lookup_drafted_tokens"] for o in cut) > 0
    return llm, chains


def test_the_guard_judges_layer_tokens_alone(tiny, lora_file):
    """With a floor no draft copy can reach, layer tokens stop (bar probes) and lookup goes on."""
    _layer_tokens_cut_while_lookup_goes_on(
        tiny, lora_file, dict(guard=eecore.AcceptanceGuard(min_acceptance=1.0, probe_every=64)))


def test_sampling_preserves_the_full_model_law(tiny_vocab):
    """The law of the round's second and third tokens (t2, t3), where chains mix the sources: after
    the prompt's t1, a t1 in {3, 7, 1} continues by lookup; any other t1 drafts y1 from layer 1,
    and a y1 in {3, 7, 1} is then continued by lookup within the same chain."""
    path, hf = tiny_vocab
    V, n = 12, 3000
    prompt = [3, 7, 1, 3, 5]
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=64,
                     speculative=eecore.SelfSpeculativeConfig(
                         num_speculations=2, hybrid_switch="token", lookup=eecore.LookupDrafts(),
                         layer=eecore.LayerDrafts(exit_layer=1, max_length=2, copy=eecore.DraftCopy())))
    chains = _record_chains(llm)
    params = [eecore.SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    outs = llm.generate([prompt] * n, params)
    assert any(c[:2] == [False, True] for c in chains)  # layer, then lookup: a mixed chain
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        p2 = hf(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1].double().softmax(-1)
        pairs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = hf(pairs).logits[:, -1].double().softmax(-1).view(V, V, V)
    law = torch.einsum("a,ab,abc->bc", p1, p2, p3)
    assert law_p_value(counts, law) > 1e-3  # (the rejection rule's power check: test_lookup_drafts)


def test_long_draft_acceptance_ends_copy_runs_and_lookup_goes_on(tiny, lora_file):
    """long_draft_acceptance=1.0: after a rejected first copy token, a round's copy run ends at its
    first token (bar a certain one), while lookup continuations still extend the draft."""
    llm, chains = _layer_tokens_cut_while_lookup_goes_on(tiny, lora_file, dict(long_draft_acceptance=1.0))
    # after the first rounds, chains hold one copy token at most
    assert sum(c.count(False) <= 1 for c in chains) > 0.8 * len(chains), chains
    assert len(llm.engine.strategy.draft_length) == 0


def _both(switch="token", copy=True, **layer):
    """A hybrid config at exit layer 2 switching per `switch`, with a draft copy unless `copy` is
    False (a DraftCopy: that one)."""
    copy = (eecore.DraftCopy() if copy is True else copy) or None
    return eecore.SelfSpeculativeConfig(layer=eecore.LayerDrafts(exit_layer=2, copy=copy, **layer),
                                        lookup=eecore.LookupDrafts(), hybrid_switch=switch)


@pytest.mark.parametrize("make, match", [
    (lambda: _both("position"),
     r"SelfSpeculativeConfig: 'hybrid_switch' \(--hybrid-switch\) must be one of round, token, got 'position'"),
    (lambda: eecore.SelfSpeculativeConfig(layer=eecore.LayerDrafts(exit_layer=2, copy=eecore.DraftCopy()),
                                          hybrid_switch="token"),
     "hybrid_switch='token' picks between layer and lookup drafts, and this config has layer drafts only"),
    (lambda: eecore.SelfSpeculativeConfig(lookup=eecore.LookupDrafts(), hybrid_switch="token"),
     "hybrid_switch='token' picks between layer and lookup drafts, and this config has lookup drafts only"),
    (lambda: _both(copy=False), r"hybrid_switch='token' needs layer.copy=DraftCopy\(\)"),
    (lambda: _both(copy=eecore.DraftCopy(top_k=2)), "does not combine with DraftCopy 'top_k' > 1"),
    (lambda: _both(stop_below=0.5, exit_threshold=0.5), "or LayerDrafts 'exit_threshold'"),
], ids=["unknown", "layer-only", "lookup-only", "no-copy", "tree", "exits"])
def test_bad_config(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_cli_flag(tiny, capsys):
    from eecore.cli import main

    path, _ = tiny
    assert main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                 "--draft", "hybrid", "--hybrid-switch", "token", "--exit-layer", "2", "--draft-layers",
                 "separate"]) == 0
    with pytest.raises(SystemExit, match=r"hybrid_switch='token' needs layer.copy=DraftCopy\(\)"):
        main(["generate", "Hello", "--model", path, "--speculate", "--draft", "hybrid", "--hybrid-switch", "token",
              "--exit-layer", "2"])


@pytest.mark.parametrize("switch", ["round", "token"])
def test_layer_drafts_stop_above_their_batch_size_while_lookup_drafts_go_on(tiny, lora_file, switch):
    """LayerDrafts(disable_by_batch_size=2): in steps of 3-4 decoding sequences the copy never runs and
    lookup drafts still do; with 2 or fewer the copy drafts again. Greedy output stays full depth's."""
    path, _ = tiny
    file, _ = lora_file
    prompts = _prompts(4)
    params = [greedy(8 + 6 * i) for i in range(4)]  # unequal lengths: the batch shrinks from 4 to 1
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, params)]
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file, max_num_seqs=8,
                     speculative=eecore.SelfSpeculativeConfig(
                         num_speculations=4, hybrid_switch=switch, lookup=eecore.LookupDrafts(min_ngram=2),
                         layer=eecore.LayerDrafts(exit_layer=2, max_length=2, copy=eecore.DraftCopy(),
                                                  disable_by_batch_size=2)))
    strategy = llm.engine.strategy
    decoding, copy_steps, lookup_steps = [], [], []
    decode, first_pass, propose = strategy.decode, strategy.draft_stack.first_pass, strategy.lookup.continuation

    def decode_spy(seqs):
        decoding.append(len(seqs))
        return decode(seqs)

    def first_pass_spy(seqs, drafts=None):
        copy_steps.append(decoding[-1])
        return first_pass(seqs, drafts)

    def propose_spy(seq, n, after=()):
        found = propose(seq, n, after=after)
        if found:
            lookup_steps.append(decoding[-1])
        return found

    strategy.decode, strategy.draft_stack.first_pass, strategy.lookup.continuation = decode_spy, first_pass_spy, propose_spy
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert copy_steps and max(copy_steps) <= 2
    assert any(n > 2 for n in lookup_steps)  # lookup drafted where the layers did not

