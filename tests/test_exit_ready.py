"""The exit-ready recipe with LoRA (eecore.train.exit_ready) on a tiny random Llama, the LoRA pairs
in the adapter file (format 2, eecore.models.lora), and what LLM(exit_adapter=...) makes of them:
the merged model against HF transformers with the pairs merged by hand."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import eecore
from eecore.models.exit_adapter import FORMAT, FORMAT_INT8, FORMAT_LORA, ExitAdapters, model_fingerprint
from eecore.models.lora import LLAMA_TARGETS, LoraDeltas
from eecore.train.exit_adapter import frequent_tokens
from eecore.train.exit_ready import ExitReadyConfig, ExitReadyTrainer, hf_twin, train
from eecore.train.loop import batch_windows
from engine_utils import greedy, random_prompts
from model_factory import load_for_windows, make_peaked_tiny_model

L, VOCAB, D = 4, 320, 64
B, S = 2, 16
CONFIG = ExitReadyConfig(exit_layers=(1, 2), adapter_hidden=16, lora_rank=4, lora_alpha=8.0, draft_vocab=48,
                         seq_len=S, batch_size=B, steps=6, lr=5e-3, adapter_lr=1e-2, warmup=1, e_scale=1.0, seed=0)


def _load(path, **kw):
    return load_for_windows(path, B, S, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, hf_model): a 4-layer random Llama with peaked distributions."""
    return make_peaked_tiny_model(tmp_path_factory.mktemp("er"), num_layers=L, vocab_size=VOCAB, hidden_size=D)


@pytest.fixture(scope="module")
def llm(tiny):
    return _load(tiny[0])


@pytest.fixture(scope="module")
def tokens(llm):
    """A token stream the tiny model itself generated, so that exits have something to learn."""
    outs = llm.generate(random_prompts(VOCAB, [3] * 8, seed=3), greedy(40))
    return np.concatenate([np.asarray(o.prompt_token_ids + o.token_ids, dtype=np.int32) for o in outs])


@pytest.fixture(scope="module")
def vocab(tokens):
    return frequent_tokens(tokens, VOCAB, CONFIG.draft_vocab, (2,))


def _random_lora(rank: int = 3, seed: int = 0, layers=range(L)) -> LoraDeltas:
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
              "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
              "mlp.down_proj": (64, 96)}
    pairs = {}
    for i in layers:
        for target in LLAMA_TARGETS:
            out, inp = shapes[target]
            pairs[f"model.layers.{i}.{target}"] = (0.3 * torch.randn(rank, inp, generator=g),
                                                   0.3 * torch.randn(out, rank, generator=g))
    return LoraDeltas(pairs, scale=0.5)


# ---- the file and the merge ----------------------------------------------------------------------


def test_lora_file_round_trip_and_format(llm, vocab, tmp_path):
    from safetensors import safe_open

    lora = _random_lora()
    path = str(tmp_path / "er.safetensors")
    ExitAdapters({}, vocab, model_fingerprint(llm.model), {"note": 1}, lora).save(path)
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["format"] == FORMAT_LORA
    back = ExitAdapters.load(path)
    assert back.lora.scale == 0.5 and set(back.lora.pairs) == set(lora.pairs) and back.lora.rank == 3
    for k, (a, b) in lora.pairs.items():
        assert torch.equal(back.lora.pairs[k][0], a) and torch.equal(back.lora.pairs[k][1], b)
    plain = str(tmp_path / "plain.safetensors")
    ExitAdapters({}, vocab, model_fingerprint(llm.model)).save(plain)
    with safe_open(plain, framework="pt") as f:
        assert f.metadata()["format"] == FORMAT  # no pairs: still format 1, readable by older eecore


