"""Weight-only int8 (eecore.models.int8_weights): per-row quantization, and a model whose projections
are int8 against the same model built from the dequantized weights."""
import pytest
import torch

from eecore import _C
from eecore.testing import reference
from eecore.models.int8_weights import Int8Weight, dense, project


def test_quantize_rounds_each_row_to_its_own_grid():
    w = torch.randn(33, 70) * torch.logspace(-3, 1, 33)[:, None]  # rows of very different sizes
    w[5] = 0.0
    q = Int8Weight.quantize(w)
    assert q.data.dtype == torch.int8 and q.scale.dtype == torch.float32
    assert int(q.data.abs().max()) == 127
    torch.testing.assert_close(q.scale, w.abs().amax(1) / 127)
    err = (q.dequantize(torch.float32) - w).abs()
    assert bool((err <= q.scale[:, None] / 2 + 1e-7 * w.abs()).all())
    assert bool((q.data[5] == 0).all()) and float(q.scale[5]) == 0.0
    assert q.nbytes == 33 * 70 + 33 * 4


def test_rows_and_project():
    w = torch.randn(40, 64)
    q = Int8Weight.quantize(w)
    idx = torch.tensor([3, 7, 39])
    sub = q.rows(idx)
    assert torch.equal(sub.data, q.data[idx]) and torch.equal(sub.scale, q.scale[idx])
    x = torch.randn(3, 64)
    got = project(torch.empty(3, 40), x, q)
    want = torch.empty(3, 40)
    reference.linear(want, x, q.data, weight_scale=q.scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the input rows' int16 rounding moves the product by ~1e-4 of its size, no more
    exact = x @ dense(q, torch.float32).T
    assert float((got - exact).abs().max()) < 2e-4 * float(exact.abs().max())
    torch.testing.assert_close(project(torch.empty(3, 40), x, w), x @ w.T, atol=1e-5, rtol=1e-5)


def test_quantize_refuses_what_it_cannot_round():
    with pytest.raises(ValueError, match="2-D float weight"):
        Int8Weight.quantize(torch.randn(4))
    with pytest.raises(ValueError, match="2-D float weight"):
        Int8Weight.quantize(torch.zeros(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("blocks", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _C.gguf_q8_vectorized(), reason="linear_gguf_q8 has no vector kernel in this build"))],
    ids=["per-row-int8", "q8_0-blocks"])
def test_int8_llama_keeps_dense_embeddings_and_norms(tmp_path, monkeypatch, blocks):
    """LlamaModel(weight_dtype=torch.int8): the projections and the LM head are 8-bit (per-row int8,
    or Q8_0 blocks repacked for 8-bit activations where that kernel is vectorized: eight_bit), the
    embeddings and norms stay dense, and the head computes with the rounded head (the layers are
    checked against HF in tests/test_separate_draft_layers.py)."""
    from eecore.models import int8_weights
    from eecore.models.gguf_weights import GGUFWeight
    from eecore.models.llama import LlamaModel
    from eecore.models.loader import load_model
    from model_factory import make_tiny_hf_model

    monkeypatch.setattr(int8_weights, "integer_gguf_kernel", lambda: blocks)
    path, _ = make_tiny_hf_model(tmp_path, num_layers=3, vocab_size=200, with_tokenizer=False)
    loaded = load_model(path, dtype=torch.float32)
    cpu = torch.device("cpu")
    model = LlamaModel(loaded.config, loaded.state_dict, torch.float32, cpu, weight_dtype=torch.int8)
    w = model.layers[0]
    kind = GGUFWeight if blocks else Int8Weight
    assert all(isinstance(t, kind) for t in (w.qkv, w.o_proj, w.gate_up, w.down, model.lm_head))
    assert model.embed.dtype == w.input_norm.dtype == torch.float32
    head = loaded.state_dict.get("lm_head.weight", loaded.state_dict["model.embed_tokens.weight"])
    x = torch.randn(5, loaded.config.hidden_size)
    got = model.lm_head_logits(x, torch.empty(5, loaded.config.vocab_size))
    want = torch.empty_like(got)
    if blocks:
        assert model.lm_head.quant_type == 8 and model.lm_head.packed is not None
        reference.linear_gguf_q8(want, x, GGUFWeight.quantize(head, "Q8_0").data, 8)
    else:
        rounded = Int8Weight.quantize(head)
        reference.linear(want, x, rounded.data, weight_scale=rounded.scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="'weight_dtype' must be None, the model's dtype or torch.int8"):
        LlamaModel(loaded.config, loaded.state_dict, torch.float32, cpu, weight_dtype=torch.float16)


def test_the_eight_bit_form_can_be_fixed_by_the_environment(monkeypatch):
    """EECORE_EIGHT_BIT=q8_0|int8 fixes eight_bit's form where both exist (the measured choice
    otherwise); any other value is refused by name."""
    from eecore import _C
    from eecore.models import int8_weights
    from eecore.models.amx_weights import amx_available

    both = bool(_C.gguf_q8_vectorized()) and not amx_available(torch.int8)
    monkeypatch.setenv("EECORE_EIGHT_BIT", "q8_0")
    assert int8_weights.integer_gguf_kernel() == both
    monkeypatch.setenv("EECORE_EIGHT_BIT", "int8")
    assert int8_weights.integer_gguf_kernel() is False
    monkeypatch.setenv("EECORE_EIGHT_BIT", "bf16")
    if both:
        with pytest.raises(ValueError, match="EECORE_EIGHT_BIT must be one of q8_0, int8"):
            int8_weights.integer_gguf_kernel()


def test_the_measured_eight_bit_form_is_a_cached_decision():
    from eecore.models import int8_weights

    int8_weights._q8_blocks_read_faster.cache_clear()
    first = int8_weights._q8_blocks_read_faster()
    assert isinstance(first, bool) and int8_weights._q8_blocks_read_faster() is first
    assert int8_weights._q8_blocks_read_faster.cache_info().hits == 1


@pytest.mark.parametrize("text, size", [("32768K\n", 32 << 20), ("1M", 1 << 20), ("512", 512), ("2G", 2 << 30)])
def test_cache_sizes_are_read_as_sysfs_writes_them(text, size):
    from eecore.models.int8_weights import cache_size_bytes

    assert cache_size_bytes(text) == size
    with pytest.raises(ValueError, match="cache_size_bytes"):
        cache_size_bytes("big")
