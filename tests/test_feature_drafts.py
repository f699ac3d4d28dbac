"""Feature drafts (eecore.models.feature_head, eecore.speculative.feature_drafts,
eecore.train.feature_head): a head trained a few steps on a tiny model, its file and its refusals,
and self-speculation with it: full depth's greedy tokens, and the full model's law when sampling."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import eecore
from eecore.models.feature_head import FeatureHead, default_taps
from eecore.train.feature_head import FeatureHeadConfig, train
from engine_utils import emulate_graphs, greedy, law_p_value, random_prompts
from model_factory import make_tiny_hf_model

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("feature"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def llm(tiny):
    return eecore.LLM(tiny[0], dtype="float32", device="cpu")


def _stream(vocab_size: int, n: int = 3000, seed: int = 0) -> np.ndarray:
    """A token stream a head can learn something of: a repeating pattern."""
    base = np.random.default_rng(seed).integers(0, vocab_size, 40)
    return base[(np.arange(n) * 7) % 40].astype(np.int32)


@pytest.fixture(scope="module")
def head_file(llm, tiny, tmp_path_factory):
    config = FeatureHeadConfig(steps=30, batch_size=4, seq_len=24, drafts=3, lr=3e-3)
    trainer = train(llm, _stream(tiny[1].config.vocab_size), config)
    path = str(tmp_path_factory.mktemp("head") / "head.safetensors")
    trainer.trained_head({"steps": trainer.step}).save(path)
    return path, trainer


def test_training_lowers_the_loss_and_resumes_where_it_stopped(llm, tiny, tmp_path, head_file):
    _, trainer = head_file
    losses = [r["loss"] for r in trainer.history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert trainer.history[-1]["agree_1"] > trainer.history[0]["agree_1"]
    # interrupted after 4 steps and resumed: the weights of an uninterrupted run of 8
    tokens = _stream(tiny[1].config.vocab_size)
    config = FeatureHeadConfig(steps=8, batch_size=2, seq_len=16, drafts=2)
    whole = train(llm, tokens, config)
    ckpt = str(tmp_path / "ckpt")
    train(llm, tokens, config, checkpoint_dir=ckpt, stop_after=4)
    resumed = train(llm, tokens, config, checkpoint_dir=ckpt)
    assert resumed.step == 8
    for name, p in whole.params.items():
        assert torch.allclose(p, resumed.params[name], atol=1e-6), name


def test_training_goes_on_from_a_head_file(llm, tiny, head_file):
    """`init`: the trainer starts from the file's weights (a step at lr 0 leaves them as they were)
    and refuses a file that does not match what it was asked to train."""
    path, _ = head_file
    tokens = _stream(tiny[1].config.vocab_size)
    init = FeatureHead.load(path, llm.model)
    config = FeatureHeadConfig(steps=1, batch_size=2, seq_len=16, drafts=2, lr=0.0)
    trainer = train(llm, tokens, config, init=init)
    assert trainer.step == 1
    for name, w in FeatureHead.load(path).weights.items():
        assert torch.equal(trainer.params[name].detach(), w), name
    with pytest.raises(ValueError, match="init: the head reads layers"):
        train(llm, tokens, config, init=FeatureHead.load(path), taps=(1,))
    # a head goes on over another draft vocabulary: the same weights, the given vocabulary's rows
    moved = train(llm, tokens, config, init=FeatureHead.load(path), vocab=torch.arange(10))
    assert moved.head.vocab.tolist() == list(range(10)) and moved.head_rows.shape[0] == 10
    for name, w in FeatureHead.load(path).weights.items():
        assert torch.equal(moved.params[name].detach(), w), name
    with pytest.raises(ValueError, match="intermediate_size"):
        train(llm, tokens, FeatureHeadConfig(steps=1, batch_size=2, seq_len=16, drafts=2, intermediate_size=7),
              init=FeatureHead.load(path))


def test_the_draft_vocabulary_of_a_corpus_holds_its_most_frequent_tokens(llm):
    from eecore.train.feature_head import draft_vocabulary

    eos = [t for t in llm.model.config.eos_token_ids if t not in (5, 7, 9)]
    tokens = np.array([9, 5, 5, 5, 7, 7, 1, 2, 3, 9, 9, 9])
    assert draft_vocabulary(str(len(eos) + 2), llm, tokens).tolist() == sorted(eos + [5, 9])
    assert draft_vocabulary("none", llm, tokens) is None
    for bad in ("0", "many", str(llm.model.config.vocab_size + 1)):
        with pytest.raises(ValueError, match="--draft-vocab must be 'shipped', 'none' or a count"):
            draft_vocabulary(bad, llm, tokens)


def test_an_eight_bit_file_holds_the_weights_to_half_a_step(llm, tmp_path, head_file):
    """FeatureHead.save(dtype=torch.int8): matrices as 8-bit integers with a scale a row, norms in
    bf16; loading widens them back, each weight within half a step of its row's scale."""
    from safetensors import safe_open

    path, _ = head_file
    head = FeatureHead.load(path, llm.model)
    small = str(tmp_path / "head-int8.safetensors")
    head.save(small, torch.int8)
    with safe_open(small, framework="pt") as f:
        assert f.get_tensor("gate_up").dtype == torch.int8 and f.get_tensor("norm_mlp").dtype == torch.bfloat16
    assert os.path.getsize(small) < 0.6 * os.path.getsize(path)
    loaded = FeatureHead.load(small, llm.model)
    for name, w in head.weights.items():
        if w.dim() == 2:
            step = w.abs().amax(dim=1, keepdim=True) / 127
            assert ((loaded.weights[name] - w).abs() <= step / 2 + 1e-7).all(), name
        else:
            assert torch.allclose(loaded.weights[name], w.bfloat16().float()), name
    assert loaded.taps == head.taps and loaded.base == head.base


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_node_budget_caps_every_tree_and_lets_sure_chains_go_deeper(tiny, llm, head_file, monkeypatch,
                                                                      temperature):
    """FeatureDrafts.tree_nodes: no tree verifies more tokens (greedy: the most likely ones; sampled:
    its deepest draws dropped first), and greedy tokens stay full depth's (a sure chain going past
    tree_nodes / top_k positions: tests/test_token_tree.py)."""
    from eecore.speculative import decoder

    path, hf = tiny
    spec = eecore.LLM(path, dtype="float32", device="cpu", max_num_seqs=4, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=4, feature=eecore.FeatureDrafts(head=head_file[0], top_k=2, tree_nodes=4)))
    sizes, tree_row = [], decoder.tree_row

    def logged_row(seq, chain, alternatives):
        sizes.append(len(chain) + sum(map(len, alternatives)))
        return tree_row(seq, chain, alternatives)
    monkeypatch.setattr(decoder, "tree_row", logged_row)
    prompts = random_prompts(hf.config.vocab_size, [5, 9, 13, 6], seed=8)
    params = eecore.SamplingParams(max_tokens=16, temperature=temperature, seed=1, ignore_eos=True)
    outs = spec.generate(prompts, params)
    assert max(sizes) == 4 and all(len(o.token_ids) == 16 for o in outs)
    if temperature == 0.0:
        assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]


