"""Exit adapters: the trainer (eecore.train.exit_adapter) on a tiny random Llama, the file format
and checks (eecore.models.exit_adapter.ExitAdapters), the draft head against a by-hand computation
from HF transformers' own hidden states, and LLM(exit_adapter=...) in self-speculation."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eecore
from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import FORMAT, AdapterBlock, DraftHead, ExitAdapters, model_fingerprint
from eecore.sampling_params import SamplingParams
from eecore.train.exit_adapter import (AdapterTrainConfig, AdapterTrainer, TeacherPass,
                                       frequent_tokens, tokenize_file, tokenizer_fingerprint, train)
from eecore.train.loop import batch_windows
from engine_utils import greedy, random_prompts
from model_factory import load_for_windows, make_peaked_tiny_model, make_tiny_hf_model

L, VOCAB, D = 4, 320, 64
B, S = 2, 16                     # windows per step, window length
EOS = 2                          # the tiny tokenizer's <|im_end|>
CONFIG = AdapterTrainConfig(exit_layers=(1, 2, 3), adapter_hidden=16, draft_vocab=48, seq_len=S, batch_size=B,
                            steps=6, lr=1e-2, warmup=2, seed=0)


def _load(path, **kw):
    return load_for_windows(path, B, S, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, hf_model): a 4-layer random Llama with peaked distributions."""
    return make_peaked_tiny_model(tmp_path_factory.mktemp("ea"), num_layers=L, vocab_size=VOCAB, hidden_size=D)


@pytest.fixture(scope="module")
def llm(tiny):
    return _load(tiny[0])


@pytest.fixture(scope="module")
def same_shape_llm(tmp_path_factory):
    """Another model of the tiny model's shape (other weights)."""
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("ea_same"), num_layers=L, vocab_size=VOCAB,
                                 hidden_size=D, seed=1)
    return _load(path)


@pytest.fixture(scope="module")
def other_shape_llm(tmp_path_factory):
    """A model of another width and vocabulary (its tokenizer differs too)."""
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("ea_other"), num_layers=L, vocab_size=300, hidden_size=32)
    return _load(path)


@pytest.fixture(scope="module")
def tokens():
    """A Zipf-like token stream: a few ids are frequent, as in text."""
    rng = np.random.default_rng(0)
    return (rng.zipf(1.3, 6000) % VOCAB).astype(np.int32)


@pytest.fixture(scope="module")
def vocab(tokens):
    return frequent_tokens(tokens, VOCAB, CONFIG.draft_vocab, (EOS,))


@pytest.fixture(scope="module")
def trained(llm, tokens, vocab):
    """Adapters trained for a few steps, from the trainer's own export."""
    return train(llm, tokens, dataclasses.replace(CONFIG, steps=10), vocab=vocab).adapters({"test": True})


def _hf_states(hf, windows: torch.Tensor):
    with torch.no_grad():
        return hf(windows, output_hidden_states=True)


def _random_block(d: int, m: int, seed: int, scale: float = 0.5) -> AdapterBlock:
    g = torch.Generator().manual_seed(seed)
    return AdapterBlock(norm=1.0 + 0.2 * torch.randn(d, generator=g),
                        gate_up=torch.randn(2 * m, d, generator=g) / d ** 0.5,
                        down=scale * torch.randn(d, m, generator=g) / m ** 0.5)


