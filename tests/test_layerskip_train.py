"""The LayerSkip training recipe (eecore.train.layerskip): schedules against numbers worked out by
hand from the paper's equations, the loss against Hugging Face's own forward, layer dropout against
per-sample runs of the model without the dropped layers, gradients, training, reproducibility."""
from __future__ import annotations

import math

import pytest
import torch

from eecore.train.early_exit_loss import (causal_lm_cross_entropy, exit_curriculum, exit_loss_scales,
                                          normalised_exit_scales)
from eecore.train.layer_dropout import drop_layer, dropout_rates, layer_scale, sample_kept_rows, time_scale
from eecore.train.layerskip import (LayerSkipConfig, forward_with_layer_dropout, layerskip_loss, main,
                                    train_step)

transformers = pytest.importorskip("transformers")

VOCAB = 101


def tiny_model(arch: str = "llama", num_layers: int = 4, seed: int = 0, **overrides):
    """A random fp32 causal LM; norm gains randomized so a missing or doubled final norm shows."""
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None,
                  attn_implementation="sdpa")
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=g))
    return model


def batch(b: int = 5, s: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100  # ignored tokens must be skipped the way HF skips them
    labels[2, -4:] = -100
    return ids, labels


# ---- schedules: layer dropout, equations (2)-(4) ----------------------------------------------


def test_layer_scale_matches_equation_3():
    # L = 4: D(l) = 2^(l/3) - 1
    expected = [0.0, 0.2599210498948732, 0.5874010519681994, 1.0]
    assert [layer_scale(l, 4) for l in range(4)] == pytest.approx(expected, abs=1e-12)
    assert layer_scale(0, 1) == 0.0  # a 1-layer model: the ramp's start
    with pytest.raises(ValueError, match="layer"):
        layer_scale(4, 4)


def test_time_scale_constant_and_exp_equation_4():
    assert [time_scale(t, 5, "constant") for t in range(5)] == [1.0] * 5
    # T = 5: S_exp(t) = 2^(t/4) - 1
    expected = [0.0, 0.18920711500272103, 0.41421356237309515, 0.6817928305074290, 1.0]
    assert [time_scale(t, 5, "exp") for t in range(5)] == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="step"):
        time_scale(5, 5, "exp")
    with pytest.raises(ValueError, match="curriculum"):
        time_scale(0, 5, "linear")


def test_dropout_rates_equation_2():
    # p_{l,t} = S(t) D(l) p_max, L = 4, T = 5, t = 2, exp curriculum, p_max = 0.2
    s = 2 ** 0.5 - 1
    expected = [0.0, s * (2 ** (1 / 3) - 1) * 0.2, s * (2 ** (2 / 3) - 1) * 0.2, s * 0.2]
    assert dropout_rates(2, 5, 4, 0.2, "exp") == pytest.approx(expected, abs=1e-12)
    assert dropout_rates(0, 5, 4, 0.2, "constant")[-1] == pytest.approx(0.2)  # p_max is the last layer's rate
    assert dropout_rates(0, 5, 4, 0.2, "exp") == [0.0] * 4  # S_exp(0) = 0: no dropout at the start
    with pytest.raises(ValueError, match="p_max"):
        dropout_rates(0, 5, 4, 1.5)


# ---- schedules: early-exit loss, equation (6) and the curricula --------------------------------


def test_exit_loss_scales_by_hand():
    # L = 4, e_scale = 0.5: e(0) = 0, e(1) = 0.5 * 1, e(2) = 0.5 * (1 + 2), e(3) = 3 + 0.5 * (0 + 1 + 2)
    assert exit_loss_scales(4, 0.5) == pytest.approx([0.0, 0.5, 1.5, 4.5])
    assert exit_loss_scales(4, 0.0) == pytest.approx([0.0, 0.0, 0.0, 3.0])
    with pytest.raises(ValueError, match="e_scale"):
        exit_loss_scales(4, 1.5)


