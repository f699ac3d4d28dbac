"""`eecore calibrate`: Learn-then-Test statistics, the full-depth record, the thresholds file, the CLI."""
import json
import math
import random

import pytest
import torch

import eecore
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model

from eecore.exits import calibration as ltt
from eecore.exits import thresholds_file
from eecore.exits.calibration_data import layer_thresholds, token_losses
from eecore.exits.calibrator import CalibrationSettings, calibrate, rouge_l_f1

NUM_LAYERS = 6
EXACT_FROM = 3       # the "exact" model's layers 3..5 do nothing: any exit at E >= 3 is consistent
MAX_TOKENS = 10


def _save(tmp, name, zero_from=None, head_scale=40.0, seed=0):
    path, hf = make_tiny_hf_model(tmp, num_layers=NUM_LAYERS, seed=seed, subdir=name)
    with torch.no_grad():
        hf.lm_head.weight.mul_(head_scale)
        for layer in hf.model.layers[zero_from or NUM_LAYERS:]:
            layer.self_attn.o_proj.weight.zero_()   # the layer adds nothing to the residual stream
            layer.mlp.down_proj.weight.zero_()
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calib")
    return {"exact": _save(tmp, "exact", zero_from=EXACT_FROM)[0],
            # every layer's softmax is saturated (gap ~ 1): confident everywhere, right nowhere early
            "overconfident": _save(tmp, "overconfident", head_scale=1000.0)[0],
            "other": _save(tmp, "other", zero_from=EXACT_FROM, seed=7)[0]}


def _llm(path, early_exit=None, **kw):
    return eecore.LLM(path, dtype="float32", device="cpu", num_blocks=256, block_size=4, early_exit=early_exit, **kw)


PROMPTS = random_prompts(320, [3 + i % 7 for i in range(40)], seed=1)


def _settings(**kw):
    base = dict(measure="softmax", tolerance=0.1, epsilon=0.1, max_tokens=MAX_TOKENS, ignore_eos=True)
    return CalibrationSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def exact_softmax(models):
    """A calibration on the exact model with every layer checked (a non-trivial threshold)."""
    result = calibrate(_llm(models["exact"]), PROMPTS, _settings())
    assert result.passed
    return result


# ---- p-values against scipy -------------------------------------------------------------------

def test_pvalues_match_scipy():
    from scipy.special import rel_entr
    from scipy.stats import binom

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 400)
        delta = rng.uniform(0.01, 0.6)
        count = rng.randint(0, n)
        assert ltt.binomial_cdf(count, n, delta) == pytest.approx(binom.cdf(count, n, delta), rel=1e-9, abs=1e-300)
        assert ltt.binomial_pvalue(count / n, n, delta) == pytest.approx(binom.cdf(count, n, delta), rel=1e-9,
                                                                         abs=1e-300)
        risk = rng.random() * rng.choice([1.0, 0.3, 0.05])
        a = min(risk, delta)
        hoeffding = math.exp(-n * (rel_entr(a, delta) + rel_entr(1 - a, 1 - delta)))
        bentkus = math.e * binom.cdf(math.ceil(n * risk), n, delta)
        assert ltt.hoeffding_bentkus_pvalue(risk, n, delta) == pytest.approx(min(hoeffding, bentkus, 1.0),
                                                                             rel=1e-9, abs=1e-300)


def test_pvalue_argument_errors():
    with pytest.raises(ValueError, match="'delta'"):
        ltt.hoeffding_bentkus_pvalue(0.1, 10, 1.5)
    with pytest.raises(ValueError, match="'n'"):
        ltt.binomial_pvalue(0.1, 0, 0.1)
    with pytest.raises(ValueError, match="method"):
        ltt.pvalue("bonferroni", 0.1, 10, 0.1)


# ---- the guarantee, on synthetic losses with known risk ----------------------------------------

def _synthetic_losses(rng, n, risks, tokens=8):
    """Per-prompt losses with known expected value risks[k] at candidate k: a prompt's tokens share
    its difficulty (dependent tokens), each token's latent is marginally uniform, and a token is
    inconsistent at k when its latent < risks[k]. The loss is monotone in k, like a threshold's."""
    losses = [[0.0] * n for _ in risks]
    for i in range(n):
        a = rng.random()
        latent = [(a + 0.3 * rng.random()) % 1.0 for _ in range(tokens)]  # uniform, correlated within
        for k, r in enumerate(risks):
            losses[k][i] = sum(v < r for v in latent) / tokens
    return losses