def _by_hand(hf, block: AdapterBlock | None, h: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Draft logits of layer-E states h [n, d] in plain torch, through HF's own final norm and head."""
    h = h.double()
    if block is not None:
        eps = hf.config.rms_norm_eps
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * block.norm.double()
        m = block.hidden
        w_gate, w_up = block.gate_up.double()[:m], block.gate_up.double()[m:]
        h = h + (F.silu(n @ w_gate.t()) * (n @ w_up.t())) @ block.down.double().t()
    with torch.no_grad():
        normed = hf.model.norm(h.float())
    head = hf.lm_head.weight if vocab is None else hf.lm_head.weight[vocab]
    return (normed.double() @ head.double().t()).float()


def _eecore_full_depth(llm, windows: torch.Tensor):
    """eecore's own prefill over the windows: final residual stream -> runner.logits (fp32 [N, V])."""
    engine = llm.engine
    ids = [w.tolist() for w in windows]
    seqs = [Sequence(i, SamplingParams(max_tokens=1)) for i in ids]
    for s, i in zip(seqs, ids):
        engine.blocks.grow(s, len(i))
    try:
        _, hidden = engine.runner.forward([Row(s, 0, i) for s, i in zip(seqs, ids)])
        # row by row: the runner's logits buffer holds a decode step's rows, not a prefill's
        return torch.cat([engine.runner.logits(hidden[i:i + 1]).clone() for i in range(hidden.shape[0])])
    finally:
        for s in seqs:
            engine.blocks.free(s)


# ---- data ---------------------------------------------------------------------------------------


def test_frequent_tokens_top_k_ties_eos_sorted():
    # counts: 5 x4, 3 x3, 7 x3, 1 x2, 9 x2, 0 x1, 12 (out of the vocabulary) x9
    stream = np.array([5] * 4 + [3, 7] * 3 + [9, 1] * 2 + [0] + [12] * 9, dtype=np.int32)
    rng = np.random.default_rng(1)
    stream = stream[rng.permutation(len(stream))]  # order in the stream does not matter
    pick = lambda k, always=(): frequent_tokens(stream, 10, k, always).tolist()
    assert pick(3) == [3, 5, 7]
    assert pick(4) == [1, 3, 5, 7]            # 1 and 9 tie: the lower id wins
    assert pick(5) == [1, 3, 5, 7, 9]
    assert pick(4, (2,)) == [2, 3, 5, 7]      # EOS (never seen) is in, k ids in all
    assert pick(3, (5,)) == [3, 5, 7]         # EOS already among the frequent ones
    assert pick(3, (-1, 99, 8)) == [3, 5, 8]  # 3 and 7 tie; ids outside the vocabulary are ignored
    assert pick(1, (8, 6)) == [6, 8]          # more than k only for `always` itself
    assert pick(50) == list(range(10))        # never an id outside the vocabulary (12)
    assert frequent_tokens(stream, 10, 3).dtype == torch.long


def test_batch_windows_is_a_function_of_seed_and_step():
    stream = np.arange(1000, dtype=np.int32)
    later = batch_windows(stream, 7, 4, 16, seed=3)
    first = batch_windows(stream, 0, 4, 16, seed=3)
    assert torch.equal(batch_windows(stream, 7, 4, 16, seed=3), later)  # whatever came before
    assert torch.equal(batch_windows(stream, 0, 4, 16, seed=3), first)
    assert not torch.equal(first, later)
    assert not torch.equal(batch_windows(stream, 7, 4, 16, seed=4), later)
    assert later.shape == (4, 16) and later.dtype == torch.long
    for row in torch.cat([first, later]):  # contiguous windows of the stream
        assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 16))
    # every start can be drawn, the last one included
    starts = {int(w[0]) for step in range(300) for w in batch_windows(np.arange(20, dtype=np.int32), step, 4, 16, 0)}
    assert starts == set(range(5))
    assert torch.equal(batch_windows(np.arange(16, dtype=np.int32), 0, 2, 16, 0), torch.arange(16).repeat(2, 1))
    with pytest.raises(ValueError, match="15 tokens.*seq_len=16"):
        batch_windows(np.arange(15, dtype=np.int32), 0, 2, 16, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(exit_layers=()), "exit_layers"), (dict(exit_layers=(0, 2)), "exit_layers"),
    (dict(exit_layers=(2.0,)), "exit_layers"), (dict(adapter_hidden=0), "adapter_hidden"),
    (dict(seq_len=0), "seq_len"), (dict(batch_size=0), "batch_size"), (dict(steps=0), "steps"),
    (dict(draft_vocab=-1), "draft_vocab"), (dict(lr=0.0), "lr"), (dict(temperature=-1.0), "temperature"),
    (dict(warmup=-1), "warmup"), (dict(min_lr_ratio=1.5), "min_lr_ratio"), (dict(max_grad_norm=0.0), "max_grad_norm"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdapterTrainConfig(**kwargs)


def test_trainer_refuses_bad_models(tiny, llm):
    with pytest.raises(ValueError, match="exit layer 4 must be below"):
        AdapterTrainer(llm, dataclasses.replace(CONFIG, exit_layers=(2, L)), None)
    with pytest.raises(ValueError, match="float32"):
        AdapterTrainer(eecore.LLM(tiny[0], dtype="bfloat16", device="cpu"), CONFIG, None)


class _CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.backend = inner.backend

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


def test_tokenize_file_and_its_cache(llm, other_shape_llm, tmp_path):
    text = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))  # café 日本語\n" * 50
    path = tmp_path / "train.txt"
    path.write_text(text, encoding="utf-8")
    expected = np.asarray(llm.tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
    cache = tmp_path / "cache"
    counting = _CountingTokenizer(llm.tokenizer)
    first = tokenize_file(counting, str(path), str(cache))
    assert first.dtype == np.int32 and np.array_equal(first, expected)
    assert counting.calls >= 1 and len(os.listdir(cache)) == 1
    counting.calls = 0
    again = tokenize_file(counting, str(path), str(cache))
    assert counting.calls == 0 and np.array_equal(again, expected)  # from the cache
    assert np.array_equal(tokenize_file(llm.tokenizer, str(path)), expected)  # no cache at all
    # another tokenizer must not be served the first one's cached stream
    other = other_shape_llm.tokenizer
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(llm.tokenizer)
    theirs = tokenize_file(other, str(path), str(cache))
    assert np.array_equal(theirs, np.asarray(other.encode(text, add_special_tokens=False), dtype=np.int32))
    assert len(os.listdir(cache)) == 2
    # a changed text is tokenized again
    path.write_text(text + "x = 1\n", encoding="utf-8")
    assert len(tokenize_file(llm.tokenizer, str(path), str(cache))) > len(expected)


# ---- the teacher pass -------------------------------------------------------------------------------


def test_teacher_pass_matches_hf_and_eecore_full_depth(tiny, llm, tokens, vocab):
    _, hf = tiny
    windows = batch_windows(tokens, 0, B, S, seed=5)
    out = _hf_states(hf, windows)
    full = _eecore_full_depth(llm, windows)
    torch.testing.assert_close(full.view(B, S, -1), out.logits, rtol=1e-4, atol=1e-4)  # the oracle agrees
    states, logits = TeacherPass(llm, (3, 1, 2), llm.model.lm_head)(windows)
    assert sorted(states) == [1, 2, 3]
    for E in (1, 2, 3):
        assert states[E].shape == (B * S, D) and states[E].dtype == torch.float32
        torch.testing.assert_close(states[E].view(B, S, D), out.hidden_states[E], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
    # over the draft vocabulary: those columns of the same logits
    head = llm.model.lm_head.index_select(0, vocab)
    states_v, logits_v = TeacherPass(llm, (2,), head)(windows)
    torch.testing.assert_close(logits_v, full[:, vocab], rtol=1e-5, atol=1e-5)
    assert torch.equal(states_v[2], states[2])
    # the pass gives its KV blocks back
    assert len(llm.engine.blocks._free) == llm.engine.blocks.num_blocks


# ---- training -------------------------------------------------------------------------------------------


def test_initial_loss_is_the_plain_exit_kl_and_training_lowers_every_exit(tiny, llm, tokens, vocab):
    _, hf = tiny
    trainer = AdapterTrainer(llm, CONFIG, vocab)
    windows = batch_windows(tokens, 0, B, S, seed=11)
    before = trainer.evaluate(windows)
    # at step 0 every adapter is the identity: the loss is KL(last layer || the model's own head
    # read off layer E), over the draft vocabulary, computed here from HF's hidden states
    out = _hf_states(hf, windows)
    teacher = F.log_softmax(out.logits.reshape(B * S, -1)[:, vocab].double(), -1)
    for E in CONFIG.exit_layers:
        student = F.log_softmax(_by_hand(hf, None, out.hidden_states[E].reshape(B * S, D), vocab).double(), -1)
        kl = (teacher.exp() * (teacher - student)).sum(-1).mean().item()
        assert before[E]["loss"] == pytest.approx(kl, rel=1e-3, abs=2e-5)
        agree = (student.argmax(-1) == teacher.argmax(-1)).double().mean().item()
        assert before[E]["agreement"] == pytest.approx(agree, abs=1e-4)
    assert all(before[E]["loss"] > 0.05 for E in CONFIG.exit_layers)  # something to learn
    records = [trainer.train_step(windows) for _ in range(8)]
    after = trainer.evaluate(windows)
    for E in CONFIG.exit_layers:
        assert after[E]["loss"] < 0.9 * before[E]["loss"], (E, before, after)
    assert [r["step"] for r in records] == list(range(8)) and trainer.step == 8
    assert records[0]["lr"] == pytest.approx(CONFIG.lr / CONFIG.warmup)  # warmup
    assert records[1]["lr"] == pytest.approx(CONFIG.lr)
    assert set(records[0]) >= {f"loss_{E}" for E in CONFIG.exit_layers} | {f"agree_{E}" for E in CONFIG.exit_layers}
    # the base stays frozen: no trainable parameter is a model tensor
    assert not llm.model.lm_head.requires_grad and not llm.model.final_norm.requires_grad


def _weights(trainer):
    return {E: [t.detach().clone() for t in b.tensors()] for E, b in trainer.blocks.items()}


def test_interrupted_run_resumes_to_the_same_weights(llm, tokens, vocab, tmp_path):
    whole = train(llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=2)
    assert whole.step == CONFIG.steps and len(whole.history) == CONFIG.steps
    ckpt = tmp_path / "b"
    part = train(llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=str(ckpt), checkpoint_every=2, stop_after=3)
    assert part.step == 3
    assert torch.load(ckpt / "last.pt", weights_only=False)["step"] == 2  # the last checkpoint before the stop
    logged = []
    resumed = train(llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=str(ckpt), checkpoint_every=2,
                    log=logged.append)
    assert [r["step"] for r in logged] == [2, 3, 4, 5]  # continued from step 2, did not start over
    assert resumed.history == whole.history
    for E, tensors in _weights(whole).items():
        for a, b in zip(tensors, _weights(resumed)[E]):
            assert torch.equal(a, b)
    assert any(bool(t.abs().sum() > 0) for t in _weights(whole)[1][2:])  # the down projection moved
    # a finished run is not trained further
    again = train(llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=str(ckpt), log=logged.append)
    assert again.step == CONFIG.steps and len(logged) == 4
    assert torch.equal(_weights(again)[2][2], _weights(whole)[2][2])


def test_heldout_evaluation_during_training(llm, tokens, vocab):
    heldout = np.roll(tokens, 777)
    trainer = train(llm, tokens, dataclasses.replace(CONFIG, steps=3), vocab=vocab, heldout=heldout, eval_every=2)
    assert ["heldout" in r for r in trainer.history] == [False, True, True]  # every 2 steps, and the last
    windows = batch_windows(heldout, 0, CONFIG.batch_size, CONFIG.seq_len, CONFIG.seed + 1)
    assert trainer.history[-1]["heldout"] == trainer.evaluate(windows)


def test_checkpoint_of_another_run_is_refused(llm, same_shape_llm, tokens, vocab, tmp_path):
    ckpt = str(tmp_path / "c")
    train(llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=ckpt, checkpoint_every=1, stop_after=1)
    with pytest.raises(ValueError, match="another configuration"):
        train(llm, tokens, dataclasses.replace(CONFIG, lr=2e-2), vocab=vocab, checkpoint_dir=ckpt)
    with pytest.raises(ValueError, match="another configuration"):
        train(llm, tokens, dataclasses.replace(CONFIG, exit_layers=(1, 2)), vocab=vocab, checkpoint_dir=ckpt)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        train(llm, tokens, CONFIG, vocab=vocab[1:], checkpoint_dir=ckpt)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        train(llm, tokens, CONFIG, vocab=None, checkpoint_dir=ckpt)
    with pytest.raises(ValueError, match="another model"):
        train(same_shape_llm, tokens, CONFIG, vocab=vocab, checkpoint_dir=ckpt)


def test_trainer_export_fits_its_model(llm, same_shape_llm, trained, vocab, tmp_path):
    assert trained.exit_layers() == [1, 2, 3] and torch.equal(trained.vocab, vocab)
    assert trained.base == model_fingerprint(llm.model) and trained.info == {"test": True}
    trained.check_model(llm.model)
    with pytest.raises(ValueError, match="another model of the same shape"):
        trained.check_model(same_shape_llm.model)
    path = str(tmp_path / "a.safetensors")
    trained.save(path)
    loaded = ExitAdapters.load(path)
    for E in trained.exit_layers():
        for a, b in zip(trained.blocks[E].tensors(), loaded.blocks[E].tensors()):
            assert torch.equal(a, b)


# ---- the file format ---------------------------------------------------------------------------------


def _assert_same(a: ExitAdapters, b: ExitAdapters) -> None:
    assert a.exit_layers() == b.exit_layers()
    for E in a.exit_layers():
        for x, y in zip(a.blocks[E].tensors(), b.blocks[E].tensors()):
            assert x.dtype == y.dtype and torch.equal(x, y)
    assert (a.vocab is None) == (b.vocab is None)
    if a.vocab is not None:
        assert b.vocab.dtype == torch.long and torch.equal(a.vocab, b.vocab)
    assert a.base == b.base and a.info == b.info


def test_save_load_round_trip(llm, vocab, tmp_path):
    base = model_fingerprint(llm.model)
    blocks = {1: _random_block(D, 8, 0), 3: _random_block(D, 8, 1).to(torch.bfloat16, "cpu")}
    info = {"steps": 10, "note": "unicode ✓", "nested": {"a": [1, 2]}}
    for name, adapters in {"with_vocab": ExitAdapters(blocks, vocab, base, info),
                           "no_vocab": ExitAdapters(blocks, None, base, info),
                           "vocab_only": ExitAdapters({}, vocab, base, {})}.items():
        path = str(tmp_path / f"{name}.safetensors")
        adapters.save(path)
        loaded = ExitAdapters.load(path)
        _assert_same(adapters, loaded)
        loaded.check_model(llm.model)
    assert ExitAdapters.load(str(tmp_path / "vocab_only.safetensors")).blocks == {}


def test_load_errors(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(FileNotFoundError, match="does not exist"):
        ExitAdapters.load(str(tmp_path / "nope.safetensors"))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    with pytest.raises(ValueError, match="not a safetensors exit adapter file"):
        ExitAdapters.load(str(garbage))
    block = _random_block(D, 8, 0)
    tensors = {"exit.2.norm": block.norm, "exit.2.gate_up": block.gate_up, "exit.2.down": block.down}
    other = str(tmp_path / "other.safetensors")
    save_file(tensors, other, metadata={"format": "some-other-format"})
    with pytest.raises(ValueError, match="format 'some-other-format', expected one of 'eecore-exit-adapter-1'"):
        ExitAdapters.load(other)
    save_file(tensors, other)  # no metadata at all
    with pytest.raises(ValueError, match="format None"):
        ExitAdapters.load(other)
    bad_shape = str(tmp_path / "shape.safetensors")
    ExitAdapters({2: AdapterBlock(block.norm, block.gate_up, block.down[:, :5])}).save(bad_shape)
    with pytest.raises(ValueError, match="exit 2 has inconsistent shapes"):
        ExitAdapters.load(bad_shape)
    ExitAdapters({2: AdapterBlock(block.norm[None], block.gate_up, block.down)}).save(bad_shape)  # a 2-D norm
    with pytest.raises(ValueError, match="exit 2 has inconsistent shapes"):
        ExitAdapters.load(bad_shape)
    lacking = str(tmp_path / "lacking.safetensors")
    save_file({"exit.2.norm": block.norm, "exit.2.gate_up": block.gate_up}, lacking, metadata={"format": FORMAT})
    with pytest.raises(ValueError, match="exit 2 lacks tensor 'exit.2.down'"):
        ExitAdapters.load(lacking)
    for ids in ([3, 3, 5], [5, 4], []):
        bad_vocab = str(tmp_path / "vocab.safetensors")
        save_file({"draft_vocab": torch.tensor(ids, dtype=torch.int32)}, bad_vocab, metadata={"format": FORMAT})
        with pytest.raises(ValueError, match="strictly increasing"):
            ExitAdapters.load(bad_vocab)


@pytest.mark.parametrize("case", ["0-d norm", "1-D down"])
def test_load_error_for_tensors_of_the_wrong_rank(tmp_path, case):
    block = _random_block(D, 8, 0)
    norm, down = (block.norm[0], block.down) if case == "0-d norm" else (block.norm, block.down[:, 0].contiguous())
    path = str(tmp_path / "rank.safetensors")
    ExitAdapters({2: AdapterBlock(norm, block.gate_up, down)}).save(path)
    with pytest.raises(ValueError, match="exit 2 has inconsistent shapes"):
        ExitAdapters.load(path)


def test_load_error_for_a_bad_tensor_name(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "badname.safetensors")
    save_file({"exit.x.norm": torch.ones(D)}, path, metadata={"format": FORMAT})
    with pytest.raises(ValueError, match="badname.safetensors.*exit.x.norm"):
        ExitAdapters.load(path)


def test_check_model_errors(llm, same_shape_llm, other_shape_llm, vocab):
    model = llm.model
    base = model_fingerprint(model)
    ok = ExitAdapters({2: _random_block(D, 8, 0)}, vocab, base)
    ok.check_model(model)
    with pytest.raises(ValueError, match="hidden_size=64, but this model has hidden_size=32"):
        ok.check_model(other_shape_llm.model, "ad.safetensors")
    with pytest.raises(ValueError, match="ad.safetensors: made for another model of the same shape"):
        ok.check_model(same_shape_llm.model, "ad.safetensors")
    for E in (0, L, L + 3):
        with pytest.raises(ValueError, match=f"exit layer {E} outside 1..{L - 1}"):
            ExitAdapters({E: _random_block(D, 8, 0)}, None, base).check_model(model)
    for ids in ([0, 5, VOCAB], [-1, 4]):
        with pytest.raises(ValueError, match="draft_vocab holds ids outside"):
            ExitAdapters({}, torch.tensor(ids), base).check_model(model)
    # without a fingerprint, the shape is still checked
    with pytest.raises(ValueError, match="hidden size 32"):
        ExitAdapters({2: _random_block(32, 8, 0)}).check_model(model)


# ---- the draft head ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_block", [True, False])
@pytest.mark.parametrize("with_vocab", [True, False])
def test_draft_head_matches_hf_by_hand(tiny, llm, tokens, vocab, with_block, with_vocab):
    _, hf = tiny
    E = 2
    block = _random_block(D, 12, 3)
    adapters = ExitAdapters({E: block} if with_block else {}, vocab if with_vocab else None)
    head = DraftHead(llm.model, E, adapters, max_rows=B * S)
    windows = batch_windows(tokens, 0, B, S, seed=21)
    h = _hf_states(hf, windows).hidden_states[E].reshape(B * S, D).contiguous()
    h_before = h.clone()
    expected = _by_hand(hf, block if with_block else None, h, vocab if with_vocab else None)
    for n in (B * S, 5):  # a smaller batch after a bigger one: the buffers are reused
        logits = head.logits(h[:n])
        assert logits.shape == (n, VOCAB) and logits.dtype == torch.float32
        cols = vocab if with_vocab else torch.arange(VOCAB)
        torch.testing.assert_close(logits[:, cols], expected[:n], rtol=1e-4, atol=1e-4)
        if with_vocab:
            outside = torch.ones(VOCAB, dtype=torch.bool)
            outside[vocab] = False
            assert bool(torch.isneginf(logits[:, outside]).all())
        assert torch.equal(h, h_before)  # the exit-query cache is left untouched
        # the column logits (what greedy drafting reads) are the draft vocabulary's columns
        columns = head.columns(h[:n])
        assert columns.shape == (n, head.vocab_size) and columns.dtype == torch.float32
        torch.testing.assert_close(columns, expected[:n], rtol=1e-4, atol=1e-4)
        assert torch.equal(head.widen(columns.clone()), logits)
        assert torch.equal(head.token_ids(columns.argmax(-1)), logits.argmax(-1))
        assert head.token_id_list(columns.argmax(-1).tolist()) == logits.argmax(-1).tolist()
    assert head.vocab_size == (len(vocab) if with_vocab else VOCAB)
    gap, top1 = head.top2_gap(h)
    probs = expected.double().softmax(-1)
    p = probs.topk(2, dim=-1).values
    torch.testing.assert_close(gap.double(), p[:, 0] - p[:, 1], rtol=1e-4, atol=1e-4)
    ids = expected.argmax(-1)
    assert torch.equal(top1, vocab[ids] if with_vocab else ids)
    if with_block:  # the block changes the answer (else this test could not see it missing)
        assert not torch.allclose(expected, _by_hand(hf, None, h, vocab if with_vocab else None), atol=1e-2)


# ---- LLM(exit_adapter=...) ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory, llm, trained, vocab):
    root = tmp_path_factory.mktemp("files")
    base = model_fingerprint(llm.model)
    files = {"trained": str(root / "trained.safetensors"), "random": str(root / "random.safetensors")}
    trained.save(files["trained"])
    # random non-zero blocks stored in bf16, with the draft vocabulary
    ExitAdapters({E: _random_block(D, 16, E, scale=1.0).to(torch.bfloat16, "cpu") for E in (1, 2, 3)},
                 vocab, base).save(files["random"])
    return files


@pytest.fixture
def draft_head_calls(monkeypatch):
    calls = []
    columns = DraftHead.columns  # what drafting reads (DraftHead.logits widens it)

    def spy(self, hidden):
        calls.append((self.exit_layer, self.block is not None, None if self.vocab is None else len(self.vocab)))
        return columns(self, hidden)

    monkeypatch.setattr(DraftHead, "columns", spy)
    return calls


@pytest.mark.parametrize("which, E", [("trained", 2), ("random", 1), ("random", 3)])
def test_speculation_with_adapters_is_full_depth_greedy(tiny, which, E, adapter_files, vocab, draft_head_calls):
    path, hf = tiny
    kw = dict(dtype="float32", device="cpu", block_size=4)
    spec = eecore.SelfSpeculativeConfig(exit_layer=E, num_speculations=3)
    for batch in (1, 4):
        prompts = random_prompts(VOCAB, [3 + 5 * i for i in range(batch)], seed=batch + E)
        params = [greedy(12 + 3 * i) for i in range(batch)]
        full = eecore.LLM(path, **kw).generate(prompts, params)
        draft_head_calls.clear()
        llm = eecore.LLM(path, exit_adapter=adapter_files[which], speculative=spec, **kw)
        assert llm.exit_adapters is not None and llm.exit_adapters.exit_layers() == [1, 2, 3]
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in full]
        # the drafts were read through exit E's adapter block and the draft vocabulary
        assert draft_head_calls and set(draft_head_calls) == {(E, True, len(vocab))}
        assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0


def test_vocabulary_only_file_drafts_within_the_vocabulary(tiny, llm, tmp_path, draft_head_calls):
    """A draft vocabulary that excludes every token the model generates: no draft can be accepted,
    and the output is still exactly full depth; any exit layer is allowed (no adapter blocks)."""
    path, hf = tiny
    prompts = random_prompts(VOCAB, [4, 7, 2], seed=3)
    kw = dict(dtype="float32", device="cpu", block_size=4)
    full = eecore.LLM(path, **kw).generate(prompts, greedy(15))
    produced = {t for o in full for t in o.token_ids}
    excluded = torch.tensor(sorted(set(range(VOCAB)) - produced))
    file = str(tmp_path / "excluding.safetensors")
    ExitAdapters({}, excluded, model_fingerprint(llm.model)).save(file)
    spec = eecore.SelfSpeculativeConfig(exit_layer=3, num_speculations=3)
    outs = eecore.LLM(path, exit_adapter=file, speculative=spec, **kw).generate(prompts, greedy(15))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0
    assert all(o.metrics["acceptance_rate"] == 0.0 for o in outs)
    assert set(draft_head_calls) == {(3, False, len(excluded))}


def test_llm_exit_adapter_errors(tiny, same_shape_llm, llm, tmp_path):
    from pathlib import Path

    path, _ = tiny
    kw = dict(dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="exit_adapter=True"):
        eecore.LLM(path, exit_adapter=True, **kw)
    partial = str(tmp_path / "partial.safetensors")
    ExitAdapters({1: _random_block(D, 8, 0), 3: _random_block(D, 8, 1)}, None, model_fingerprint(llm.model)).save(partial)
    with pytest.raises(ValueError, match="exit_layer"):
        eecore.LLM(path, exit_adapter=partial, speculative=eecore.SelfSpeculativeConfig(exit_layer=2), **kw)
    for bad in (3.5, 1, ["a.safetensors"], {"file": partial}):
        with pytest.raises(TypeError, match="exit_adapter"):
            eecore.LLM(path, exit_adapter=bad, **kw)
    with pytest.raises(FileNotFoundError):
        eecore.LLM(path, exit_adapter=str(tmp_path / "missing.safetensors"), **kw)
    # an adapter file made for another model
    foreign = str(tmp_path / "foreign.safetensors")
    ExitAdapters({2: _random_block(D, 8, 0)}, None, model_fingerprint(same_shape_llm.model)).save(foreign)
    with pytest.raises(ValueError, match="another model of the same shape"):
        eecore.LLM(path, exit_adapter=foreign, **kw)
    # None / False mean none; a pathlib.Path is a path
    assert eecore.LLM(path, exit_adapter=False, **kw).exit_adapters is None
    assert eecore.LLM(path, exit_adapter=None, **kw).exit_adapters is None
    loaded = eecore.LLM(path, exit_adapter=Path(partial), speculative=eecore.SelfSpeculativeConfig(exit_layer=3), **kw)
    assert loaded.exit_adapters.exit_layers() == [1, 3]


def test_training_cli_end_to_end(tiny, llm, tmp_path, capsys):
    """python -m eecore.train.exit_adapter on a corpus folder, then the file in LLM(exit_adapter=)."""
    import json

    from eecore.sources.corpus import Corpus, CorpusFile, write_corpus
    from eecore.train.exit_adapter import main

    path, _ = tiny
    code = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * 2)\n"
    corpus = Corpus(train=[CorpusFile("fake", "a.py", code * 20, "0")],
                    heldout=[CorpusFile("held", "b.py", "Hello world! " * 30, "1")], versions={"fake": "1"})
    write_corpus(corpus, str(tmp_path / "corpus"))
    out, ckpt = str(tmp_path / "ad.safetensors"), str(tmp_path / "ckpt")
    args = ["--corpus", str(tmp_path / "corpus"), "--out", out, "--checkpoint-dir", ckpt, "--model", path,
            "--exit-layers", "1", "3", "--adapter-hidden", "8", "--draft-vocab", "40", "--seq-len", str(S),
            "--batch-size", str(B), "--steps", "3", "--warmup", "1", "--checkpoint-every", "2",
            "--eval-every", "2"]
    assert main(args) == 0
    adapters = ExitAdapters.load(out)
    assert adapters.exit_layers() == [1, 3] and len(adapters.vocab) == 40 and EOS in adapters.vocab.tolist()
    assert adapters.blocks[1].down.dtype == torch.bfloat16  # the default --save-dtype
    adapters.check_model(llm.model)
    assert adapters.info["config"]["steps"] == 3 and adapters.info["corpus"]["versions"] == {"fake": "1"}
    assert set(adapters.info["final_heldout"]) == {"1", "3"}  # JSON keys, after the file's metadata
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(printed) == {"1", "3"}
    log = [json.loads(line) for line in open(os.path.join(ckpt, "train_log.jsonl"))]
    assert [r["step"] for r in log] == [0, 1, 2]
    assert torch.load(os.path.join(ckpt, "last.pt"), weights_only=False)["step"] == 3
    spec = eecore.SelfSpeculativeConfig(exit_layer=3, num_speculations=2)
    kw = dict(dtype="float32", device="cpu")
    prompts = random_prompts(VOCAB, [5, 2], seed=9)
    assert [o.token_ids for o in eecore.LLM(path, exit_adapter=out, speculative=spec, **kw).generate(prompts, greedy(8))] \
        == [o.token_ids for o in eecore.LLM(path, **kw).generate(prompts, greedy(8))]


# ---- early exit through exit adapters -------------------------------------------------------------


def _exit_heads(hf, adapters: ExitAdapters) -> dict:
    """{E: h -> full-width logits, -inf outside the draft vocabulary}: the oracle's exit heads."""
    def head(block):
        def logits(h):
            cols = _by_hand(hf, block, h[None], adapters.vocab)[0]
            if adapters.vocab is None:
                return cols
            out = torch.full((VOCAB,), float("-inf"), dtype=cols.dtype)
            out[adapters.vocab] = cols
            return out
        return logits
    return {E: head(b) for E, b in adapters.blocks.items()}


@pytest.mark.parametrize("ee, rule", [(dict(measure="static", exit_layer=1), "all"),
                                      (dict(measure="static", exit_layer=3), "all"),
                                      (dict(measure="softmax", threshold=0.3), "all"),
                                      (dict(measure="softmax", threshold=0.3), "compact")])
def test_early_exit_reads_tokens_and_confidence_through_adapters(tiny, adapter_files, ee, rule):
    """Against the Algorithm 1 oracle whose exit heads are the by-hand adapter + draft vocabulary:
    an exiting row's token (and the softmax gap that decides the exit) come from its exit layer's
    adapter; only adapter layers are checked; the skipped layers' K/V come from the raw exit state."""
    from ee_reference import ReferenceEarlyExit

    path, hf = tiny
    file = adapter_files["random"]
    adapters = ExitAdapters.load(file)
    prompts = random_prompts(VOCAB, [3, 6, 4], seed=7)
    config = eecore.EarlyExitConfig(batch_rule=rule, **ee)
    kw = dict(dtype="float32", device="cpu", block_size=4)
    outs = eecore.LLM(path, exit_adapter=file, early_exit=config, **kw).generate(prompts, greedy(10))
    ref = ReferenceEarlyExit(hf, ee["measure"], ee.get("threshold", 0.5), exit_layer=ee.get("exit_layer"), rule=rule,
                             exit_logits=_exit_heads(hf, adapters))
    if rule == "all":
        expected = ref.generate(prompts, 10)
        assert ([o.token_ids for o in outs], [o.exit_layers for o in outs]) == expected
    else:
        for b, p in enumerate(prompts):
            assert (outs[b].token_ids, outs[b].exit_layers) == tuple(r[0] for r in ref.generate([p], 10))
    exits = [e for o in outs for e in o.exit_layers[1:]]
    assert min(exits) < L  # some tokens did exit early (through an adapter)
    plain = eecore.LLM(path, early_exit=config, **kw).generate(prompts, greedy(10))
    assert [o.token_ids for o in plain] != [o.token_ids for o in outs]  # the adapters are in effect


def test_early_exit_checks_only_adapter_layers(tiny, llm, tmp_path):
    path, _ = tiny
    file = str(tmp_path / "only2.safetensors")
    ExitAdapters({2: _random_block(D, 8, 5, scale=1.0)}, None, model_fingerprint(llm.model)).save(file)
    config = eecore.EarlyExitConfig(measure="softmax", threshold=0.0, batch_rule="compact")
    outs = eecore.LLM(path, exit_adapter=file, early_exit=config, dtype="float32", device="cpu").generate(
        random_prompts(VOCAB, [5, 3], seed=2), greedy(6))
    # threshold 0: every check exits; layer 1 has no adapter, so the first check is at layer 2
    assert all(o.exit_layers[1:] == [2] * 5 for o in outs)
