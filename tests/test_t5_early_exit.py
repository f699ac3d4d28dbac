"""Early exit in the T5 decoder against the seed paper's Algorithm 1 in pure PyTorch on HF's T5
modules (tests/t5_ee_reference.py): static exits with the skipped layers' self-attention K/V
filled from the exit state, every dynamic measure, both batch rules."""
import pytest
import torch

import eecore
from engine_utils import greedy, random_prompts
from t5_ee_reference import T5ReferenceEarlyExit
from t5_factory import make_tiny_t5, save_tiny_t5

NUM_LAYERS = 6
MAX_TOKENS = 10


def _make(tmp_path, variant):
    path, hf = make_tiny_t5(tmp_path, variant, num_decoder_layers=NUM_LAYERS)
    if variant == "v1.1":
        # a sharper head, so softmax confidence varies from layer to layer
        with torch.no_grad():
            hf.lm_head.weight.mul_(8.0)
        save_tiny_t5(hf, path)
    return path, hf


@pytest.fixture(scope="module")
def peaky(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("t5ee"), "v1.1")


@pytest.fixture(scope="module", params=["v1.1", "original"])
def both(request, tmp_path_factory):
    return _make(tmp_path_factory.mktemp("t5ee"), request.param)


def _prompts(hf, lengths, seed):
    return [[2 + t % (hf.config.vocab_size - 2) for t in p] + [1] for p in random_prompts(hf.config.vocab_size, lengths, seed)]


def _run(path, prompts, **ee):
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=128, block_size=4,
                     early_exit=eecore.EarlyExitConfig(**ee))
    outs = llm.generate(prompts, greedy(MAX_TOKENS))
    return [o.token_ids for o in outs], [o.exit_layers for o in outs]


def _reference(hf, prompts, *args, **kw):
    return T5ReferenceEarlyExit(hf, prompts, *args, **kw).generate(MAX_TOKENS)


def test_full_depth_reference_matches_the_engine(both):
    """The oracle itself, at full depth, against the engine (which matches HF): guards the oracle."""
    path, hf = both
    prompts = _prompts(hf, [4, 9], seed=0)
    full = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(MAX_TOKENS))]
    assert _reference(hf, prompts, "static", exit_layer=NUM_LAYERS)[0] == full


@pytest.mark.parametrize("exit_layer", [1, 3, 5])
def test_static_exit_matches_reference(both, exit_layer):
    path, hf = both
    prompts = _prompts(hf, [4, 11], seed=1)
    tokens, exits = _run(path, prompts, measure="static", exit_layer=exit_layer)
    assert (tokens, exits) == _reference(hf, prompts, "static", exit_layer=exit_layer)
    assert all(row[1:] == [exit_layer] * (MAX_TOKENS - 1) for row in exits)


def test_static_exit_differs_from_full_depth(peaky):
    """Guards the test above: exiting early does change the tokens on this model."""
    path, hf = peaky
    prompts = _prompts(hf, [4, 11], seed=1)
    assert _run(path, prompts, measure="static", exit_layer=2)[0] != _run(path, prompts, measure="static",
                                                                          exit_layer=NUM_LAYERS)[0]


@pytest.mark.parametrize("measure", ["softmax", "cosine"])
def test_unreachable_threshold_is_full_depth(peaky, measure):
    path, hf = peaky
    prompts = _prompts(hf, [5, 9, 2], seed=2)
    full = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(MAX_TOKENS))]
    tokens, exits = _run(path, prompts, measure=measure, threshold=1.0)
    assert tokens == full and all(e == NUM_LAYERS for row in exits for e in row)


@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.8])
def test_softmax_exit_at_batch_one_matches_algorithm_1(peaky, threshold):
    path, hf = peaky
    for seed in range(2):
        prompt = _prompts(hf, [6 + 3 * seed], seed=10 + seed)
        assert _run(path, prompt, measure="softmax", threshold=threshold) == \
            _reference(hf, prompt, "softmax", threshold)


def test_softmax_thresholds_exercise_early_exits(peaky):
    path, hf = peaky
    prompts = _prompts(hf, [6, 7, 8], seed=10)
    layers = [e for row in _run(path, prompts, measure="softmax", threshold=0.5, batch_rule="compact")[1]
              for e in row[1:]]
    assert min(layers) < NUM_LAYERS and len(set(layers)) > 1


def test_all_rule_batch_matches_reference_and_exits_together(peaky):
    path, hf = peaky
    prompts = _prompts(hf, [3, 8, 5, 11], seed=3)
    tokens, exits = _run(path, prompts, measure="softmax", threshold=0.4, batch_rule="all")
    assert (tokens, exits) == _reference(hf, prompts, "softmax", 0.4, rule="all")
    for t in range(MAX_TOKENS):
        assert len({row[t] for row in exits}) == 1


