"""The learned exit decision (LayerDrafts(exit_measure=...), eecore.speculative.exit_decision): its
inputs against references, its file, and that the draft rules read it."""
from __future__ import annotations

import json
import os

import pytest
import torch

import eecore
from eecore.engine.sequence import Sequence
from eecore.speculative.exit_decision import (INPUTS, SHIPPED, AgreementMeasure, AgreementModel, agreement_measure,
                                              distribution_inputs, file_sha256)
from engine_utils import greedy
from test_confident_exits import L, tiny  # noqa: F401 (a fixture)

N = len(INPUTS)


def _model(weight, bias=0.0, sha="0" * 64) -> AgreementModel:
    return AgreementModel(mean=[0.0] * N, std=[1.0] * N, weight=list(weight), bias=bias, draft_file_sha256=sha)


def test_distribution_inputs_against_their_definitions():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 50) * 3, dim=-1)
    got, top1 = distribution_inputs(probs)
    assert top1.tolist() == probs.argmax(-1).tolist()
    for i, p in enumerate(probs.tolist()):
        ranked = sorted(p, reverse=True)
        entropy = -sum(q * torch.tensor(q).log().item() for q in p)
        assert got[i].tolist() == pytest.approx([ranked[0], ranked[0] - ranked[1], entropy], rel=1e-5)
    # a one-hot row: gap 1, entropy 0 (no NaN from 0 log 0)
    assert distribution_inputs(torch.eye(4)[:1])[0].tolist() == [[1.0, 1.0, 0.0]]


def test_the_model_is_a_normalized_logistic_regression(tmp_path):
    model = AgreementModel(mean=[0.5, 0.2, 1.0, 0.3, 0.2], std=[0.2, 0.1, 0.5, 0.4, 0.4],
                           weight=[1.0, -0.5, -2.0, 0.3, 1.5], bias=0.25, draft_file_sha256="ab" * 32, how="a test")
    x = torch.rand(7, N)
    z = (x - torch.tensor(model.mean)) / torch.tensor(model.std)
    expected = torch.sigmoid(z @ torch.tensor(model.weight) + model.bias)
    assert torch.allclose(model.probability(x), expected)
    path = str(tmp_path / "decision.json")
    model.save(path)
    again = AgreementModel.load(path)
    assert again == model and torch.allclose(again.probability(x), expected)
    with open(path) as f:
        data = json.load(f)
    data["inputs"] = data["inputs"][:4]
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match="not a eecore-exit-decision-1 file"):
        AgreementModel.load(path)
    with pytest.raises(ValueError, match="'weight' must hold 5 numbers"):
        _model([1.0, 2.0])


def test_the_lookup_inputs_read_the_sequence_and_the_draft_so_far():
    # weight on "lookup agrees" alone: P ~ 1 where the lookup's token is the draft's, 0.5 elsewhere
    measure = AgreementMeasure(_model([0, 0, 0, 0, 30.0]))
    seq = Sequence([5, 6, 7, 8, 5, 6], eecore.SamplingParams())  # "5 6" was followed by 7
    probs = torch.full((3, 10), 0.1)
    got = measure.confidence(probs, [7, 9, 8], [seq, seq, seq], [[], [], [7]])
    assert got[0] == pytest.approx(1.0) and got[1] == pytest.approx(0.5) and got[2] == pytest.approx(1.0)
    # no match at all: "has a token" is 0 too
    other = Sequence([1, 2, 3], eecore.SamplingParams())
    has_weight = AgreementMeasure(_model([0, 0, 0, 30.0, 0]))
    assert has_weight.confidence(probs[:2], [4, 7], [other, seq], [[], []]) == pytest.approx([0.5, 1.0])
    has_weight.release(other)
    has_weight.release(seq)
    assert len(has_weight.lookup) == 0
    # the decoder's lookup is shared only with the n-grams the model was fit with
    from eecore.text.ngram_index import PromptLookup
    same, other_ngrams = PromptLookup(2, 4), PromptLookup(1, 3)
    assert AgreementMeasure(_model([0.0] * N), same).lookup is same
    assert AgreementMeasure(_model([0.0] * N), other_ngrams).lookup is not other_ngrams


