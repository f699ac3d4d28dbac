"""The learned exit decision as an Algorithm 1 measure (EarlyExitConfig(measure="agreement"),
eecore.exits.agreement): against the pure-PyTorch oracle under both batch rules, through the static
segments that CUDA graphs capture, fit from teacher-forced positions (eecore.train.exit_decision),
calibrated into a thresholds file and read back, and its bad inputs."""
from __future__ import annotations

import json

import pytest
import torch

import eecore
from eecore.exits import agreement
from eecore.exits.agreement import DecisionFileError, position_proposals
from eecore.exits.decision import INPUTS, LogisticDecision
from eecore.exits.static_segments import StaticExitSegments
from eecore.train import exit_decision
from ee_reference import ReferenceEarlyExit, lookup_next
from engine_utils import emulate_graphs, greedy, random_prompts
from model_factory import make_tiny_hf_model
from test_early_exit import NUM_LAYERS, MAX_TOKENS, peaky  # noqa: F401 (a fixture: a tiny Llama, sharp LM head)

# weights on (top-1 probability, gap, entropy, lookup has a token, lookup agrees): what decides
# here is mostly the lookup, so rows differ and the oracle's float order cannot flip a decision
WEIGHTS = {2: [1.0, 0.5, -0.2, 0.8, 2.0], 4: [0.5, 1.0, -0.1, 1.5, 1.0]}


def _decisions(bias: float = 0.0) -> dict[int, LogisticDecision]:
    return {E: LogisticDecision(mean=[0.5, 0.3, 1.0, 0.5, 0.3], std=[0.3, 0.3, 1.0, 0.5, 0.5], weight=w, bias=bias)
            for E, w in WEIGHTS.items()}


@pytest.fixture(scope="module")
def decision_file(peaky, tmp_path_factory):
    path, _ = peaky
    file = str(tmp_path_factory.mktemp("decision") / "decision.json")
    agreement.save(file, _llm(path).model, None, _decisions(), how="a test")
    return file


def _llm(path, **ee):
    return eecore.LLM(path, dtype="float32", device="cpu", num_blocks=160, block_size=4,
                      early_exit=eecore.EarlyExitConfig(**ee) if ee else None)


def _prompts(vocab, seed):
    # prompts that repeat themselves, so prompt lookup proposes at some positions and not at others
    return [p + p[:3] + p for p in random_prompts(vocab, [3, 6, 4, 5], seed=seed)]


def _reference(hf, threshold, rule):
    return ReferenceEarlyExit(hf, "agreement", threshold, rule=rule, decisions={
        E: tuple(torch.tensor(v) for v in (d.mean, d.std, d.weight)) + (d.bias,) for E, d in _decisions().items()})


@pytest.mark.parametrize("threshold", [0.5, 0.7])
@pytest.mark.parametrize("rule", ["all", "compact"])
def test_the_measure_matches_the_oracle_under_both_batch_rules(peaky, decision_file, rule, threshold):
    path, hf = peaky
    prompts = _prompts(hf.config.vocab_size, seed=7)
    outs = _llm(path, measure="agreement", threshold=threshold, batch_rule=rule,
                decision_path=decision_file).generate(prompts, greedy(MAX_TOKENS))
    tokens, exits = [o.token_ids for o in outs], [o.exit_layers for o in outs]
    ref = _reference(hf, threshold, rule)
    if rule == "all":
        assert (tokens, exits) == ref.generate(prompts, MAX_TOKENS)
    else:  # each row on its own
        for b, prompt in enumerate(prompts):
            assert (tokens[b], exits[b]) == tuple(r[0] for r in ref.generate([prompt], MAX_TOKENS))
    layers = [e for row in exits for e in row[1:]]
    assert set(layers) - {NUM_LAYERS}, "nothing exited: the test would not cover the exit path"
    assert min(layers) in WEIGHTS  # only layers with a regression are checked
    if rule == "compact":
        assert len(set(layers)) > 1, "every row exited alike: the test would not tell the rules apart"


def test_an_unreachable_threshold_is_full_depth(peaky, decision_file):
    path, hf = peaky
    prompts = _prompts(hf.config.vocab_size, seed=8)
    full = [o.token_ids for o in _llm(path).generate(prompts, greedy(MAX_TOKENS))]
    outs = _llm(path, measure="agreement", threshold=1.0, batch_rule="compact",
                decision_path=decision_file).generate(prompts, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outs] == full
    assert all(e == NUM_LAYERS for o in outs for e in o.exit_layers)