def test_lora_file_errors(llm, tmp_path):
    from safetensors.torch import save_file

    a, b = torch.zeros(2, 64), torch.zeros(64, 2)
    cases = {
        "lora tensors in format 1": ({"lora.model.layers.0.mlp.up_proj.a": a}, {"format": FORMAT}, "cannot hold"),
        "no pairs": ({"draft_vocab": torch.arange(4, dtype=torch.int32)}, {"format": FORMAT_LORA, "lora_scale": "1.0"},
                     "no lora"),
        "lacks B": ({"lora.model.layers.0.mlp.up_proj.a": a}, {"format": FORMAT_LORA, "lora_scale": "1.0"},
                    "lacks its B"),
        "bad name": ({"lora.x.c": a}, {"format": FORMAT_LORA, "lora_scale": "1.0"}, "not named"),
        "rank mismatch": ({"lora.p.a": a, "lora.p.b": torch.zeros(64, 3)}, {"format": FORMAT_LORA, "lora_scale": "1"},
                          "inconsistent shapes"),
        "no scale": ({"lora.p.a": a, "lora.p.b": b}, {"format": FORMAT_LORA}, "scale"),
        "zero scale": ({"lora.p.a": a, "lora.p.b": b}, {"format": FORMAT_LORA, "lora_scale": "0.0"}, "scale"),
        "infinite scale": ({"lora.p.a": a, "lora.p.b": b}, {"format": FORMAT_LORA, "lora_scale": "inf"}, "scale"),
    }
    for name, (tensors, meta, match) in cases.items():
        path = str(tmp_path / f"{name}.safetensors")
        save_file(tensors, path, metadata=meta)
        with pytest.raises(ValueError, match=match):
            ExitAdapters.load(path)


def test_lora_for_a_missing_or_misshapen_weight_is_refused(tiny, llm, tmp_path):
    path, _ = tiny
    for pairs, match in [({"model.layers.9.mlp.up_proj": (torch.zeros(2, 64), torch.zeros(96, 2))}, "does not have"),
                         ({"model.layers.0.mlp.up_proj": (torch.zeros(2, 64), torch.zeros(90, 2))}, "shape")]:
        file = str(tmp_path / "bad.safetensors")
        ExitAdapters({}, None, model_fingerprint(llm.model), {}, LoraDeltas(pairs, 1.0)).save(file)
        with pytest.raises(ValueError, match=match):
            eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=file)


def test_merged_model_equals_hf_with_the_pairs_merged_by_hand(tiny, llm, tmp_path):
    """Full depth of LLM(exit_adapter=file with LoRA) is the base with W + scale·B·A: logits and
    greedy tokens against HF transformers running those weights."""
    import copy

    path, hf = tiny
    lora = _random_lora(seed=4)
    file = str(tmp_path / "merged.safetensors")
    ExitAdapters({}, None, model_fingerprint(llm.model), {}, lora).save(file)
    merged = copy.deepcopy(hf)
    with torch.no_grad():
        modules = dict(merged.named_modules())
        for name, (a, b) in lora.pairs.items():
            modules[name].weight += lora.scale * (b @ a)
    ids = random_prompts(VOCAB, [9], seed=2)[0]
    with torch.no_grad():
        want = merged(torch.tensor([ids])).logits[0, -1]
        base = hf(torch.tensor([ids])).logits[0, -1]
    ee = eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=file)
    got = ee.generate([ids], eecore.SamplingParams(max_tokens=1, logprobs=VOCAB))[0].logprobs[0]
    got_lp = torch.tensor([got[t] for t in range(VOCAB)])
    torch.testing.assert_close(got_lp, torch.log_softmax(want, -1), atol=2e-4, rtol=0)
    assert (want - base).abs().max() > 1e-2  # the pairs changed the model
    tokens = merged.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert ee.generate([ids], greedy(8))[0].token_ids == tokens


# ---- training ------------------------------------------------------------------------------------


def test_hf_twin_has_eecore_weights(tiny, llm):
    _, hf = tiny
    twin = hf_twin(llm.model)
    ids = torch.tensor([random_prompts(VOCAB, [12], seed=5)[0]])
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(exit_layers=()), "exit_layers"), (dict(lora_rank=0), "lora_rank"), (dict(lr=0.0), "lr"),
    (dict(p_max=1.5), "p_max"), (dict(exit_curriculum="sometimes"), "exit_curriculum"),
    (dict(draft_vocab=-1), "draft_vocab")])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CONFIG, **kwargs)


def test_training_lowers_every_exit_loss_and_keeps_full_depth(llm, tokens, vocab):
    """Step 0 starts from the original model (B = 0: the final KL is 0), and a few steps lower every
    exit's loss on a fixed batch while the last layer stays close to the original."""
    trainer = ExitReadyTrainer(llm, dataclasses.replace(CONFIG, steps=12), vocab)
    batch = batch_windows(tokens, 0, B, S, 0)
    before = trainer.evaluate(batch)
    assert before["final"]["loss"] == pytest.approx(0.0, abs=1e-6) and before["final"]["agreement"] == 1.0
    for _ in range(12):
        trainer.train_step(batch)
    after = trainer.evaluate(batch)
    for E in ("1", "2"):
        assert after[E]["loss"] < 0.8 * before[E]["loss"], (E, before, after)
    # the distillation term holds the last layer near the original while the exits move
    assert after["final"]["loss"] < 0.25 * min(after[E]["loss"] for E in ("1", "2"))
    assert after["final"]["agreement"] >= 0.9