def test_normalised_scales_sum_to_one():
    assert normalised_exit_scales(0, 10, 4, 0.5, "none") == pytest.approx([0.0, 0.5 / 6.5, 1.5 / 6.5, 4.5 / 6.5])
    for curriculum in ("none", "rotational", "gradual"):
        for L in (1, 2, 5, 24):
            for e_scale in (0.0, 0.1, 1.0):
                for t in range(0, 40, 3):
                    w = normalised_exit_scales(t, 40, L, e_scale, curriculum, rotation=3)
                    assert len(w) == L and min(w) >= 0.0
                    assert math.fsum(w) == pytest.approx(1.0, abs=1e-12)
                    assert w[-1] > 0.0  # the last layer's ordinary loss is always in


def test_rotational_curriculum_rotates_and_visits_each_layer_once_per_R():
    L, R = 6, 2
    assert exit_curriculum(0, 100, L, "rotational", R) == [True, False, True, False, True, True]
    assert exit_curriculum(1, 100, L, "rotational", R) == [False, True, False, True, False, True]
    assert exit_curriculum(2, 100, L, "rotational", R) == exit_curriculum(0, 100, L, "rotational", R)
    # the paper's Llama2 1.5B setting (L = 24, R = 23) and a non-dividing R: every early layer is on
    # exactly once in any R consecutive iterations, and ceil(L/R) exits run per iteration at most
    for L, R in ((24, 23), (32, 8), (7, 3), (5, 1)):
        masks = [exit_curriculum(t, 200, L, "rotational", R) for t in range(60)]
        for start in range(60 - R + 1):
            for layer in range(L - 1):
                assert sum(masks[t][layer] for t in range(start, start + R)) == 1, (L, R, start, layer)
        assert all(m[-1] for m in masks)
        assert max(sum(m) for m in masks) <= math.ceil(L / R) + 1  # + the always-on last layer
        assert max(sum(m[:-1]) for m in masks) <= math.ceil((L - 1) / R)
        # one step moves the enabled set up by one layer (circularly within the R-periodic pattern)
        for t in range(59):
            assert [masks[t + 1][(l + 1)] for l in range(L - 2)] == [masks[t][l] for l in range(L - 2)]


def test_gradual_curriculum_enables_from_the_top_every_T_over_2L():
    L, T = 4, 80  # T / 2L = 10 iterations per layer
    on_from = {}
    for t in range(T):
        mask = exit_curriculum(t, T, L, "gradual")
        for layer, on in enumerate(mask):
            if on:
                on_from.setdefault(layer, t)
            else:
                assert layer not in on_from, "a layer turned off again"
    assert on_from == {3: 0, 2: 10, 1: 20, 0: 30}
    # T not divisible by 2L: layer L-1-k switches on at the first t with t >= k T / 2L
    L, T = 3, 20  # T / 2L = 10/3
    firsts = [next(t for t in range(T) if exit_curriculum(t, T, L, "gradual")[layer]) for layer in range(L)]
    assert firsts == [7, 4, 0]


