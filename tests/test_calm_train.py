"""eecore.train.calm: CALM's weighted per-layer loss and independent classifier on a tiny T5 and a
synthetic seq2seq task (reversal), exact resume, the saved model and classifier in eecore."""
import copy
import json
import random

import pytest
import torch

import eecore
from eecore.train.calm import CALMConfig, CALMTrainer, Seq2SeqData, calm_layer_weights, collate, main, save_t5, train
from engine_utils import greedy
from t5_ee_reference import T5ReferenceEarlyExit
from t5_factory import hf_t5_greedy, make_tiny_t5

LAYERS = 4


def _pairs(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        src = [rng.randrange(3, 30) for _ in range(rng.randrange(2, 6))]
        out.append((src + [1], src[::-1] + [1]))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_t5(tmp_path_factory.mktemp("calm"), "v1.1", num_decoder_layers=LAYERS)


@pytest.fixture(scope="module")
def trained(tiny):
    """(model before, trainer after 120 steps, classifier trainer after 150 more steps on the tuned
    model, held-out batch)."""
    _, hf = tiny
    before = copy.deepcopy(hf)
    model = copy.deepcopy(hf)
    trainer = train(model, Seq2SeqData(_pairs(3000, 0), batch_size=16), CALMConfig(steps=120, lr=3e-3))
    # fresh pairs for the classifier: it overfits a few hundred (few tokens disagree deep down)
    classifier = train(model, Seq2SeqData(_pairs(5000, 7), batch_size=32),
                       CALMConfig(steps=150, classifier_lr=1e-2, train_model=False, seed=1))
    return before, trainer, classifier, collate(_pairs(128, 1), 0)


def test_layer_weights_are_proportional_to_depth():
    assert calm_layer_weights(4) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert sum(calm_layer_weights(12)) == pytest.approx(1.0)


def test_training_lowers_every_layer_loss_and_raises_shallow_agreement(trained):
    before_model, trainer, _, heldout = trained
    before = CALMTrainer(before_model, trainer.config).evaluate(heldout)
    after = trainer.evaluate(heldout)
    for i in range(1, LAYERS + 1):
        assert after[f"loss_{i}"] < before[f"loss_{i}"] - 0.3, (i, before, after)
    for E in (1, 2):
        assert after[f"agree_{E}"] > before[f"agree_{E}"] + 0.1, (E, before, after)
    # the logged records carry every layer's loss and each exit's agreement and classifier loss
    assert {f"loss_{i}" for i in range(1, LAYERS + 1)} | {"agree_1", "cls_loss_3"} <= set(trainer.history[-1])
    assert len(trainer.history) == 120


def test_classifier_learns_the_consistency_oracle(trained):
    """CALM's second stage (the classifier alone, on the tuned model): on held-out tokens each
    exit's classifier separates agreeing from disagreeing tokens better than chance (AUC > 0.58;
    chance spreads about 0.04 around 0.5 at these counts), and its training loss fell."""
    _, _, trainer, heldout = trained
    with torch.no_grad():
        trainer.model.eval()
        valid = heldout["labels"] != -100
        normed = [n[valid] for n in trainer._normed_states(heldout)]
        head = trainer.model.get_output_embeddings()
        final = head(normed[-1]).argmax(-1)
        for E in range(1, LAYERS):
            oracle = head(normed[E - 1]).argmax(-1) == final
            w1, b1, w2, b2 = trainer.heads[E]
            score = torch.relu(normed[E - 1] @ w1.T + b1) @ w2 + b2
            pos, neg = score[oracle], score[~oracle]
            assert len(pos) and len(neg)
            auc = (pos[:, None] > neg[None, :]).float().mean().item()
            assert auc > 0.58, (E, auc)
    for E in range(1, LAYERS):
        assert trainer.history[-1][f"cls_loss_{E}"] < trainer.history[0][f"cls_loss_{E}"]


def test_resume_is_exact(tiny, tmp_path):
    _, hf = tiny
    data = Seq2SeqData(_pairs(100, 2), batch_size=4, seed=3)
    config = CALMConfig(steps=6, lr=1e-3)
    straight = train(copy.deepcopy(hf), data, config)
    ckpt = str(tmp_path / "ckpt")
    first = train(copy.deepcopy(hf), data, config, checkpoint_dir=ckpt, checkpoint_every=1, stop_after=3)
    assert first.step == 3
    resumed = train(copy.deepcopy(hf), data, config, checkpoint_dir=ckpt, checkpoint_every=1)
    assert resumed.step == 6 and resumed.history == straight.history
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    for E in straight.heads:
        assert all(torch.equal(a, b) for a, b in zip(straight.heads[E], resumed.heads[E]))
    with pytest.raises(ValueError, match="another CALMConfig"):
        train(copy.deepcopy(hf), data, CALMConfig(steps=6, lr=2e-3), checkpoint_dir=ckpt)


def test_classifier_only_keeps_the_model(tiny):
    _, hf = tiny
    model = copy.deepcopy(hf)
    trainer = train(model, Seq2SeqData(_pairs(50, 4), batch_size=4), CALMConfig(steps=3, train_model=False))
    for (name, a), b in zip(hf.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(trainer.heads[1][0], CALMTrainer(copy.deepcopy(hf), trainer.config).heads[1][0])


def test_saved_model_and_classifier_run_in_eecore(trained, tiny, tmp_path):
    """The tuned model through eecore decodes as HF does, and the trained classifier drives early
    exits exactly as Algorithm 1 does with it."""
    _, _, trainer, _ = trained
    path, _ = tiny
    out = str(tmp_path / "tuned")
    trainer.model.eval()
    save_t5(trainer.model, out, path)
    file = str(tmp_path / "exit_classifier.safetensors")
    trainer.classifier().save(file)
    prompts = [p for p, _ in _pairs(3, 5)]
    full = eecore.LLM(out, dtype="float32", device="cpu").generate(prompts, greedy(8))
    assert [o.token_ids for o in full] == [hf_t5_greedy(trainer.model, p, 8) for p in prompts]
    llm = eecore.LLM(out, dtype="float32", device="cpu", early_exit=eecore.EarlyExitConfig(
        measure="classifier", classifier_path=file, threshold=0.5, batch_rule="compact"))
    outs = llm.generate(prompts, greedy(8))
    weights = {E: tuple(p.detach() for p in h) for E, h in trainer.heads.items()}
    for p, o in zip(prompts, outs):
        ref = T5ReferenceEarlyExit(trainer.model, [p], "classifier", 0.5, classifier=weights, rule="compact")
        tokens, exits = ref.generate(8)
        assert (o.token_ids, o.exit_layers) == (tokens[0], exits[0])
    assert any(e < LAYERS for o in outs for e in o.exit_layers), "the trained classifier lets tokens exit"


def test_command_line(tiny, tmp_path, capsys):
    path, _ = tiny
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"input": f"summarize: the quick brown fox {i}", "target": "the fox"})
                              for i in range(5)))
    out = tmp_path / "out"
    assert main(["--model", path, "--data", str(data), "--out", str(out), "--steps", "2", "--batch-size", "2",
                 "--log-every", "1"]) == 0
    log = capsys.readouterr().out
    assert "step 1 loss" in log and "layer losses 1:" in log and f"{LAYERS}:" in log
    llm = eecore.LLM(str(out), dtype="float32", device="cpu", early_exit=eecore.EarlyExitConfig(
        measure="classifier", classifier_path=str(out / "exit_classifier.safetensors")))
    assert len(llm.generate("summarize: the fox", greedy(3))[0].token_ids) == 3
    data.write_text('{"input": "x"}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl:1: expected a JSON object with 'input' and 'target'"):
        main(["--model", path, "--data", str(data), "--out", str(out), "--steps", "1"])


def test_bad_arguments_are_clear_errors(tmp_path):
    from model_factory import make_tiny_hf_model

    with pytest.raises(ValueError, match="'steps'"):
        CALMConfig(steps=0)
    with pytest.raises(ValueError, match="'classifier_lr'"):
        CALMConfig(classifier_lr=0.0)
    with pytest.raises(ValueError, match="'pairs' is empty"):
        Seq2SeqData([], batch_size=2)
    _, llama = make_tiny_hf_model(tmp_path)
    with pytest.raises(TypeError, match="'model' must be an HF T5ForConditionalGeneration"):
        CALMTrainer(llama, CALMConfig())