def test_compact_rule_matches_the_per_sequence_reference(peaky):
    path, hf = peaky
    prompts = _prompts(hf, [3, 8, 5, 11], seed=4)
    tokens, exits = _run(path, prompts, measure="softmax", threshold=0.4, batch_rule="compact")
    assert len({e for row in exits for e in row[1:]}) > 1, "rows were meant to exit at different layers"
    for b, prompt in enumerate(prompts):
        ref_tokens, ref_exits = _reference(hf, [prompt], "softmax", 0.4, rule="compact")
        assert (tokens[b], exits[b]) == (ref_tokens[0], ref_exits[0])


@pytest.mark.parametrize("rule", ["all", "compact"])
def test_cosine_exit_matches_reference(peaky, rule):
    path, hf = peaky
    prompts = _prompts(hf, [4, 9], seed=5)
    tokens, exits = _run(path, prompts, measure="cosine", threshold=0.9, min_exit_layer=2, batch_rule=rule)
    if rule == "all":
        assert (tokens, exits) == _reference(hf, prompts, "cosine", 0.9, min_exit_layer=2, rule=rule)
    else:
        for b, p in enumerate(prompts):
            ref = _reference(hf, [p], "cosine", 0.9, min_exit_layer=2, rule=rule)
            assert (tokens[b], exits[b]) == (ref[0][0], ref[1][0])


def test_decaying_threshold_and_check_every_match_reference(peaky):
    path, hf = peaky
    prompts = _prompts(hf, [5], seed=6)
    kw = dict(min_exit_layer=2, check_every=2)
    tokens, exits = _run(path, prompts, measure="softmax", threshold=0.6, decay=4.0, **kw)
    assert (tokens, exits) == _reference(hf, prompts, "softmax", 0.6, decay=4.0, **kw)
    assert all(e in (2, 4, NUM_LAYERS) for e in exits[0])


def test_classifier_exit_matches_reference(both, tmp_path):
    from eecore.exits.classifier import ExitClassifier

    path, hf = both
    d = hf.config.d_model
    g = torch.Generator().manual_seed(0)
    weights = {E: (torch.randn(8, d, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g),
                   torch.randn(1, generator=g)) for E in range(1, NUM_LAYERS + 1)}
    file = tmp_path / "exit.safetensors"
    ExitClassifier(d, weights).save(str(file))
    prompts = _prompts(hf, [6, 3], seed=7)
    for rule in ("all", "compact"):
        tokens, exits = _run(path, prompts, measure="classifier", threshold=0.7, classifier_path=str(file),
                             batch_rule=rule)
        if rule == "all":
            assert (tokens, exits) == _reference(hf, prompts, "classifier", 0.7, classifier=weights, rule=rule)
        else:
            for b, p in enumerate(prompts):
                ref = _reference(hf, [p], "classifier", 0.7, classifier=weights, rule=rule)
                assert (tokens[b], exits[b]) == (ref[0][0], ref[1][0])


def test_early_exit_under_preemption_keeps_outputs(peaky):
    path, hf = peaky
    prompts = _prompts(hf, [6, 10, 3, 8], seed=8)
    config = eecore.EarlyExitConfig(measure="softmax", threshold=0.4, batch_rule="compact")
    roomy = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=128, block_size=4, early_exit=config)
    tight = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=16, block_size=4, early_exit=config)
    expected = roomy.generate(prompts, greedy(16))
    outs = tight.generate(prompts, greedy(16))
    preempted = [o.metrics["num_preemptions"] > 0 for o in outs]
    assert any(preempted) and not all(preempted)
    # Under the compact rule each row exits on its own, so a request that kept its blocks decodes
    # exactly as in a roomy cache. A preempted one recomputes its earlier tokens' K/V at full depth
    # (not from their exit states), so its later tokens may legitimately differ.
    for out, ref, was_preempted in zip(outs, expected, preempted):
        assert len(out.token_ids) == 16
        if not was_preempted:
            assert (out.token_ids, out.exit_layers) == (ref.token_ids, ref.exit_layers)
    assert tight.engine.blocks.num_free_blocks == 16


@pytest.mark.parametrize("draft", ["layer", "lookup", "hybrid"])
def test_self_speculation_equals_full_depth(peaky, draft):
    """Drafts and verification run the same decoder pieces (cross-attention included), so greedy
    self-speculation yields exactly the full model's tokens."""
    path, hf = peaky
    prompts = _prompts(hf, [5, 2, 12], seed=9)
    full = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(16))]
    spec = eecore.SelfSpeculativeConfig(
        num_speculations=3, layer=None if draft == "lookup" else eecore.LayerDrafts(exit_layer=3),
        lookup=None if draft == "layer" else eecore.LookupDrafts())
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=128, block_size=4, speculative=spec)
    assert [o.token_ids for o in llm.generate(prompts, greedy(16))] == full
    assert llm.engine.blocks.num_free_blocks == 128


def test_exit_adapters_are_refused(peaky, tmp_path):
    path, _ = peaky
    with pytest.raises(ValueError, match="'exit_adapter' is for decoder-only models"):
        eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=str(tmp_path / "adapters.safetensors"))