def test_exit_curriculum_rejects_bad_arguments():
    with pytest.raises(ValueError, match="curriculum"):
        exit_curriculum(0, 10, 4, "random")
    with pytest.raises(ValueError, match="rotation"):
        exit_curriculum(0, 10, 4, "rotational", 0)
    with pytest.raises(ValueError, match="step"):
        exit_curriculum(10, 10, 4, "none")
    for bad in (dict(p_max=-0.1), dict(e_scale=2.0), dict(dropout_curriculum="lin"),
                dict(exit_curriculum="x"), dict(rotation=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LayerSkipConfig(**bad)


# ---- layer dropout, equation (1) ----------------------------------------------------------------


def test_sample_kept_rows_rate_and_edges():
    g = torch.Generator().manual_seed(0)
    assert sample_kept_rows(7, 0.0, g).all()
    assert not sample_kept_rows(7, 1.0, g).any()
    kept = sample_kept_rows(20000, 0.3, g)
    assert kept.dtype == torch.bool and abs(kept.float().mean().item() - 0.7) < 0.02


def test_drop_layer_runs_only_kept_rows_and_passes_dropped_rows_through():
    x = torch.randn(5, 3, 4)
    kept = torch.tensor([True, False, True, False, False])
    seen = []

    def layer(h, rows):
        seen.append((h.shape[0], rows))
        return h * 3.0 + 1.0

    out = drop_layer(layer, x, kept)
    assert seen[0][0] == 2 and seen[0][1].tolist() == [0, 2]
    assert torch.equal(out[kept], x[kept] * 3.0 + 1.0)
    assert torch.equal(out[~kept], x[~kept])  # p = 1 samples: the layer's output is its input
    seen.clear()
    assert drop_layer(layer, x, torch.zeros(5, dtype=torch.bool)) is x and not seen
    torch.testing.assert_close(drop_layer(layer, x, torch.ones(5, dtype=torch.bool)), x * 3.0 + 1.0)
    assert seen[0][1] is None
    with pytest.raises(ValueError, match="kept"):
        drop_layer(layer, x, torch.ones(4, dtype=torch.bool))


def test_drop_layer_gradient():
    x = torch.randn(4, 3, requires_grad=True)
    kept = torch.tensor([True, False, False, True])
    drop_layer(lambda h, rows: h * 5.0, x, kept).sum().backward()
    assert x.grad[:, 0].tolist() == [5.0, 1.0, 1.0, 5.0]


@pytest.mark.parametrize("padding", [False, True])
def test_layer_dropout_equals_per_sample_model_without_the_dropped_layers(padding):
    """Each sample's result equals HF run on that sample alone with its dropped layers removed:
    cutting the batch changes nothing about a kept sample's masking, padding or positions."""
    model = tiny_model("llama", num_layers=4)
    ids, _ = batch(b=6, s=10, seed=3)
    attention_mask = None
    if padding:
        attention_mask = torch.ones_like(ids)
        attention_mask[1, 7:] = 0
        attention_mask[4, 3:] = 0
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hidden, kept = forward_with_layer_dropout(model, ids, [0.5] * 4, g, attention_mask)
    kept = torch.stack(kept)  # [L, B]
    assert 0 < int(kept.sum()) < kept.numel(), "the seed should give a mix of kept and dropped samples"
    all_layers = model.model.layers
    try:
        for b in range(ids.shape[0]):
            model.model.layers = torch.nn.ModuleList([all_layers[l] for l in range(4) if kept[l, b]])
            mask_b = None if attention_mask is None else attention_mask[b:b + 1]
            with torch.no_grad():
                ref = model.model(ids[b:b + 1], attention_mask=mask_b).last_hidden_state[0]
            valid = slice(None) if mask_b is None else mask_b[0].bool()
            torch.testing.assert_close(model.model.norm(hidden[-1][b])[valid], ref[valid], rtol=1e-5, atol=1e-5)
    finally:
        model.model.layers = all_layers


def test_fully_dropped_layer_is_the_identity_and_never_runs():
    # L = 2, p_max = 1: D = [0, 1], so layer 0 always runs and layer 1 never does
    model = tiny_model("llama", num_layers=2)
    ids, labels = batch()
    calls = []
    handle = model.model.layers[1].register_forward_hook(lambda *a: calls.append(1))
    try:
        out = layerskip_loss(model, ids, labels, 0, 10, LayerSkipConfig(p_max=1.0, e_scale=0.0),
                             torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert not calls and out.rows_run == [ids.shape[0], 0]
    with torch.no_grad():
        x1 = model(ids, output_hidden_states=True).hidden_states[1]  # layer 0's output, un-normed
        expected = causal_lm_cross_entropy(model.lm_head(model.model.norm(x1)), labels)
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-6)


# ---- the loss against Hugging Face --------------------------------------------------------------


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {"sliding_window": 4}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
    ("qwen3", {"head_dim": 16}),
])
@pytest.mark.parametrize("padding", [False, True])
def test_last_layer_only_loss_is_the_hf_causal_lm_loss(arch, overrides, padding):
    model = tiny_model(arch, num_layers=4, **overrides)
    ids, labels = batch()
    attention_mask = None
    if padding:
        attention_mask = torch.ones_like(ids)
        attention_mask[1, 8:] = 0
        labels = labels.masked_fill(attention_mask == 0, -100)
    config = LayerSkipConfig(p_max=0.0, e_scale=0.0, exit_curriculum="none")
    with torch.no_grad():
        out = layerskip_loss(model, ids, labels, 3, 10, config, attention_mask=attention_mask)
        hf = model(ids, attention_mask=attention_mask, labels=labels).loss
    assert list(out.layer_losses) == [3] and out.exit_weights == [0.0, 0.0, 0.0, 1.0]
    assert out.rows_run == [ids.shape[0]] * 4
    assert abs(out.loss.item() - hf.item()) < 1e-5