def test_layer_dropout_and_curriculum_take_effect(llm, vocab, tokens):
    trainer = ExitReadyTrainer(llm, dataclasses.replace(CONFIG, p_max=1.0, exit_curriculum="rotational", rotation=2),
                               vocab)
    assert trainer.enabled_exits(0) == [1] and trainer.enabled_exits(1) == [2]  # one exit of two per step
    record = trainer.train_step(batch_windows(tokens, 0, B, S, 0))
    assert "loss_1" in record and "loss_2" not in record
    assert record["loss_final"] > 0  # every layer dropped for every sample: the last layer is off course


def test_interrupted_run_resumes_to_the_same_weights_and_exports(tiny, llm, tokens, vocab, tmp_path):
    whole = train(llm, tokens, CONFIG, vocab=vocab)
    ckpt = str(tmp_path / "ckpt")
    part = train(llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=ckpt, checkpoint_every=2, stop_after=3)
    assert part.step == 3
    resumed = train(llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=ckpt, checkpoint_every=2)
    assert resumed.step == CONFIG.steps and len(resumed.history) == CONFIG.steps
    for name, p in whole.lora_params.items():
        assert torch.equal(p, resumed.lora_params[name]), name
    for E in whole.blocks:
        for x, y in zip(whole.blocks[E].tensors(), resumed.blocks[E].tensors()):
            assert torch.equal(x, y)
    # the export: one file that LLM merges, and self-speculation on it equals its own full depth
    file = str(tmp_path / "exit-ready.safetensors")
    adapters = whole.exit_adapters({"steps": CONFIG.steps})
    assert len(adapters.lora.pairs) == L * len(LLAMA_TARGETS) and adapters.lora.scale == 2.0
    adapters.save(file)
    path, _ = tiny
    kw = dict(dtype="float32", device="cpu", exit_adapter=file)
    prompts = random_prompts(VOCAB, [5, 2], seed=9)
    full = eecore.LLM(path, **kw).generate(prompts, greedy(8))
    spec = eecore.LLM(path, speculative=eecore.SelfSpeculativeConfig(exit_layer=2, num_speculations=2), **kw)
    assert [o.token_ids for o in spec.generate(prompts, greedy(8))] == [o.token_ids for o in full]
    # the merged weights are the trained ones: eecore full depth equals the peft student's
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        want = torch.log_softmax(whole.student(ids).logits[0, -1], -1)
    got = eecore.LLM(path, **kw).generate([prompts[0]], eecore.SamplingParams(max_tokens=1, logprobs=VOCAB))
    torch.testing.assert_close(torch.tensor([got[0].logprobs[0][t] for t in range(VOCAB)]), want, atol=2e-4, rtol=0)


def test_checkpoint_of_another_configuration_is_refused(llm, tokens, vocab, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=ckpt, checkpoint_every=1, stop_after=1)
    with pytest.raises(ValueError, match="another configuration"):
        train(llm, tokens, dataclasses.replace(CONFIG, lora_rank=2), vocab=vocab, checkpoint_dir=ckpt)


def _toy_corpus(folder, code: str) -> str:
    """A corpus folder (eecore.sources.corpus layout): `code` twenty times to train on, prose held out."""
    from eecore.sources.corpus import Corpus, CorpusFile, write_corpus

    write_corpus(Corpus(train=[CorpusFile("fake", "a.py", code * 20, "0")],
                        heldout=[CorpusFile("held", "b.py", "Hello world! " * 30, "1")], versions={"fake": "1"}),
                 str(folder))
    return str(folder)