@pytest.mark.parametrize("method", ["hoeffding-bentkus", "binomial"])
def test_violation_rate_stays_below_epsilon(method):
    delta, epsilon, n, runs = 0.1, 0.1, 60, 300
    risks = [0.2 * k / 39 for k in range(40)]  # candidate 0: no risk; the risk crosses delta half way
    rng = random.Random(1)
    violations = naive_violations = exits = 0
    for _ in range(runs):
        losses = _synthetic_losses(rng, n, risks)
        if method == "binomial":
            u = [rng.random() for _ in range(n)]
            losses = [ltt.binarize(row, u) for row in losses]
        result = ltt.fixed_sequence_test(range(len(risks)), lambda k: sum(losses[k]) / n, n, delta, epsilon, method)
        if result.chosen is not None:
            violations += risks[result.chosen] > delta
            exits += result.chosen > 0
        naive = max(k for k in range(len(risks)) if sum(losses[k]) / n <= delta)  # no statistics
        naive_violations += risks[naive] > delta
    slack = 3 * math.sqrt(epsilon * (1 - epsilon) / runs)
    assert violations / runs <= epsilon + slack
    assert exits / runs > 0.5                       # the procedure does find thresholds
    assert naive_violations / runs > epsilon + slack  # and the check can see a procedure that fails


def test_fixed_sequence_stops_at_first_failure():
    calls = []

    def risk_of(k):
        calls.append(k)
        return [0.0, 0.0, 0.5, 0.0][k]

    result = ltt.fixed_sequence_test(range(4), risk_of, 100, 0.1, 0.1)
    assert result.chosen == 1 and calls == [0, 1, 2]
    assert [c.passed for c in result.candidates] == [True, True, False]