def brute_force_layerskip_loss(model, ids, labels, e_scale):
    """Equation (5) with every exit on, from HF's own hidden states, weights written out by hand."""
    L = model.config.num_hidden_layers
    hs = model(ids, output_hidden_states=True).hidden_states  # x_0 .. x_{L-1}, then norm(x_L)
    e = [e_scale * sum(range(l + 1)) for l in range(L - 1)] + [L - 1 + e_scale * sum(range(L - 1))]
    total = sum(e)
    losses = [causal_lm_cross_entropy(model.lm_head(model.model.norm(hs[l + 1])), labels) for l in range(L - 1)]
    losses.append(causal_lm_cross_entropy(model.lm_head(hs[L]), labels))
    return sum(w / total * loss for w, loss in zip(e, losses)), losses


def test_all_exits_loss_and_gradients_equal_brute_force():
    model = tiny_model("qwen2", num_layers=4)
    ids, labels = batch()
    config = LayerSkipConfig(p_max=0.0, e_scale=0.7, exit_curriculum="none")
    out = layerskip_loss(model, ids, labels, 0, 10, config)
    ours = torch.autograd.grad(out.loss, list(model.parameters()))
    ref_loss, ref_losses = brute_force_layerskip_loss(model, ids, labels, 0.7)
    ref = torch.autograd.grad(ref_loss, list(model.parameters()))
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert sorted(out.layer_losses) == [1, 2, 3]  # e(0) = 0: layer 0's exit is never unembedded
    for layer, loss in out.layer_losses.items():
        torch.testing.assert_close(loss, ref_losses[layer], rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_early_exit_loss_trains_early_layers_through_the_shared_head():
    model = tiny_model("llama", num_layers=4)
    ids, labels = batch()
    out = layerskip_loss(model, ids, labels, 0, 10, LayerSkipConfig(p_max=0.0, e_scale=1.0, exit_curriculum="none"))
    layers = model.model.layers
    head = [model.model.norm.weight, model.lm_head.weight]
    params = [p for l in range(4) for p in layers[l].parameters()]
    grads = torch.autograd.grad(out.layer_losses[1], params + head, allow_unused=True)
    per_layer = [grads[i * len(params) // 4:(i + 1) * len(params) // 4] for i in range(4)]
    nonzero = lambda gs: any(g is not None and g.abs().sum() > 0 for g in gs)  # noqa: E731
    # layer 1's exit loss reaches layers 0 and 1 and the head, and nothing above layer 1
    assert nonzero(per_layer[0]) and nonzero(per_layer[1])
    assert not nonzero(per_layer[2]) and not nonzero(per_layer[3])
    assert nonzero(grads[-2:])


def test_curriculum_controls_which_exits_are_unembedded():
    model = tiny_model("llama", num_layers=4)
    ids, labels = batch()
    with torch.no_grad():
        rot = [layerskip_loss(model, ids, labels, t, 10, LayerSkipConfig(p_max=0.0, e_scale=1.0, rotation=2))
               for t in range(2)]
        grad0 = layerskip_loss(model, ids, labels, 0, 80, LayerSkipConfig(p_max=0.0, e_scale=1.0,
                                                                          exit_curriculum="gradual"))
        grad_late = layerskip_loss(model, ids, labels, 79, 80, LayerSkipConfig(p_max=0.0, e_scale=1.0,
                                                                               exit_curriculum="gradual"))
    assert sorted(rot[0].layer_losses) == [2, 3] and sorted(rot[1].layer_losses) == [1, 3]  # e(0) = 0
    assert sorted(grad0.layer_losses) == [3] and sorted(grad_late.layer_losses) == [1, 2, 3]
    # the same exit gives the same loss whichever curriculum switched it on
    torch.testing.assert_close(rot[0].layer_losses[3], grad0.layer_losses[3])
    torch.testing.assert_close(rot[1].layer_losses[1], grad_late.layer_losses[1])


# ---- training -------------------------------------------------------------------------------------


def eval_losses(model, ids, labels):
    with torch.no_grad():
        out = layerskip_loss(model, ids, labels, 0, 1, LayerSkipConfig(p_max=0.0, e_scale=1.0, exit_curriculum="none"))
    return {l: v.item() for l, v in out.layer_losses.items()}


def test_a_few_steps_reduce_the_loss():
    model = tiny_model("llama", num_layers=4).train()
    ids, labels = batch(b=4, s=16, seed=7)
    before = eval_losses(model, ids, labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = LayerSkipConfig(p_max=0.2, e_scale=0.5, exit_curriculum="rotational", rotation=2)
    g = torch.Generator().manual_seed(0)
    steps = 25
    losses = [train_step(model, optimizer, ids, labels, t, steps, config, g, max_grad_norm=1.0).loss.item()
              for t in range(steps)]
    after = eval_losses(model, ids, labels)
    assert losses[-1] < 0.7 * losses[0]
    for layer in before:  # the last layer and the early exits all improved
        assert after[layer] < 0.8 * before[layer], (layer, before, after)


def test_seeded_generator_reproduces_the_step():
    config = LayerSkipConfig(p_max=0.8, e_scale=0.5, exit_curriculum="none")
    ids, labels = batch(b=12)

    def run(seed):
        model = tiny_model("llama", num_layers=4)
        out = layerskip_loss(model, ids, labels, 0, 10, config, torch.Generator().manual_seed(seed))
        out.loss.backward()
        return out, [p.grad.clone() for p in model.parameters()]

    (a, grads_a), (b, grads_b), (c, _) = run(5), run(5), run(6)
    assert a.rows_run == b.rows_run and torch.equal(a.loss, b.loss)
    assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))
    assert a.rows_run != c.rows_run  # another seed drops other samples
    assert a.rows_run[0] == 12 and a.rows_run[-1] < 12  # D(0) = 0: the first layer is never dropped


def test_exp_dropout_curriculum_starts_without_dropout():
    model = tiny_model("llama", num_layers=3)
    ids, labels = batch(b=8)
    g = torch.Generator().manual_seed(0)
    config = LayerSkipConfig(p_max=1.0, dropout_curriculum="exp")
    with torch.no_grad():
        first = layerskip_loss(model, ids, labels, 0, 10, config, g)
        last = layerskip_loss(model, ids, labels, 9, 10, config, g)
    assert first.rows_run == [8, 8, 8] and first.dropout_rates == [0.0, 0.0, 0.0]
    assert last.rows_run[-1] == 0 and last.dropout_rates[-1] == pytest.approx(1.0)


def test_unsupported_model_is_rejected():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids, labels = batch()
    with pytest.raises(TypeError, match="model"):
        layerskip_loss(model, ids, labels, 0, 10, LayerSkipConfig())


def test_cli_trains_and_saves(tmp_path, capsys):
    from model_factory import make_tiny_hf_model

    path, hf_model = make_tiny_hf_model(tmp_path, "llama", num_layers=3)
    data = tmp_path / "corpus.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out_dir = tmp_path / "trained"
    main(["--model", path, "--data", str(data), "--out", str(out_dir), "--steps", "3", "--seq-len", "16",
          "--batch-size", "2", "--lr", "1e-3", "--p-max", "0.5", "--e-scale", "1.0", "--rotation", "2",
          "--device", "cpu", "--log-every", "1"])
    log = capsys.readouterr().out
    assert log.count("step ") == 3 and "layer losses" in log
    trained = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    before, after = hf_model.model.layers[0].mlp.up_proj.weight, trained.model.layers[0].mlp.up_proj.weight
    assert not torch.allclose(before, after)
    assert (out_dir / "tokenizer.json").exists()