@pytest.mark.parametrize("graphs", [False, True])
def test_static_segments_give_the_eager_iteration(peaky, decision_file, graphs):
    """The measure inside the segments CUDA graphs capture (run eagerly here, or replayed by the
    graph emulation): prompt lookup's tokens reach it through a static buffer, padded rows get
    none, and the tokens, exits and logprobs are the eager iteration's."""
    path, hf = peaky
    prompts = _prompts(hf.config.vocab_size, seed=9) + random_prompts(hf.config.vocab_size, [7, 2, 9], seed=3)
    params = [greedy(4 + 2 * i, logprobs=2 if i % 2 else None) for i in range(len(prompts))]
    config = dict(measure="agreement", threshold=0.6, decision_path=decision_file)
    eager = _llm(path, **config).generate(prompts, params)
    llm = _llm(path, **config)
    strategy = llm.engine.strategy
    static = StaticExitSegments(strategy, llm.engine.config.max_num_seqs, capture=False)
    strategy.static = emulate_graphs(static) if graphs else static
    outs = llm.generate(prompts, params)
    assert static.outputs or static.graphs
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert [o.exit_layers for o in outs] == [o.exit_layers for o in eager]
    assert min(e for o in outs for e in o.exit_layers) < NUM_LAYERS
    for a, b in zip(outs, eager):
        for step_a, step_b in zip(a.logprobs or [], b.logprobs or []):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a)
    assert len(strategy.measure.lookup) == 0, "finished sequences must release their lookup index"


def test_position_proposals_are_prompt_lookup_at_each_position():
    ids = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6]
    for start in (0, 3, 7):
        assert position_proposals(ids, start, len(ids)) == \
            [-1 if (t := lookup_next(ids[: p + 1])) is None else t for p in range(start, len(ids))]


def test_collect_gives_the_inputs_and_labels_of_their_definitions(peaky):
    """Teacher-forced positions: each row's inputs from the layer's head on the prefix's state, and
    its label whether that head's token is full depth's next token."""
    path, hf = peaky
    llm = _llm(path)
    prompts = _prompts(hf.config.vocab_size, seed=11)[:2]
    data = exit_decision.collect(llm, prompts, 8, [2, 4])
    outs = llm.generate(prompts, greedy(8))
    positions = sum(len(o.token_ids) - 1 for o in outs)
    ref = ReferenceEarlyExit(hf, "static")
    for E, (x, y) in data.items():
        assert x.shape == (positions, len(INPUTS)) and y.shape == (positions,)
        row = 0
        for prompt, out in zip(prompts, outs):
            ids = prompt + out.token_ids
            for j in range(1, len(out.token_ids)):  # output token j, from the state at its previous position
                with torch.no_grad():
                    h = hf.model(torch.tensor([ids[: len(prompt) + j]]), output_hidden_states=True).hidden_states[E][0, -1]
                    p = ref._logits(h).float().softmax(-1)
                top = p.topk(2)
                proposal = lookup_next(ids[: len(prompt) + j])
                want = [top.values[0], top.values[0] - top.values[1], -(p * p.clamp_min(1e-12).log()).sum(),
                        float(proposal is not None), float(proposal == int(top.indices[0]))]
                assert x[row].tolist() == pytest.approx([float(v) for v in want], rel=1e-3, abs=1e-4)
                assert y[row].item() == float(int(top.indices[0]) == out.token_ids[j])
                row += 1


def test_the_fitter_writes_a_file_the_engine_reads(peaky, tmp_path):
    path, hf = peaky
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("one two three one two three\nfour five four five four\n")
    out = str(tmp_path / "fit.json")
    assert exit_decision.main(["--out", out, "--model", path, "--dtype", "float32", "--layers", "2", "4",
                               "--prompts", str(prompts_file), "--chat", "off", "--max-tokens", "12"]) == 0
    with open(out) as f:
        data = json.load(f)
    assert sorted(data["layers"]) == ["2", "4"] and data["exit_adapter"] is None
    assert all(data["layers"][k]["positions"] == 2 * 11 for k in data["layers"])
    llm = _llm(path, measure="agreement", threshold=0.5, decision_path=out)
    assert sorted(llm.engine.strategy.checks) == [2, 4]
    assert exit_decision.main(["--out", out, "--model", path, "--dtype", "float32"]) == 2  # no layers, no prompts


def test_fit_logistic_separates_what_it_can():
    from eecore.exits.decision import fit_logistic

    g = torch.Generator().manual_seed(0)
    x = torch.rand(2000, len(INPUTS), generator=g)
    y = (x[:, 4] > 0.5).float()
    decision = fit_logistic(x, y)
    p = decision.probability(x)
    assert ((p > 0.5).float() == y).float().mean() > 0.95
    with pytest.raises(ValueError, match="expected x"):
        fit_logistic(x[:, :3], y)