def test_training_cli_end_to_end(tiny, tmp_path, capsys):
    """python -m eecore.train.exit_ready on a corpus folder, then the file in LLM(exit_adapter=)."""
    import json

    from eecore.train.exit_ready import main

    path, _ = tiny
    _toy_corpus(tmp_path / "corpus", "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * 2)\n")
    out, ckpt = str(tmp_path / "er.safetensors"), str(tmp_path / "ckpt")
    args = ["--corpus", str(tmp_path / "corpus"), "--out", out, "--checkpoint-dir", ckpt, "--model", path,
            "--exit-layers", "1", "3", "--adapter-hidden", "8", "--lora-rank", "2", "--draft-vocab", "40",
            "--seq-len", str(S), "--batch-size", str(B), "--steps", "3", "--warmup", "1", "--device", "cpu",
            "--checkpoint-every", "2", "--eval-every", "2"]
    # a time-boxed run: out of time after its first step, it still exports what it reached
    assert main(args + ["--stop-after-minutes", "0", "--export-on-stop"]) == 3
    partial = ExitAdapters.load(out)
    assert partial.info["trained_steps"] == 1 and partial.info["trained_tokens"] == B * S
    assert main(args) == 0  # resumes to the end
    adapters = ExitAdapters.load(out)
    assert adapters.info["trained_steps"] == 3
    assert adapters.exit_layers() == [1, 3] and adapters.lora.rank == 2 and len(adapters.vocab) == 40
    assert adapters.info["trained_tokens"] == 3 * B * S and set(adapters.info["final_heldout"]) == {"final", "1", "3"}
    assert set(json.loads(capsys.readouterr().out.strip().splitlines()[-1])) == {"final", "1", "3"}
    assert [json.loads(line)["step"] for line in open(f"{ckpt}/train_log.jsonl")] == [0, 1, 2]
    kw = dict(dtype="float32", device="cpu", exit_adapter=out)
    prompts = random_prompts(VOCAB, [5, 2], seed=9)
    spec = eecore.LLM(path, speculative=eecore.SelfSpeculativeConfig(exit_layer=3, num_speculations=2), **kw)
    assert [o.token_ids for o in spec.generate(prompts, greedy(8))] == \
        [o.token_ids for o in eecore.LLM(path, **kw).generate(prompts, greedy(8))]