def test_a_wider_head_starts_as_the_head_it_widens(llm, tiny, head_file):
    """`--init` with a larger intermediate_size: the MLP's new neurons read the input but write
    nothing yet, so the wider head's steps give the head's own outputs; then they train."""
    path, _ = head_file
    head = FeatureHead.load(path, llm.model)
    width = head.weights["down"].shape[1]
    wider = head.widened(width + 24, seed=3)
    assert wider.weights["down"].shape[1] == width + 24 and wider.weights["gate_up"].shape[0] == 2 * (width + 24)
    d = head.weights["down"].shape[0]
    g = torch.Generator().manual_seed(0)
    state, embedding, rows = torch.randn(5, d, generator=g), torch.randn(5, d, generator=g), torch.randn(9, d, generator=g)
    a, b = head.step(state, embedding, rows), wider.step(state, embedding, rows)
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-4)
    with pytest.raises(ValueError, match="'intermediate_size' must be at least"):
        head.widened(width - 1)
    config = FeatureHeadConfig(steps=3, batch_size=2, seq_len=16, drafts=2, lr=1e-2, intermediate_size=width + 24)
    trainer = train(llm, _stream(tiny[1].config.vocab_size), config, init=FeatureHead.load(path, llm.model))
    assert trainer.params["down"].shape[1] == width + 24
    assert trainer.params["down"][:, width:].abs().sum() > 0  # the new neurons learned


