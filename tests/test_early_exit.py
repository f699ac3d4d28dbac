"""Early-exit decoding against a pure-PyTorch oracle of the seed paper's Algorithm 1."""
import pytest
import torch

import eecore
from ee_reference import ReferenceEarlyExit
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model

NUM_LAYERS = 6
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def peaky(tmp_path_factory):
    """A tiny Llama whose LM head is scaled up, so softmax confidence actually varies by layer."""
    path, hf = make_tiny_hf_model(tmp_path_factory.mktemp("ee"), arch="llama", tie=False, num_layers=NUM_LAYERS)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40.0)
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _llm(path, **ee):
    return eecore.LLM(path, dtype="float32", device="cpu", num_blocks=128, block_size=4,
                      early_exit=eecore.EarlyExitConfig(**ee))


def _run(path, prompts, **ee):
    outs = _llm(path, **ee).generate(prompts, greedy(MAX_TOKENS))
    return [o.token_ids for o in outs], [o.exit_layers for o in outs]


@pytest.mark.parametrize("measure", ["softmax", "cosine"])
def test_unreachable_threshold_is_full_depth(peaky, measure):
    path, hf = peaky
    prompts = random_prompts(hf.config.vocab_size, [5, 9, 2])
    full = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(MAX_TOKENS))]
    tokens, exits = _run(path, prompts, measure=measure, threshold=1.0)
    assert tokens == full
    assert all(e == NUM_LAYERS for row in exits for e in row)


@pytest.mark.parametrize("exit_layer", [1, 3, 5])
def test_static_exit_matches_reference(peaky, exit_layer):
    path, hf = peaky
    prompts = random_prompts(hf.config.vocab_size, [4, 7], seed=1)
    tokens, exits = _run(path, prompts, measure="static", exit_layer=exit_layer)
    ref_tokens, ref_exits = ReferenceEarlyExit(hf, measure="static", exit_layer=exit_layer).generate(prompts, MAX_TOKENS)
    assert tokens == ref_tokens
    assert exits == ref_exits
    assert all(row[1:] == [exit_layer] * (MAX_TOKENS - 1) for row in exits)


@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.8])
def test_softmax_exit_at_batch_one_matches_algorithm_1(peaky, threshold):
    path, hf = peaky
    for seed in range(3):
        prompt = random_prompts(hf.config.vocab_size, [6 + seed], seed=10 + seed)
        tokens, exits = _run(path, prompt, measure="softmax", threshold=threshold)
        ref_tokens, ref_exits = ReferenceEarlyExit(hf, "softmax", threshold).generate(prompt, MAX_TOKENS)
        assert (tokens, exits) == (ref_tokens, ref_exits)


def test_softmax_thresholds_exercise_early_exits(peaky):
    """Guards the test above: its thresholds do make some tokens exit early and some not."""
    path, hf = peaky
    prompts = random_prompts(hf.config.vocab_size, [6, 7, 8], seed=10)
    layers = [e for row in _run(path, prompts, measure="softmax", threshold=0.5, batch_rule="compact")[1]
              for e in row[1:]]
    assert min(layers) < NUM_LAYERS and len(set(layers)) > 1


def test_all_rule_batch_matches_reference_and_exits_together(peaky):
    path, hf = peaky
    prompts = random_prompts(hf.config.vocab_size, [3, 8, 5, 11], seed=2)
    tokens, exits = _run(path, prompts, measure="softmax", threshold=0.4, batch_rule="all")
    ref = ReferenceEarlyExit(hf, "softmax", 0.4, rule="all").generate(prompts, MAX_TOKENS)
    assert (tokens, exits) == ref
    for t in range(MAX_TOKENS):  # one exit layer per iteration for the whole batch
        assert len({row[t] for row in exits}) == 1


def test_compact_rule_matches_the_per_sequence_reference(peaky):
    path, hf = peaky
    prompts = random_prompts(hf.config.vocab_size, [3, 8, 5, 11], seed=3)
    tokens, exits = _run(path, prompts, measure="softmax", threshold=0.4, batch_rule="compact")
    for b, prompt in enumerate(prompts):
        ref_tokens, ref_exits = ReferenceEarlyExit(hf, "softmax", 0.4, rule="compact").generate([prompt], MAX_TOKENS)
        assert tokens[b] == ref_tokens[0]
        assert exits[b] == ref_exits[0]