def test_a_model_is_refused_for_another_draft_file(tmp_path):
    draft = tmp_path / "draft.safetensors"
    draft.write_bytes(b"some drafts")
    path = str(tmp_path / "decision.json")
    _model([0.0] * N, sha=file_sha256(str(draft))).save(path)
    assert agreement_measure(str(draft), model_file=path).model.draft_file_sha256 == file_sha256(str(draft))
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"other drafts")
    for source in (str(other), None):
        with pytest.raises(ValueError, match="exit_measure='agreement' reads a model fit for one draft file"):
            agreement_measure(source, model_file=path)


def test_the_shipped_model_is_for_the_shipped_draft_layers():
    from eecore.models.exit_adapter import SHIPPED_DRAFT_FILE

    model = AgreementModel.load(SHIPPED)
    assert model.draft_file_sha256 == file_sha256(SHIPPED_DRAFT_FILE)
    # it learned what the measurements say: surer drafts, and drafts prompt lookup agrees with, are
    # right more often
    assert model.weight[0] > 0 and model.weight[4] > 0 and model.how


def _llm(path, file, measure, **layer):
    spec = eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
        exit_layer=2, copy=eecore.DraftCopy(), exit_measure=measure, **layer))
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file, speculative=spec)


@pytest.mark.parametrize("bias", [-30.0, 30.0], ids=["never-agrees", "always-agrees"])
def test_the_draft_rules_read_the_measure(tiny, tmp_path, bias):
    path, _, file, _ = tiny
    model_file = str(tmp_path / "decision.json")
    _model([0.0] * N, bias=bias, sha=file_sha256(file)).save(model_file)
    prompts = [[3, 9, 27, 81, 3, 9], [100, 101, 102]]
    full = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, greedy(16))]
    # the stop rule: a measure of 0 stops every chain before its first draft; of 1, none
    verified = _llm(path, file, model_file, stop_below=0.5).generate(prompts, greedy(16))
    assert [o.token_ids for o in verified] == full
    drafted = sum(o.metrics["num_drafted_tokens"] for o in verified)
    assert (drafted == 0) if bias < 0 else (drafted > 0)
    # exits: a measure of 1 lets every draft exit unverified; of 0, none
    exits = _llm(path, file, model_file, exit_threshold=0.5).generate(prompts, greedy(16))
    exited = sum(layer == 2 for o in exits for layer in o.exit_layers)
    if bias < 0:
        assert exited == 0 and [o.token_ids for o in exits] == full
    else:
        assert exited >= 16


def test_bad_exit_measure(tiny):
    path, _, file, _ = tiny
    with pytest.raises(ValueError, match=r"LayerDrafts: 'exit_measure' \(--exit-measure\) must be None, 'agreement' or"):
        eecore.LayerDrafts(exit_layer=2, exit_measure="entropy")
    # the shipped model is for the shipped draft layers, not this file's
    with pytest.raises(ValueError, match="exit_measure='agreement' reads a model fit for one draft file"):
        _llm(path, file, "agreement", stop_below=0.5)
    assert os.path.isfile(SHIPPED)


# ---- calibrating the exit threshold (eecore.speculative.exit_calibration) --------------------------