def test_a_target_temperature_sharpens_what_the_head_is_scored_against(llm):
    from eecore.train.feature_head import FeatureHeadTrainer

    windows = torch.from_numpy(_stream(llm.model.config.vocab_size, 64)).long().view(2, 32)
    _, plain = FeatureHeadTrainer(llm, FeatureHeadConfig())._target(windows)
    _, sharp = FeatureHeadTrainer(llm, FeatureHeadConfig(target_temperature=0.5))._target(windows)
    assert torch.allclose(sharp, (plain.log() * 2).softmax(dim=-1), atol=1e-5)  # p^2, renormalized
    assert torch.equal(sharp.argmax(-1), plain.argmax(-1))
    for bad in (0, -1.0, True, "0.5"):
        with pytest.raises(ValueError, match="'target_temperature' must be a number > 0"):
            FeatureHeadConfig(target_temperature=bad)


def test_the_cosine_schedule_warms_up_then_decays_to_zero(llm):
    from eecore.train.feature_head import WARMUP, FeatureHeadTrainer

    trainer = FeatureHeadTrainer(llm, FeatureHeadConfig(steps=120, lr=1e-3, lr_schedule="cosine"))
    rates = []
    for step in range(120):
        trainer.step = step
        rates.append(trainer.learning_rate())
    assert rates[0] == pytest.approx(1e-3 / WARMUP) and rates[WARMUP - 1] == pytest.approx(1e-3)
    assert rates[WARMUP] == pytest.approx(1e-3) and rates[-1] < 1e-6
    assert all(x >= y for x, y in zip(rates[WARMUP:], rates[WARMUP + 1:]))
    with pytest.raises(ValueError, match="'lr_schedule'"):
        FeatureHeadConfig(lr_schedule="linear")
    # a checkpoint from before the schedule existed resumes as a constant-rate run
    constant = FeatureHeadTrainer(llm, FeatureHeadConfig(steps=120, lr=1e-3))
    state = constant.state_dict()
    del state["config"]["lr_schedule"]
    FeatureHeadTrainer(llm, FeatureHeadConfig(steps=120, lr=1e-3)).load_state_dict(state)
    with pytest.raises(ValueError, match="another run"):
        trainer.load_state_dict(state)


def test_the_file_round_trips_and_refuses_another_model(llm, tmp_path, head_file):
    path, trainer = head_file
    head = FeatureHead.load(path, llm.model)
    assert head.taps == default_taps(NUM_LAYERS) and head.info == {"steps": trainer.step}
    for name, w in head.weights.items():  # (stored in bf16)
        assert torch.allclose(w, trainer.params[name].detach().bfloat16().float()), name
    other_path, _ = make_tiny_hf_model(tmp_path / "other", num_layers=NUM_LAYERS, seed=1)
    with pytest.raises(ValueError, match="another model of the same shape"):
        FeatureHead.load(path, eecore.LLM(other_path, dtype="float32", device="cpu").model)
    wider, _ = make_tiny_hf_model(tmp_path / "wider", num_layers=NUM_LAYERS, hidden_size=96)
    with pytest.raises(ValueError, match="hidden_size"):
        FeatureHead.load(path, eecore.LLM(wider, dtype="float32", device="cpu").model)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "not-a-head.safetensors"))
    with pytest.raises(ValueError, match="not a feature head file"):
        FeatureHead.load(str(tmp_path / "not-a-head.safetensors"))