def test_eval_only_reports_what_the_trainer_measured_for_the_file(tiny, tmp_path, capsys):
    """--eval-only on a float32 file gives the held-out figures its training run recorded; it needs
    --init-adapters, and training needs --out and --checkpoint-dir. --save-dtype int8 writes format 3."""
    import json

    from safetensors import safe_open

    from eecore.train.exit_ready import main

    path, _ = tiny
    _toy_corpus(tmp_path / "corpus", "def add(a, b):\n    return a + b\n")
    out = str(tmp_path / "er.safetensors")
    common = ["--corpus", str(tmp_path / "corpus"), "--model", path, "--exit-layers", "2", "--draft-only",
              "--adapter-hidden", "8", "--lora-rank", "2", "--draft-vocab", "40", "--seq-len", str(S),
              "--batch-size", str(B), "--warmup", "0", "--device", "cpu"]
    assert main(common + ["--out", out, "--checkpoint-dir", str(tmp_path / "ck"), "--steps", "2",
                          "--save-dtype", "float32"]) == 0
    capsys.readouterr()
    assert main(common + ["--init-adapters", out, "--eval-only"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == ExitAdapters.load(out).info["final_heldout"]
    int8 = str(tmp_path / "er8.safetensors")  # --save-dtype int8 writes format 3
    assert main(common + ["--out", int8, "--checkpoint-dir", str(tmp_path / "ck8"), "--steps", "1",
                          "--save-dtype", "int8"]) == 0
    with safe_open(int8, framework="pt") as f:
        assert f.metadata()["format"] == FORMAT_INT8
    assert ExitAdapters.load(int8).info["trained_steps"] == 1
    with pytest.raises(SystemExit):
        main(common + ["--eval-only"])
    assert "--eval-only evaluates the file given by --init-adapters" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(common + ["--checkpoint-dir", str(tmp_path / "ck2")])
    assert "training needs --out and --checkpoint-dir" in capsys.readouterr().err


def test_training_cli_continued_from_a_file_keeps_or_recounts_its_draft_vocabulary(tiny, tmp_path):
    """A run started from a file (--init-adapters) trains for the draft vocabulary that file ships,
    even on a corpus whose counts would pick other tokens; a --draft-vocab of another size is refused,
    unless --recount-draft-vocab asks for the vocabulary to be counted on the new corpus."""
    from eecore.train.exit_ready import main

    path, _ = tiny

    def corpus(folder, text):
        return _toy_corpus(tmp_path / folder, text)

    common = ["--model", path, "--exit-layers", "2", "--draft-only", "--adapter-hidden", "8", "--lora-rank", "2",
              "--seq-len", str(S), "--batch-size", str(B), "--steps", "1", "--warmup", "0", "--device", "cpu"]
    first = str(tmp_path / "first.safetensors")
    assert main(["--corpus", corpus("a", "def add(a, b):\n    return a + b\n"), "--out", first,
                 "--checkpoint-dir", str(tmp_path / "ck1"), "--draft-vocab", "40"] + common) == 0
    other = corpus("b", "Zebras quietly eat yellow quinces; 0123456789 !?@#$%^&*\n")
    second = str(tmp_path / "second.safetensors")
    assert main(["--corpus", other, "--out", second, "--checkpoint-dir", str(tmp_path / "ck2"),
                 "--init-adapters", first, "--draft-vocab", "40"] + common) == 0
    assert torch.equal(ExitAdapters.load(second).vocab, ExitAdapters.load(first).vocab)
    with pytest.raises(ValueError, match="--draft-vocab 30: .* has a draft vocabulary of 40 tokens"):
        main(["--corpus", other, "--out", second, "--checkpoint-dir", str(tmp_path / "ck3"),
              "--init-adapters", first, "--draft-vocab", "30"] + common)
    # --recount-draft-vocab counts it afresh on this corpus, at the size asked for, as a fresh run would
    recounted, fresh = str(tmp_path / "recounted.safetensors"), str(tmp_path / "fresh.safetensors")
    assert main(["--corpus", other, "--out", recounted, "--checkpoint-dir", str(tmp_path / "ck4"),
                 "--init-adapters", first, "--draft-vocab", "30", "--recount-draft-vocab"] + common) == 0
    assert main(["--corpus", other, "--out", fresh, "--checkpoint-dir", str(tmp_path / "ck5"),
                 "--draft-vocab", "30"] + common) == 0
    vocab = ExitAdapters.load(recounted).vocab
    assert vocab.numel() == 30 and torch.equal(vocab, ExitAdapters.load(fresh).vocab)
    assert not torch.equal(vocab[:30], ExitAdapters.load(first).vocab[:30])


def test_student_without_its_pairs_is_the_engine_teacher(llm, tokens, vocab):
    """Off the CPU the teacher is the student with its LoRA pairs switched off: after training
    moved the pairs, that pass still gives the original model's logits (eecore's engine's)."""
    trainer = ExitReadyTrainer(llm, CONFIG, vocab)
    batch = batch_windows(tokens, 0, B, S, 0)
    for _ in range(3):
        trainer.train_step(batch)
    engine = trainer.teacher_logits(batch)
    trainer.engine_teacher = None
    torch.testing.assert_close(trainer.teacher_logits(batch), engine, atol=2e-4, rtol=0)
    with torch.no_grad():
        assert (trainer.student(batch).logits.reshape(engine.shape) - engine).abs().max() > 1e-3  # the pairs moved


def test_second_stage_starts_from_a_file_and_keeps_frozen_layers_and_exits(llm, tokens, vocab):
    """A second stage (e_scale 0, frozen_layers F) starts from the first stage's pairs and adapters,
    trains only the pairs of layers >= F toward the original's last layer, and so leaves every exit
    at E <= F exactly as it was."""
    first = train(llm, tokens, CONFIG, vocab=vocab)
    start = first.exit_adapters({})
    config = dataclasses.replace(CONFIG, e_scale=0.0, frozen_layers=2, steps=4)
    second = ExitReadyTrainer(llm, config, vocab, init_adapters=start)
    for name, p in second.lora_params.items():  # it starts where the first stage ended
        assert torch.equal(p, first.lora_params[name]), name
    batch = batch_windows(tokens, 0, B, S, 0)
    before = second.evaluate(batch)
    for _ in range(config.steps):
        second.train_step(batch)
    after = second.evaluate(batch)
    assert after["final"]["loss"] < before["final"]["loss"]
    for E in ("1", "2"):  # the exits read layers below F only, and their adapters did not train
        assert after[E] == before[E]
    moved = {int(name.split("layers.")[1].split(".")[0])
             for name, p in second.lora_params.items() if not torch.equal(p, first.lora_params[name])}
    assert moved == {2, 3}
    assert second.exit_adapters({}).lora.pairs.keys() == start.lora.pairs.keys()


def test_second_stage_refuses_pairs_of_another_shape(llm, vocab):
    start = ExitAdapters({}, vocab, model_fingerprint(llm.model), {}, _random_lora(rank=CONFIG.lora_rank + 1))
    with pytest.raises(ValueError, match=f"rank {CONFIG.lora_rank + 1}, above this run's rank {CONFIG.lora_rank}"):
        ExitReadyTrainer(llm, CONFIG, vocab, init_adapters=start)
    with pytest.raises(ValueError, match="frozen_layers"):
        ExitReadyConfig(frozen_layers=-1)
    with pytest.raises(ValueError, match="leaves none"):
        ExitReadyTrainer(llm, dataclasses.replace(CONFIG, frozen_layers=L), vocab)


def test_trainer_refuses_bad_models(tiny, llm, vocab):
    with pytest.raises(ValueError, match=f"ExitReadyTrainer: exit layer {L} must be below the model's {L} layers"):
        ExitReadyTrainer(llm, dataclasses.replace(CONFIG, exit_layers=(1, L)), vocab)
    with pytest.raises(ValueError, match="ExitReadyTrainer: load the model in float32 for training, got torch.bf"):
        ExitReadyTrainer(eecore.LLM(tiny[0], dtype="bfloat16", device="cpu"), CONFIG, vocab)


def test_a_second_stage_may_grow_the_rank(llm, tokens, vocab):
    """Pairs of rank 3 start a rank-4 run (another alpha too): every delta is the file's at the start,
    the extra rank has a random A and a zero B, and after a step the extra ranks have moved."""
    start = ExitAdapters({}, vocab, model_fingerprint(llm.model), {}, _random_lora(rank=3))
    config = dataclasses.replace(CONFIG, lora_rank=4, lora_alpha=6.0)
    trainer = ExitReadyTrainer(llm, config, vocab, init_adapters=start)
    grown = trainer.lora_deltas()
    assert grown.rank == 4 and grown.scale == 1.5 and grown.pairs.keys() == start.lora.pairs.keys()
    for path, (a, b) in grown.pairs.items():
        torch.testing.assert_close(grown.delta(path), start.lora.delta(path), rtol=1e-5, atol=1e-6)
        assert torch.count_nonzero(a[3]) > 0 and torch.count_nonzero(b[:, 3]) == 0
    trainer.train_step(batch_windows(tokens, 0, B, S, 0))
    assert any(torch.count_nonzero(b[:, 3]) > 0 for _, b in trainer.lora_deltas().pairs.values())


def test_draft_only_trains_the_copy_and_its_exits(tiny, llm, tokens, vocab, tmp_path):
    """draft_only: the student is layers 0..max(E)-1 with pairs; every exit's loss falls; the file's
    pairs cover only those layers, and as separate draft layers they leave full depth alone while
    the drafts read the trained copy."""
    config = dataclasses.replace(CONFIG, draft_only=True, exit_layers=(2,), steps=8, lr=1e-3, adapter_lr=1e-3)
    trainer = ExitReadyTrainer(llm, config, vocab)
    assert len(trainer.student.base_model.model.model.layers) == 2
    batch = batch_windows(tokens, 0, B, S, seed=1)
    before = trainer.evaluate(batch)
    assert "final" not in before
    for _ in range(config.steps):  # the same batch: the steps must fit it
        trainer.train_step(batch)
    after = trainer.evaluate(batch)
    assert after["2"]["loss"] < 0.9 * before["2"]["loss"]
    moved = {int(name.split("layers.")[1].split(".")[0]) for name, p in trainer.lora_params.items()
             if "lora_B" in name and p.abs().max() > 0}
    assert moved == {0, 1}  # the pairs train (B starts at zero)
    adapters = trainer.exit_adapters({"draft_only": True})
    assert {int(p.split("layers.")[1].split(".")[0]) for p in adapters.lora.pairs} == {0, 1}
    file = str(tmp_path / "draft.safetensors")
    adapters.save(file)
    prompts = random_prompts(VOCAB, [4, 7], seed=6)
    spec = _load(tiny[0], exit_adapter=file, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=2, layer=eecore.LayerDrafts(exit_layer=2, copy=eecore.DraftCopy())))
    outs = spec.generate(prompts, greedy(8))
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, greedy(8))]
    assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0


def test_draft_only_refuses_layer_dropout():
    with pytest.raises(ValueError, match="draft_only"):
        ExitReadyConfig(draft_only=True, p_max=0.1)