def test_calibration_tests_thresholds_from_the_most_conservative_down(tiny):
    from eecore.speculative.exit_calibration import calibrate_exit_threshold

    path, _, file, _ = tiny
    prompts = [[3 + i, 40 + 2 * i, 7, 90 + i] for i in range(12)]
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file,
                     speculative=eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
                         exit_layer=2, copy=eecore.DraftCopy(), stop_below=0.1, exit_threshold=0.9)))
    full = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, greedy(10))]
    result = calibrate_exit_threshold(llm, prompts, 0.3, 0.1, max_tokens=10, ignore_eos=True,
                                      candidates=[1.0, 0.6, 0.3, 0.1])
    tested = result.data["candidates"]
    assert [c["threshold"] for c in tested] == [1.0, 0.6, 0.3, 0.1][: len(tested)]
    # passing is a prefix; the chosen threshold is the last that passed, and 1.0 alone is no answer
    flags = [c["passed"] for c in tested]
    assert flags == sorted(flags, reverse=True)
    chosen = [c["threshold"] for c in tested if c["passed"]]
    assert result.threshold == (chosen[-1] if chosen and chosen[-1] < 1.0 else None)
    assert result.passed == (result.threshold is not None)
    assert all(c["passed"] == (c["p_value"] <= 0.1) for c in tested)
    shares = [c["exit_share"] for c in tested]
    assert len(tested) >= 2 and shares[-1] > shares[0]  # lower thresholds let more drafts exit
    # the built threshold is back, and without exits the engine still gives full depth's output
    picker = llm.engine.strategy.picker
    assert picker.exit_threshold == 0.9
    picker.exit_threshold = 1.01
    assert [llm.generate([p], greedy(10))[0].token_ids for p in prompts] == full
    with pytest.raises(ValueError, match="cannot pass any threshold"):
        calibrate_exit_threshold(llm, prompts[:5], 0.3, 0.1)
    # binomial p-values test 0/1 losses: each candidate's risk is then a share of prompts
    binomial = calibrate_exit_threshold(llm, prompts, 0.3, 0.1, max_tokens=10, ignore_eos=True,
                                        candidates=[1.0, 0.6, 0.3, 0.1], p_value="binomial")
    assert all(round(c["risk"] * len(prompts)) == pytest.approx(c["risk"] * len(prompts))
               for c in binomial.data["candidates"])
    plain = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file,
                       speculative=eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
                           exit_layer=2, copy=eecore.DraftCopy())))
    with pytest.raises(ValueError, match="build the LLM with layer drafts and an exit threshold"):
        calibrate_exit_threshold(plain, prompts, 0.3, 0.1)


def test_exits_and_adaptive_lengths_are_refused_together():
    with pytest.raises(ValueError, match="'adaptive' does not combine with LayerDrafts 'exit_threshold'"):
        eecore.SelfSpeculativeConfig(adaptive=True, layer=eecore.LayerDrafts(exit_layer=2, exit_threshold=0.8,
                                                                             copy=eecore.DraftCopy()))
    # the presets' flags give up their adaptive lengths for exits, unless told otherwise
    from eecore.cli.speculative_flags import preset_with

    layer = eecore.SelfSpeculativeConfig.exit_ready("layer")
    assert not preset_with(layer, dict(exit_threshold=0.8)).adaptive
    with pytest.raises(ValueError, match="'adaptive' does not combine"):
        preset_with(layer, dict(exit_threshold=0.8, adaptive_drafts=True))


def test_cli_calibrates_the_exit_ready_exits(tmp_path, capsys):
    from eecore.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nimport os\nclass Stack:\n")
    out = str(tmp_path / "exits.json")
    base = ["calibrate", "--exit-ready", "--prompts", str(prompts), "--out", out, "--epsilon", "0.1",
            "--max-tokens", "6", "--ignore-eos", "--chat", "off", "--candidates", "3"]
    assert main(base + ["--tolerance", "0.2"]) == 2  # token consistency is not for draft exits
    assert "--consistency text" in capsys.readouterr().err
    assert main(base + ["--tolerance", "0.2", "--consistency", "text", "--measure", "softmax"]) == 2
    assert "leave out" in capsys.readouterr().err
    # a tolerance this loose passes every candidate: the last, 0.0, lets every draft exit
    assert main(base + ["--tolerance", "0.99", "--consistency", "text"]) == 0
    assert "--exit-threshold 0" in capsys.readouterr().out
    with open(out) as f:
        data = json.load(f)
    assert data["threshold"] == 0.0 and data["exit_measure"] == "probability"
    assert [c["threshold"] for c in data["candidates"]] == [1.0, 0.5, 0.0]