@pytest.mark.parametrize("rule", ["all", "compact"])
def test_cosine_exit_matches_reference(peaky, rule):
    path, hf = peaky
    prompts = random_prompts(hf.config.vocab_size, [4, 9], seed=4)
    threshold = 0.9
    tokens, exits = _run(path, prompts, measure="cosine", threshold=threshold, min_exit_layer=2, batch_rule=rule)
    ref = ReferenceEarlyExit(hf, "cosine", threshold, min_exit_layer=2, rule=rule)
    if rule == "all":
        assert (tokens, exits) == ref.generate(prompts, MAX_TOKENS)
    else:
        for b, p in enumerate(prompts):
            assert (tokens[b], exits[b]) == tuple(r[0] for r in ref.generate([p], MAX_TOKENS))


def test_decaying_threshold_and_check_every_match_reference(peaky):
    path, hf = peaky
    prompts = random_prompts(hf.config.vocab_size, [5], seed=5)
    kw = dict(min_exit_layer=2, check_every=2)
    tokens, exits = _run(path, prompts, measure="softmax", threshold=0.6, decay=4.0, **kw)
    ref = ReferenceEarlyExit(hf, "softmax", 0.6, decay=4.0, **kw).generate(prompts, MAX_TOKENS)
    assert (tokens, exits) == ref
    assert all(e in (2, 4, NUM_LAYERS) for e in exits[0])


def _random_classifier(hidden, layers, path):
    from eecore.exits.classifier import ExitClassifier

    g = torch.Generator().manual_seed(0)
    weights = {E: (torch.randn(8, hidden, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g),
                   torch.randn(1, generator=g)) for E in layers}
    ExitClassifier(hidden, weights).save(str(path))
    return weights


def test_classifier_exit_matches_reference(peaky, tmp_path):
    path, hf = peaky
    file = tmp_path / "exit.safetensors"
    weights = _random_classifier(hf.config.hidden_size, range(1, NUM_LAYERS + 1), file)
    prompts = random_prompts(hf.config.vocab_size, [6], seed=6)
    tokens, exits = _run(path, prompts, measure="classifier", threshold=0.7, classifier_path=str(file))
    ref = ReferenceEarlyExit(hf, "classifier", 0.7, classifier=weights).generate(prompts, MAX_TOKENS)
    assert (tokens, exits) == ref


def test_wasted_layers_are_reported_under_the_all_rule(peaky):
    path, hf = peaky
    prompts = random_prompts(hf.config.vocab_size, [3, 8, 5, 11], seed=2)
    outs = _llm(path, measure="softmax", threshold=0.4).generate(prompts, greedy(MAX_TOKENS))
    wasted = [o.metrics["layers_wasted_per_token"] for o in outs]
    assert all(w >= 0 for w in wasted) and any(w > 0 for w in wasted)
    assert all(0 <= o.metrics["early_exit_rate"] <= 1 for o in outs)


# ---- bad configurations ---------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(threshold=1.5), "'threshold'"),
    (dict(threshold=-0.1), "'threshold'"),
    (dict(measure="entropy"), "'measure'"),
    (dict(batch_rule="some"), "'batch_rule'"),
    (dict(measure="static"), "'exit_layer'"),
    (dict(measure="classifier"), "'classifier_path'"),
    (dict(min_exit_layer=0), "'min_exit_layer'"),
    (dict(decay=-1.0), "'decay'"),
])
def test_bad_config_is_a_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        eecore.EarlyExitConfig(**kw)


def test_per_layer_threshold_needs_one_value_per_layer(peaky):
    path, _ = peaky
    with pytest.raises(ValueError, match="needs 6 values"):
        _llm(path, threshold=[0.5, 0.5])


def test_missing_or_malformed_classifier_file(peaky, tmp_path):
    from safetensors.torch import save_file

    from eecore.exits.classifier import ClassifierFileError

    path, hf = peaky
    with pytest.raises(ClassifierFileError, match="does not exist"):
        _llm(path, measure="classifier", classifier_path=str(tmp_path / "nope.safetensors"))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ClassifierFileError, match="not a readable safetensors"):
        _llm(path, measure="classifier", classifier_path=str(garbage))
    bad_shape = tmp_path / "shape.safetensors"
    d = hf.config.hidden_size
    save_file({"layers.2.w1": torch.zeros(4, d + 1), "layers.2.b1": torch.zeros(4), "layers.2.w2": torch.zeros(4),
               "layers.2.b2": torch.zeros(1)}, str(bad_shape),
              metadata={"format": "eecore-exit-classifier", "version": "1", "hidden_size": str(d)})
    with pytest.raises(ClassifierFileError, match="shapes"):
        _llm(path, measure="classifier", classifier_path=str(bad_shape))
    no_meta = tmp_path / "meta.safetensors"
    save_file({"layers.2.w1": torch.zeros(4, d)}, str(no_meta))
    with pytest.raises(ClassifierFileError, match="'format'"):
        _llm(path, measure="classifier", classifier_path=str(no_meta))