def test_rouge_l():
    assert rouge_l_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l_f1([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)
    assert rouge_l_f1([], [1]) == 0.0


# ---- calibration on tiny models ---------------------------------------------------------------

def test_exact_model_calibrates_to_exits(exact_softmax, models):
    d = exact_softmax.data
    assert d["threshold"] < 1.0
    chosen = next(c for c in reversed(d["candidates"]) if c["passed"])
    assert chosen["mean_exit_layer"] < NUM_LAYERS
    # with checks only where exits are always consistent, every candidate passes, down to 0
    result = calibrate(_llm(models["exact"]), PROMPTS, _settings(min_exit_layer=EXACT_FROM, measure="cosine"))
    assert result.passed and result.data["threshold"] == 0.0
    assert result.data["candidates"][-1]["mean_exit_layer"] == pytest.approx(
        (EXACT_FROM * MAX_TOKENS - EXACT_FROM + NUM_LAYERS) / MAX_TOKENS)  # the first token runs all layers


def test_reused_record_gives_the_same_calibration_and_is_checked(exact_softmax, models):
    llm = _llm(models["exact"])
    rec = exact_softmax.record
    for tolerance in (0.1, 0.2, 0.3):  # several tolerances and rules from one full-depth pass
        for rule in ("all", "compact"):
            again = calibrate(llm, PROMPTS, _settings(tolerance=tolerance, batch_rule=rule))
            reused = calibrate(llm, PROMPTS, _settings(tolerance=tolerance, batch_rule=rule), reuse=rec)
            assert reused.data == again.data
    for wrong in (dict(measure="cosine"), dict(max_tokens=MAX_TOKENS + 1), dict(ignore_eos=False),
                  dict(min_exit_layer=EXACT_FROM)):
        with pytest.raises(ValueError, match="reused record"):
            calibrate(llm, PROMPTS, _settings(**wrong), reuse=rec)
    with pytest.raises(ValueError, match="reused record"):
        calibrate(llm, PROMPTS[:-1], _settings(), reuse=rec)


def test_per_layer_family_and_text_consistency(models):
    prompts = random_prompts(320, [3 + i % 7 for i in range(60)], seed=1)
    per_layer = calibrate(_llm(models["exact"]), prompts, _settings(family="per-layer", tolerance=0.15))
    assert per_layer.passed and len(per_layer.data["threshold"]) == NUM_LAYERS
    assert min(per_layer.data["threshold"]) < 1.0
    text = calibrate(_llm(models["exact"]), PROMPTS, _settings(consistency="text", min_exit_layer=EXACT_FROM,
                                                               candidates=[1.0, 0.5, 0.0]))
    assert text.passed and text.data["threshold"] == 0.0


@pytest.mark.parametrize("consistency", ["token", "text"])
def test_overconfident_model_passes_nothing(models, consistency):
    result = calibrate(_llm(models["overconfident"]), PROMPTS, _settings(consistency=consistency))
    assert not result.passed
    assert "no threshold that exits passes" in result.summary()


def test_too_few_prompts_is_a_clear_error(models):
    with pytest.raises(ValueError, match="n >= 22 prompts"):
        calibrate(_llm(models["exact"]), PROMPTS[:10], _settings())


@pytest.mark.parametrize("decay", [None, 3.0])
def test_record_predicts_the_decoder(models, decay):
    """Where the exit state is the full-depth state (exact model, checks at >= EXACT_FROM), teacher
    forcing is exact, so the record's exits are the decoder's: same mean exit layer per threshold
    (and per CALM decay schedule)."""
    llm = _llm(models["exact"])
    settings = _settings(min_exit_layer=EXACT_FROM, measure="softmax")
    rec = calibrate(llm, PROMPTS, settings).record
    values = [0.999, 0.9, 0.6, 0.3]
    _, predicted = token_losses(rec, layer_thresholds(rec, values), decay, MAX_TOKENS)
    for value, mean in zip(values, predicted.tolist()):
        ee = eecore.EarlyExitConfig(measure="softmax", threshold=value, min_exit_layer=EXACT_FROM,
                                    batch_rule="compact", decay=decay)
        outs = _llm(models["exact"], ee).generate(PROMPTS, greedy(MAX_TOKENS))
        layers = [e for o in outs for e in o.exit_layers]
        assert sum(layers) / len(layers) == pytest.approx(mean)


# ---- the file --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibrated_file(exact_softmax, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("file") / "thresholds.json")
    thresholds_file.save(exact_softmax.data, path)
    return path


def test_loaded_file_generates_like_the_number(calibrated_file, exact_softmax, models):
    number = exact_softmax.data["threshold"]
    by_file = _llm(models["exact"], eecore.EarlyExitConfig(threshold=calibrated_file))
    by_number = _llm(models["exact"], eecore.EarlyExitConfig(measure="softmax", threshold=number))
    # batch 1, as calibrated: under the "all" rule a batch exits only when all its rows are confident
    from_file = [by_file.generate([p], greedy(MAX_TOKENS))[0] for p in PROMPTS[:12]]
    direct = [by_number.generate([p], greedy(MAX_TOKENS))[0] for p in PROMPTS[:12]]
    assert [(o.token_ids, o.exit_layers) for o in from_file] == [(o.token_ids, o.exit_layers) for o in direct]
    assert any(e < NUM_LAYERS for o in from_file for e in o.exit_layers[1:])
    config = eecore.EarlyExitConfig(threshold=calibrated_file)
    assert config.threshold == number and config.measure == "softmax" and config.threshold_file == calibrated_file
    # numbers and per-layer lists still work as before
    assert eecore.EarlyExitConfig(threshold=[0.5] * 3).threshold == [0.5] * 3


def test_file_for_another_model_is_refused(calibrated_file, models, tmp_path):
    with pytest.raises(ValueError, match="thresholds.json.*another model"):
        _llm(models["other"], eecore.EarlyExitConfig(threshold=calibrated_file))
    deeper, _ = make_tiny_hf_model(tmp_path, num_layers=NUM_LAYERS + 1, subdir="deeper")
    with pytest.raises(ValueError, match="num_layers=6.*num_layers=7"):
        _llm(deeper, eecore.EarlyExitConfig(threshold=calibrated_file))


def test_file_with_other_settings_is_refused(calibrated_file):
    with pytest.raises(ValueError, match="thresholds.json.*measure='softmax'.*measure='cosine'"):
        eecore.EarlyExitConfig(measure="cosine", threshold=calibrated_file)
    with pytest.raises(ValueError, match="min_exit_layer"):
        eecore.EarlyExitConfig(threshold=calibrated_file, min_exit_layer=2)
    with pytest.raises(ValueError, match="decay"):
        eecore.EarlyExitConfig(threshold=calibrated_file, decay=1.0)


def test_exit_adapter_identity_is_checked(models, tmp_path):
    from eecore.models.exit_adapter import AdapterBlock, ExitAdapters

    def adapters(seed):
        g = torch.Generator().manual_seed(seed)
        d, m = 64, 8
        return ExitAdapters({2: AdapterBlock(1 + 0.1 * torch.randn(d, generator=g),
                                             0.1 * torch.randn(2 * m, d, generator=g),
                                             0.1 * torch.randn(d, m, generator=g))})
    file_a, file_b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    adapters(0).save(file_a)
    adapters(1).save(file_b)
    result = calibrate(_llm(models["exact"], exit_adapter=file_a), PROMPTS, _settings(tolerance=0.3))
    assert result.data["exit_adapter"]["exit_layers"] == [2] and result.data["checked_layers"] == [2]
    path = str(tmp_path / "t.json")
    data = dict(result.data, threshold=0.5)  # a threshold file is only written when one passed
    thresholds_file.save(data, path)
    _llm(models["exact"], eecore.EarlyExitConfig(threshold=path), exit_adapter=file_a)  # fits
    with pytest.raises(ValueError, match="other exit adapters"):
        _llm(models["exact"], eecore.EarlyExitConfig(threshold=path), exit_adapter=file_b)
    with pytest.raises(ValueError, match="calibrated with exit adapters"):
        _llm(models["exact"], eecore.EarlyExitConfig(threshold=path))


def test_classifier_and_decay_calibration(models, tmp_path):
    from eecore.exits.classifier import ExitClassifier

    def classifier(seed):
        g = torch.Generator().manual_seed(seed)
        path = str(tmp_path / f"c{seed}.safetensors")
        ExitClassifier(64, {"shared": (torch.randn(8, 64, generator=g), torch.randn(8, generator=g),
                                       torch.randn(8, generator=g), torch.randn(1, generator=g))}).save(path)
        return path
    mine, other = classifier(0), classifier(1)
    result = calibrate(_llm(models["exact"]), PROMPTS, _settings(measure="classifier", classifier_path=mine,
                                                                 min_exit_layer=EXACT_FROM, decay=2.0))
    assert result.passed and result.data["decay"] == 2.0
    path = str(tmp_path / "t.json")
    thresholds_file.save(result.data, path)
    config = eecore.EarlyExitConfig(threshold=path, classifier_path=mine)
    assert config.measure == "classifier" and config.decay == 2.0 and config.min_exit_layer == EXACT_FROM
    with pytest.raises(ValueError, match="another exit classifier"):
        eecore.EarlyExitConfig(threshold=path, classifier_path=other)


@pytest.mark.parametrize("edit, match", [
    (lambda d: "not json {", "not valid JSON"),
    (lambda d: [1, 2], "expected a JSON object"),
    (lambda d: {**d, "format": "something-else"}, "'format'"),
    (lambda d: {k: v for k, v in d.items() if k != "model"}, r"missing \['model'\]"),
    (lambda d: {**d, "threshold": 1.5}, "'threshold' must be"),
    (lambda d: {**d, "threshold": [0.5, -0.1, 0.5, 0.5, 0.5, 0.5]}, "'threshold' must be"),
    (lambda d: {**d, "threshold": [0.5, 0.5]}, "needs 6 values"),
    (lambda d: {**d, "threshold": "high"}, "'threshold' must be"),
    (lambda d: {**d, "epsilon": 2.0}, "'epsilon' must be in"),
    (lambda d: {**d, "min_exit_layer": 0}, "'min_exit_layer'"),
    (lambda d: {**d, "measure": "entropy"}, "'measure' must be one of"),
    (lambda d: {**d, "model": 3}, "'model' must be a model fingerprint"),
])
def test_malformed_file_is_a_clear_error(calibrated_file, tmp_path, edit, match):
    with open(calibrated_file) as f:
        data = json.load(f)
    bad = tmp_path / "bad.json"
    content = edit(data)
    bad.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(thresholds_file.ThresholdsFileError, match=match):
        eecore.EarlyExitConfig(threshold=str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        eecore.EarlyExitConfig(threshold=str(tmp_path / "missing.json"))


# ---- the CLI ---------------------------------------------------------------------------------

def _prompt_file(tmp_path, prompts, jsonl=False):
    path = tmp_path / ("prompts.jsonl" if jsonl else "prompts.txt")
    lines = [json.dumps({"prompt": p, "reference": "x"}) if jsonl else p for p in prompts]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


WORDS = ["The quick brown fox", "Hello world", "def add(a, b):", "Numbers 1 2 3", "Early exit lets",
         "Speculative decoding drafts", "for i in range(10):", "Unicode café"]


def test_cli_calibrate_then_generate(models, tmp_path, capsys):
    from eecore.cli import main

    prompts = [f"{WORDS[i % 8]} {i}" for i in range(30)]
    pfile = _prompt_file(tmp_path, prompts, jsonl=True)
    out = str(tmp_path / "t.json")
    rc = main(["calibrate", "--model", models["exact"], "--dtype", "float32", "--device", "cpu", "--num-blocks",
               "256", "--block-size", "4", "--measure", "cosine", "--min-exit-layer", str(EXACT_FROM),
               "--tolerance", "0.1", "--epsilon", "0.1", "--prompts", pfile, "--out", out, "--max-tokens", "6",
               "--ignore-eos", "--chat", "off"])
    assert rc == 0, capsys.readouterr().err
    data = thresholds_file.load(out)
    assert data["threshold"] == 0.0 and data["prompts"]["count"] == 30
    assert data["prompts"]["sha256"] == thresholds_file.file_sha256(pfile)
    rc = main(["generate", "hello", "--model", models["exact"], "--dtype", "float32", "--device", "cpu",
               "--num-blocks", "64", "--block-size", "4", "--threshold", out, "--max-tokens", "4", "--chat", "off"])
    assert rc == 0
    with pytest.raises(SystemExit, match="measure='cosine'"):
        main(["generate", "hello", "--model", models["exact"], "--early-exit", "softmax", "--threshold", out])


def test_cli_reports_no_threshold_and_fails(models, tmp_path, capsys):
    from eecore.cli import main

    pfile = _prompt_file(tmp_path, [f"{WORDS[i % 8]} {i}" for i in range(30)])
    out = tmp_path / "t.json"
    common = ["--model", models["overconfident"], "--dtype", "float32", "--device", "cpu", "--num-blocks", "256",
              "--block-size", "4", "--measure", "softmax", "--prompts", pfile, "--out", str(out),
              "--max-tokens", "8", "--ignore-eos", "--chat", "off"]
    assert main(["calibrate", "--tolerance", "0.1", "--epsilon", "0.1"] + common) == 1
    assert "no threshold that exits passes" in capsys.readouterr().err and not out.exists()
    assert main(["calibrate", "--tolerance", "0.01", "--epsilon", "0.01"] + common) == 2
    assert "n >= 459 prompts" in capsys.readouterr().err


def test_cli_reads_eval_prompt_files_and_rejects_bad_ones(models, tmp_path, capsys):
    """calibrate reads the same prompt files as `eecore eval` (eecore.evaluation.prompt_sets), and a bad one
    is a clear error with exit code 2 before anything runs."""
    from eecore.cli import main

    common = ["--model", models["exact"], "--dtype", "float32", "--device", "cpu", "--num-blocks", "256",
              "--block-size", "4", "--measure", "cosine", "--tolerance", "0.1", "--epsilon", "0.1",
              "--out", str(tmp_path / "t.json"), "--max-tokens", "4", "--chat", "off"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a", "reference": "b"}\n{"prompt": 3}\n')
    assert main(["calibrate", "--prompts", str(jl)] + common) == 2
    assert 'line 2 must have a non-empty string "prompt"' in capsys.readouterr().err
    jl.write_text('{"prompt": "a"\n')
    assert main(["calibrate", "--prompts", str(jl)] + common) == 2
    assert "line 1 is not valid JSON" in capsys.readouterr().err
    assert main(["calibrate", "--prompts", str(tmp_path / "missing.txt")] + common) == 2
    assert "does not exist" in capsys.readouterr().err