@pytest.mark.parametrize("consistency", ["token", "text"])
def test_calibration_round_trips_through_a_thresholds_file(peaky, decision_file, tmp_path, consistency):
    from eecore.exits import thresholds_file
    from eecore.exits.calibrator import CalibrationSettings, calibrate

    path, hf = peaky
    llm = _llm(path)
    prompts = [p for s in range(6) for p in _prompts(hf.config.vocab_size, seed=20 + s)]
    settings = CalibrationSettings(measure="agreement", tolerance=0.5, epsilon=0.5, decision_path=decision_file,
                                   consistency=consistency, max_tokens=8, candidates=[1.0, 0.9, 0.8, 0.7, 0.6])
    result = calibrate(llm, prompts, settings)
    assert result.passed, result.summary()
    assert result.data["decision"]["sha256"] == thresholds_file.file_sha256(decision_file)
    assert result.data["checked_layers"] == [2, 4]
    file = str(tmp_path / "thresholds.json")
    thresholds_file.save(result.data, file)
    config = eecore.EarlyExitConfig(threshold=file, decision_path=decision_file)
    assert config.measure == "agreement" and config.threshold == result.data["threshold"]
    assert _llm_with(path, config).generate(prompts[:2], greedy(4))
    other = str(tmp_path / "other.json")
    agreement.save(other, llm.model, None, _decisions(bias=1.0))
    with pytest.raises(ValueError, match="another decision file"):
        eecore.EarlyExitConfig(threshold=file, decision_path=other)


def _llm_with(path, config):
    return eecore.LLM(path, dtype="float32", device="cpu", num_blocks=160, block_size=4, early_exit=config)


def test_bad_decision_files_and_settings_are_clear_errors(peaky, decision_file, tmp_path, tmp_path_factory):
    path, hf = peaky
    with pytest.raises(ValueError, match="'decision_path' is only for measure='agreement'"):
        eecore.EarlyExitConfig(measure="softmax", decision_path=decision_file)
    with pytest.raises(DecisionFileError, match="does not exist"):
        _llm(path, measure="agreement", decision_path=str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DecisionFileError, match="not valid JSON"):
        _llm(path, measure="agreement", decision_path=str(bad))
    with open(decision_file) as f:
        data = json.load(f)
    for change, match in (({"format": "eecore-exit-decision-1"}, "not a eecore-exit-decision-layers-1 file"),
                          ({"inputs": list(INPUTS)[:4]}, "fit over inputs"),
                          ({"layers": {}}, "'layers' must map"),
                          ({"layers": {"2": {"mean": [0.0] * 5}}}, "layer '2'"),
                          ({"layers": {"2": dict(data["layers"]["2"], bias="high")}}, "finite numbers"),
                          ({"layers": {"2": dict(data["layers"]["2"], weight=[float("nan")] * 5)}}, "finite numbers"),
                          ({"layers": {"9": data["layers"]["2"]}}, "not below the model's 6 layers")):
        bad.write_text(json.dumps(dict(data, **change)))
        with pytest.raises(DecisionFileError, match=match):
            _llm(path, measure="agreement", decision_path=str(bad))
    # a file fit for another model of the same shape is refused, naming the setting
    other_path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("other"), arch="llama", tie=False,
                                       num_layers=NUM_LAYERS, seed=1)
    with pytest.raises(DecisionFileError, match="decision_path"):
        _llm(other_path, measure="agreement", decision_path=decision_file)
    # without a path the shipped file is read, which is for the default model with its exit adapters
    with pytest.raises(DecisionFileError, match="shipped decision file"):
        _llm(path, measure="agreement")


def test_the_cli_takes_the_measure_and_its_file(peaky, decision_file, capsys):
    from eecore.cli import main

    path, _ = peaky
    common = ["--model", path, "--dtype", "float32", "--device", "cpu", "--num-blocks", "64", "--block-size", "4",
              "--max-tokens", "4", "--chat", "off"]
    assert main(["generate", "one two one two", "--early-exit", "agreement", "--exit-decision", decision_file,
                 "--threshold", "0.5", "--batch-rule", "compact"] + common) == 0
    assert "mean layers/token" in capsys.readouterr().err
    # without a file the shipped one is read, which is not this model's: a message, not a traceback
    with pytest.raises(SystemExit, match="shipped decision file"):
        main(["generate", "one two", "--early-exit", "agreement"] + common)