def _spec(path, head, drafts=3, adaptive=False, top_k=1, head_dtype=None, lookup=None, **kw):
    return eecore.LLM(path, dtype="float32", device="cpu", max_num_seqs=kw.pop("max_num_seqs", 8), **kw,
                      speculative=eecore.SelfSpeculativeConfig(
                          num_speculations=drafts, adaptive=adaptive, lookup=lookup,
                          feature=eecore.FeatureDrafts(head=head, top_k=top_k, dtype=head_dtype)))


@pytest.mark.parametrize("adaptive, top_k, head_dtype", [(False, 1, "int8"), (True, 1, "int8"),
                                                        (False, 3, "float32"), (True, 2, "int8")])
def test_feature_drafts_emit_full_depths_greedy_tokens(tiny, llm, head_file, adaptive, top_k, head_dtype):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    params = [greedy(8 + 4 * i) for i in range(len(prompts))]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    spec = _spec(path, head_file[0], adaptive=adaptive, top_k=top_k, head_dtype=head_dtype)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0
    if top_k > 1 and not adaptive:  # token trees: the head's runners-up verified, and some accepted
        stats = [o.metrics for o in outs]
        assert sum(m["num_tree_alternatives"] for m in stats) > 0
        assert sum(m["num_tree_alternatives_accepted"] for m in stats) > 0
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks


def test_greedy_trees_verify_the_heads_most_likely_nodes(tiny, llm, head_file, monkeypatch):
    """Each greedy tree the engine verifies holds d x top_k nodes whose path probabilities under the
    head, recomputed here from each step's logits, are the highest among the chain and top_k
    runners-up a position; some are not the fixed shape; the tokens stay full depth's."""
    from eecore.speculative import decoder

    path, hf = tiny
    top_k = 2
    spec = _spec(path, head_file[0], drafts=3, top_k=top_k)
    head, steps, trees = spec.engine.strategy.features.head, [], []
    column = (lambda t: t) if head.vocab is None else {int(t): c for c, t in enumerate(head.vocab.tolist())}.get
    step, tree_row = head.step, decoder.tree_row

    def logged_step(state, tokens, window):
        out = step(state, tokens, window)
        steps.append(torch.softmax(out[1][0].float(), dim=-1))  # (batch 1: one row)
        return out

    def logged_row(seq, chain, alternatives):
        trees.append((list(chain), [list(a) for a in alternatives], steps[:]))
        steps.clear()
        return tree_row(seq, chain, alternatives)
    monkeypatch.setattr(head, "step", logged_step)
    monkeypatch.setattr(decoder, "tree_row", logged_row)
    for prompt in random_prompts(hf.config.vocab_size, [4, 11, 7], seed=5):
        assert spec.generate([prompt], greedy(12))[0].token_ids == llm.generate([prompt], greedy(12))[0].token_ids
    reshaped = 0
    for chain, alternatives, probs in [t for t in trees if t[2]]:  # (rounds the head drafted)
        assert len(alternatives) == len(chain) <= len(probs)
        kept, reach = [], 1.0
        for j, token in enumerate(chain):
            kept += [reach * float(probs[j][column(a)]) for a in alternatives[j]]
            reach *= float(probs[j][column(token)])
            kept.append(reach)
        candidates, reach = [], 1.0
        for p in probs:
            top = p.topk(top_k + 1).values.tolist()
            candidates += [reach * v for v in top]
            reach *= top[0]
        assert len(kept) == len(probs) * top_k
        assert sorted(kept, reverse=True) == pytest.approx(sorted(candidates, reverse=True)[: len(kept)], rel=1e-5)
        reshaped += len(chain) < len(probs) or any(len(a) != top_k - 1 for a in alternatives)
    assert reshaped > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_prompt_lookup_drafts_first_and_the_head_where_it_finds_nothing(tiny, llm, head_file, adaptive):
    """Lookup beside the head: a sequence whose text ends in a match drafts it, the others draft
    with the head (their states tapped by every pass whichever source drafted); full depth's tokens."""
    path, hf = tiny
    base = random_prompts(hf.config.vocab_size, [10], seed=4)[0]
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17], seed=11) + [base * 3, base[3:8] * 4]
    params = [greedy(10 + 4 * i) for i in range(len(prompts))]
    spec = eecore.LLM(path, dtype="float32", device="cpu", max_num_seqs=8, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=3, adaptive=adaptive, lookup=eecore.LookupDrafts(),
        feature=eecore.FeatureDrafts(head=head_file[0], top_k=2)))
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(o.metrics["num_lookup_drafted_tokens"] for o in outs) > 0
    assert sum(o.metrics["num_feature_drafted_tokens"] for o in outs) > 0
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks


@pytest.mark.parametrize("mixed_steps", [False, True])
def test_a_prompts_pass_taps_the_states_its_first_round_drafts_from(tiny, llm, head_file, mixed_steps):
    """Requests of three tokens: the second comes from the first round, which drafts from the states
    the prompt's pass tapped (alone, or beside other sequences' decodes in a mixed step)."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 7, 4, 11], seed=5)
    params = [greedy(3 if i % 2 else 12) for i in range(len(prompts))]
    spec = _spec(path, head_file[0], max_num_seqs=4, mixed_steps=mixed_steps, max_num_batched_tokens=24)
    features, kept_before_first_token = spec.engine.strategy.features, []
    keep = features.keep
    features.keep = lambda seqs, *rest: kept_before_first_token.extend(
        s for s in seqs if not s.output_token_ids) or keep(seqs, *rest)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]
    if mixed_steps:  # a prompt that ends in a mixed step: its states kept there (its next steps may be mixed too)
        assert kept_before_first_token
        assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0
    else:
        assert all(o.metrics["num_drafted_tokens"] >= 1 for o in outs)


def test_feature_drafts_keep_the_full_models_law_when_sampling(tmp_path):
    """(t2, t3) of sampled requests, each out of a round the head drafted (from the states the
    prompt's pass, then the first round, tapped): the pair follows the full model's joint law."""
    path, hf = make_tiny_hf_model(tmp_path, num_layers=NUM_LAYERS, vocab_size=12, with_tokenizer=False)
    llm = eecore.LLM(path, dtype="float32", device="cpu")
    head = FeatureHead.initialized(llm.model, seed=3)
    head.save(str(tmp_path / "head.safetensors"), dtype=torch.float32)
    prompt, n, V = [3, 7, 1], 2000, 12
    params = [eecore.SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    outs = _spec(path, str(tmp_path / "head.safetensors"), drafts=2, max_num_seqs=64,
                 mixed_steps=False).generate([prompt] * n, params)
    assert all(o.metrics["num_drafted_tokens"] >= 1 for o in outs)
    with torch.no_grad():  # p(t2, t3 | prompt) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2)
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = hf(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1].softmax(-1)
        p3 = hf(torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])).logits[:, -1].softmax(-1)
    law = torch.einsum("a,ab,abc->bc", p1, p2, p3.view(V, V, V))
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    assert law_p_value(counts, law) > 1e-3


def test_config_errors_name_the_option(head_file):
    with pytest.raises(ValueError, match="'head'"):
        eecore.FeatureDrafts(head="")
    with pytest.raises(ValueError, match="'max_length'"):
        eecore.SelfSpeculativeConfig(num_speculations=2, feature=eecore.FeatureDrafts(head="h", max_length=3))
    with pytest.raises(ValueError, match="feature drafts beside layer drafts need"):
        eecore.SelfSpeculativeConfig(exit_layer=1, feature=eecore.FeatureDrafts(head="h"))
    with pytest.raises(ValueError, match="'top_k'"):
        eecore.FeatureDrafts(head="h", top_k=0)
    with pytest.raises(ValueError, match="'dtype'"):
        eecore.FeatureDrafts(head="h", dtype="bfloat16")
    with pytest.raises(ValueError, match="fit a token tree"):
        eecore.SelfSpeculativeConfig(num_speculations=8, feature=eecore.FeatureDrafts(head="h", top_k=8))
    # a node budget: at least top_k, only for trees, and what a round's verify width counts
    for bad in (dict(top_k=1, tree_nodes=4), dict(top_k=3, tree_nodes=2), dict(top_k=2, tree_nodes=2.5)):
        with pytest.raises(ValueError, match="'tree_nodes'"):
            eecore.FeatureDrafts(head="h", **bad)
    capped = eecore.SelfSpeculativeConfig(num_speculations=8, feature=eecore.FeatureDrafts(head="h", top_k=8,
                                                                                          tree_nodes=8))
    assert capped.verify_width == 9
    from eecore.cli.speculative_flags import from_flat

    config = from_flat(eecore.SelfSpeculativeConfig, {"draft": "feature", "feature_head": head_file[0]})
    assert config.feature.head == head_file[0] and config.layer is None and config.draft == "feature"


def test_a_missing_head_file_is_a_clear_error(tiny):
    with pytest.raises((FileNotFoundError, OSError), match="nope"):
        _spec(tiny[0], os.path.join("nope", "head.safetensors"))


def test_what_runs_is_what_was_trained(tiny, llm, head_file):
    """The engine's drafts for a prompt's first round equal the trainer's unroll from the target's
    hidden states (its Hugging Face twin's) at the prompt's last token: the taps, the head's steps
    and the LM head rows are the same in both."""
    from eecore.train.feature_head import FeatureHeadTrainer

    path, hf = tiny
    prompt = random_prompts(hf.config.vocab_size, [9], seed=2)[0]
    spec = _spec(path, head_file[0], drafts=3, head_dtype="float32")  # (int8 weights draft nearly the same)
    drafted = []
    picker = spec.engine.strategy.features.picker
    take = picker.take

    def spy(logits, rows, seqs, drafts, **kw):
        kept, ended = take(logits, rows, seqs, drafts, **kw)
        drafted.append(drafts[0].tokens[-1] if kept else None)
        return kept, ended
    picker.take = spy
    first = spec.generate([prompt], greedy(5))[0].token_ids[0]
    trainer = FeatureHeadTrainer(llm, FeatureHeadConfig(drafts=3), head=FeatureHead.load(head_file[0], llm.model))
    with torch.no_grad():
        features, _ = trainer._target(torch.tensor([prompt]))
        state, window, token, unrolled = trainer.head.start_state(features[0, -1:]), None, first, []
        for _ in range(3):
            state, logits, window = trainer.head.step(state, trainer.embed[torch.tensor([token])], trainer.head_rows,
                                                      window)
            token = int(logits.argmax(-1))
            unrolled.append(token)
    assert drafted[:3] == unrolled


def test_feature_drafts_under_tensor_parallelism(tiny, llm, head_file):
    """The head reads the tapped streams and the LM head's rows of a model split over 2 ranks."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 5], seed=11)
    expected = [o.token_ids for o in llm.generate(prompts, greedy(10))]
    with _spec(path, head_file[0], tensor_parallel_size=2) as spec:
        outs = spec.generate(prompts, greedy(10))
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0


def _on_static_passes(spec, monkeypatch):
    """`spec`'s decode steps, verify passes and head steps on static buffers, replayed as emulated
    CUDA graphs (engine_utils.emulate_graphs), with the target's states tapped inside them
    (EECORE_FEATURE_GRAPHS) and token trees verified in them (EECORE_TREE_GRAPHS; both read when a
    static pass is built)."""
    from eecore.engine.static_decode import StaticDecode, StaticVerify
    from eecore.speculative.static_passes import StaticFeatureSteps

    monkeypatch.setenv("EECORE_FEATURE_GRAPHS", "1")
    monkeypatch.setenv("EECORE_TREE_GRAPHS", "1")
    runner, strategy, rows = spec.engine.runner, spec.engine.strategy, spec.engine.config.max_num_seqs
    runner.static_decode = emulate_graphs(StaticDecode(runner, rows, capture=False))
    runner.static_verify = emulate_graphs(StaticVerify(runner, rows, capture=False, width=strategy.lookahead))
    features = strategy.features
    features.static = emulate_graphs(StaticFeatureSteps(runner, features.head, rows,
                                                        strategy.config.feature_draft_length, capture=False))
    return runner, features.static


@pytest.mark.parametrize("adaptive, trees", [(False, False), (True, False), (False, True)])
def test_feature_drafts_on_graphs_draft_what_they_draft_op_by_op(tiny, llm, head_file, adaptive, trees,
                                                                 monkeypatch):
    """EECORE_FEATURE_GRAPHS: the head's steps as graphs of a padded batch (rows that stopped
    drafting step on unread), and the verify passes (and the planner's plain steps) tapping the
    target's states inside their graphs (the decode step's tap alone: the test after the next);
    `trees`: the head's token trees of 2 beside prompt lookup's chains, so that rounds of trees and
    rounds of chains alone replay graphs of their own (EECORE_TREE_GRAPHS). Full depth's tokens, and
    at fixed lengths the drafts the op-by-op passes make (wrong taps, windows or tree masks would
    draft other tokens, which lossless verification alone would hide)."""
    path, hf = tiny
    base = random_prompts(hf.config.vocab_size, [10], seed=4)[0]
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11) + ([base * 3] if trees else [])
    params = [greedy(8 + 4 * i) for i in range(len(prompts))]
    extra = dict(top_k=2, lookup=eecore.LookupDrafts()) if trees else {}
    eager, spec = (_spec(path, head_file[0], adaptive=adaptive, head_dtype="float32", **extra) for _ in range(2))
    runner, steps = _on_static_passes(spec, monkeypatch)
    drafted = {id(eager): [], id(spec): []}  # every head step's drafts, in order
    for engine in (eager, spec):
        picker = engine.engine.strategy.features.picker

        def spy(logits, rows, seqs, drafts, take=picker.take, seen=drafted[id(engine)], **kw):
            kept, ended = take(logits, rows, seqs, drafts, **kw)
            seen.append([(drafts[b].tokens[-1], drafts[b].alternatives[-1] if trees else None) for b in kept])
            return kept, ended
        picker.take = spy
    eager.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(o.metrics["num_feature_drafted_tokens"] for o in outs) > 0
    if not adaptive:  # (the planner's lengths follow the passes' timings)
        assert drafted[id(spec)] == drafted[id(eager)]
    taps = steps.head.taps
    assert any(k[-1] == taps for k in runner.static_verify.graphs), "no verify pass tapped inside its graph"
    if trees:
        assert any("tree" in k for k in runner.static_verify.graphs), "no tree's verify pass ran as a graph"
        assert any("tree" not in k for k in runner.static_verify.graphs), "no chain's verify pass ran as a graph"
        assert sum(o.metrics["num_lookup_drafted_tokens"] for o in outs) > 0
    assert {k for _, k in steps.graphs} >= {0, 1, 2}, "the head's later steps never ran as graphs"
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks


def test_the_heads_static_steps_give_its_op_by_op_steps(tiny, llm, head_file):
    """StaticFeatureSteps over a padded batch (3 windows in a pass of 4) against FeatureDraftHead's
    own steps on the same states and tokens, step by step."""
    from eecore.speculative.feature_drafts import FeatureDraftHead
    from eecore.speculative.static_passes import StaticFeatureSteps

    head = FeatureDraftHead(FeatureHead.load(head_file[0], llm.model), llm.model, 8, eight_bits=False)
    steps = emulate_graphs(StaticFeatureSteps(llm.engine.runner, head, 8, 3, capture=False))
    g = torch.Generator().manual_seed(0)
    features = torch.randn(3, steps.features.shape[1], generator=g)
    tokens = torch.randint(0, tiny[1].config.vocab_size, (3, 3), generator=g)
    steps.features[:3].copy_(features)
    state, window = head.start(features), None
    for k in range(3):
        steps.tokens[k, :3].copy_(tokens[k])
        state, expected, window = head.step(state, tokens[k], window)
        torch.testing.assert_close(steps.run(3, k), expected, rtol=1e-5, atol=1e-5)
    assert set(steps.graphs) == {(4, 0), (4, 1), (4, 2)}


@pytest.mark.parametrize("width", [1, 3])
def test_static_passes_tap_the_streams_the_varlen_pass_taps(tiny, head_file, width, monkeypatch):
    """A decode step (width 1) and a verify pass of rows of 1-3 tokens (width 3) on static buffers,
    tapping the streams after layers 1 and 3 inside the pass: the same streams, in the varlen pass's
    row order, and the same logits."""
    from eecore.engine.inputs import Row
    from eecore.engine.static_decode import StaticDecode, StaticVerify

    monkeypatch.setenv("EECORE_FEATURE_GRAPHS", "1")
    path, hf = tiny
    llm = _spec(path, head_file[0], drafts=2, block_size=4)  # (its runner sized for verify passes of 3 tokens)
    runner, engine = llm.engine.runner, llm.engine
    static = StaticDecode(runner, 8, capture=False) if width == 1 else StaticVerify(runner, 8, capture=False, width=3)
    emulate_graphs(static)
    seqs = llm._add_all(random_prompts(hf.config.vocab_size, [3, 9, 6], seed=7), greedy(4))
    engine.step()  # the prompts' pass
    rows = []
    for b, seq in enumerate(seqs):
        start = seq.num_computed_tokens
        engine.blocks.grow(seq, start + width)
        rows.append(Row(seq, start, [seq.last_token_id] + [5 + b] * min(b, width - 1)))
    n, taps, d = sum(len(r.tokens) for r in rows), (1, 3), hf.config.hidden_size
    eager_out = torch.full((n, 2 * d), float("nan"))
    _, hidden = runner.forward(rows, (taps, eager_out))
    eager_logits = runner.logits(hidden).clone()
    for _ in range(2):  # the pass recorded, then replayed
        static_out = torch.full((n, 2 * d), float("nan"))
        logits = static.run(rows, (taps, static_out))
        logits = logits[1] if width == 1 else logits
        torch.testing.assert_close(static_out, eager_out)
        torch.testing.assert_close(logits, eager_logits)
    assert any(k[-1] == taps for k in static.graphs)


def test_plain_rounds_the_planner_keeps_quiet_tap_nothing(tiny, llm, head_file):
    """Where the planner has planned a round quiet (nobody drafts in the next either), its plain
    step neither taps the head's states nor keeps them; a head that is never right (a new one)
    soon has every round so. Full depth's tokens all the same."""
    path, hf = tiny
    fresh = os.path.join(os.path.dirname(head_file[0]), "fresh.safetensors")
    FeatureHead.initialized(llm.model, seed=3).save(fresh)
    spec = _spec(path, fresh, adaptive=True)
    features, kept = spec.engine.strategy.features, []
    keep = features.keep
    features.keep = lambda seqs, *rest: kept.append(len(seqs)) or keep(seqs, *rest)
    prompts = random_prompts(hf.config.vocab_size, [3, 9], seed=5)
    outs = spec.generate(prompts, greedy(60))
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, greedy(60))]
    rounds = max(o.metrics["num_verify_steps"] for o in outs)
    assert len(kept) < rounds - 10, f"{len(kept)} of {rounds} rounds kept the head's states"
