"""linear with bf16 weights tiled for AMX-BF16 (csrc/linear/linear_amx_bf16.h) against
eecore.testing.reference, the bits of a row whatever the batch, the tiling helpers, and the argument checks
of both tiled forms (int8: tests/test_op_linear_amx_int8.py)."""
import pytest
import torch

from eecore import _C, ops

from eecore.testing import reference
from eecore.models.amx_weights import amx_available, can_tile, tile, untile
from op_utils import poison, tol

needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX-BF16 on this CPU (or build, or OS)")
BF16 = torch.bfloat16


def _case(rows, k, n, bias, row_stride=None):
    inp = torch.randn(rows, row_stride or k, dtype=BF16)[:, :k]
    weight = (torch.randn(n, k) / k ** 0.5).to(BF16)
    b = torch.randn(n, dtype=BF16) if bias else None
    return inp, weight, b


def test_tile_and_untile_are_inverse():
    w = torch.randn(48, 96).to(BF16)
    t = tile(w)
    assert t.shape == (3, 3, 16, 32) and t.is_contiguous()
    assert torch.equal(t[1, 2], w[16:32, 64:96])  # tile [b, s]: output rows 16b.., features 32s..
    assert torch.equal(untile(t), w) and untile(w) is w


@pytest.mark.parametrize("weight, why", [
    (torch.randn(48, 96), "float32"), (torch.randn(40, 96).to(BF16), "N % 16"),
    (torch.randn(48, 80).to(BF16), "K % 32"), (torch.randn(48, 96, 1).to(BF16), "2-D"),
    (torch.zeros(48, 96, dtype=torch.int8), "int8: K % 64"),
])
def test_tile_refuses_what_has_no_tiles(weight, why):
    assert not can_tile(weight), why
    with pytest.raises(ValueError, match="expected a bf16 or int8 CPU weight"):
        tile(weight)


@needs_amx
# 1-16 rows: one chunk of input rows; 17-48: several, and a short last one; 100: prompt sizes
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 33, 48, 100])
# 64 x 16: one block; 960 x 576: 60 blocks (groups of 4 per thread); 80 x 1536: a group of 1 left over
@pytest.mark.parametrize("k, n", [(64, 16), (576, 960), (1536, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_linear_matches_reference(rows, k, n, bias):
    inp, weight, b = _case(rows, k, n, bias, row_stride=k + 3)
    out = poison(torch.empty(rows, n, dtype=BF16))
    expected = torch.empty_like(out)
    ops.linear(out, inp, tile(weight), b)
    reference.linear(expected, inp, weight, b)
    torch.testing.assert_close(out, expected, **tol(BF16, scale=4))


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_tiled_linear_accumulates_into_out(rows):
    inp, weight, b = _case(rows, 96, 48, True)
    out = torch.randn(rows, 48, dtype=BF16)
    expected = out.clone()
    ops.linear(out, inp, tile(weight), b, accumulate=True)
    reference.linear(expected, inp, weight, b, accumulate=True)
    torch.testing.assert_close(out, expected, **tol(BF16, scale=4))


@needs_amx
def test_tiled_a_rows_bits_do_not_depend_on_the_other_rows():
    """Each input row's outputs are accumulated from its own row alone, 32 features at a time, so
    a verify pass of m rows gives each row the bits of a one-row step, up to 48 rows and beyond."""
    inp, weight, b = _case(50, 576, 960, True)
    tiled = tile(weight)
    alone = torch.empty(50, 960, dtype=BF16)
    for i in range(50):
        ops.linear(alone[i:i + 1], inp[i:i + 1], tiled, b)
    for rows in (2, 7, 16, 17, 31, 48, 50):
        out = torch.empty(rows, 960, dtype=BF16)
        ops.linear(out, inp[:rows], tiled, b)
        assert torch.equal(out, alone[:rows]), rows


@needs_amx
def test_tiled_linear_opcheck():
    for rows in (2, 20):
        inp, weight, b = _case(rows, 64, 32, True)
        tiled = tile(weight)
        torch.library.opcheck(torch.ops.eecore.linear.default, (torch.empty(rows, 32, dtype=BF16), inp, tiled, b, False))
        torch.library.opcheck(torch.ops.eecore.linear.default, (torch.randn(rows, 32, dtype=BF16), inp, tiled, None, True))


@needs_amx
def test_tiled_linear_writes_only_its_rows_of_a_strided_out():
    inp, weight, _ = _case(4, 32, 16, False)
    buf = poison(torch.empty(4, 40, dtype=BF16))
    ops.linear(buf[:, :16], inp, tile(weight))
    assert torch.isnan(buf[:, 16:]).all()
    expected = torch.empty(4, 16, dtype=BF16)
    reference.linear(expected, inp, weight)
    torch.testing.assert_close(buf[:, :16], expected, **tol(BF16, scale=4))


@pytest.mark.parametrize("make, message", [
    (lambda: (torch.empty(2, 16), torch.randn(2, 32), torch.randn(1, 1, 16, 32)), "'weight'.*bf16 .* against bf16"),
    (lambda: (torch.empty(2, 16, dtype=BF16), torch.randn(2, 32, dtype=BF16), torch.randn(1, 1, 8, 32, dtype=BF16)),
     "'weight'.*16 output rows per tile"),
    (lambda: (torch.empty(2, 16, dtype=BF16), torch.randn(2, 32, dtype=BF16), torch.randn(1, 1, 16, 16, dtype=BF16)),
     "'weight'.*32 input features per tile"),
    (lambda: (torch.empty(2, 16, dtype=BF16), torch.randn(2, 64, dtype=BF16), torch.randn(1, 1, 16, 32, dtype=BF16)),
     "'weight'.*K/32 = 1 does not match the input features K = 64"),
    (lambda: (torch.empty(2, 16, dtype=torch.float16), torch.randn(2, 64, dtype=torch.float16),
              torch.zeros(1, 1, 16, 64, dtype=torch.int8), torch.ones(16)), "'input'.*float32 or bfloat16"),
    (lambda: (torch.empty(2, 16), torch.randn(2, 64), torch.zeros(1, 1, 16, 32, dtype=torch.int8), torch.ones(16)),
     "'weight'.*64 input features per tile"),
    (lambda: (torch.empty(2, 16), torch.randn(2, 64), torch.zeros(1, 1, 16, 64, dtype=torch.int8), torch.ones(8)),
     "'weight_scale'.*output features"),
    (lambda: (torch.empty(2, 16), torch.randn(2, 64), torch.zeros(1, 1, 16, 64, dtype=torch.int8)),
     "'weight_scale'.*required"),
    (lambda: (torch.empty(2, 32, dtype=BF16), torch.randn(2, 32, dtype=BF16), torch.randn(1, 1, 16, 32, dtype=BF16)),
     "'out'.*output features"),
])
def test_tiled_linear_bad_arguments(make, message):
    out, inp, weight, *scale = make()
    with pytest.raises(RuntimeError, match=message):
        ops.linear(out, inp, weight, None, False, *scale)


def test_tiled_weight_without_amx_is_refused(monkeypatch):
    if _C.amx_bf16_available():  # the op's own check (EECORE_AMX=0 only stops models from tiling)
        pytest.skip("this machine runs tiled weights (the refusal is for CPUs without AMX-BF16)")
    with pytest.raises(RuntimeError, match="'weight'.*tiled for AMX-BF16"):
        ops.linear(torch.empty(2, 16, dtype=BF16), torch.randn(2, 32, dtype=BF16), torch.randn(1, 1, 16, 32, dtype=BF16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_tiled_weight_is_refused_on_cuda():
    with pytest.raises(RuntimeError, match="'weight'.*a CPU format"):
        ops.linear(torch.empty(2, 16, dtype=BF16, device="cuda"), torch.randn(2, 32, dtype=BF16, device="cuda"),
                   torch.randn(1, 1, 16, 32, dtype=BF16, device="cuda"))


def test_env_var_turns_tiling_off(monkeypatch):
    monkeypatch.setenv("EECORE_AMX", "0")
    assert not amx_available() and not amx_available(torch.int8)


@needs_amx
def test_bf16_llama_runs_its_projections_in_tiles(tmp_path, monkeypatch):
    """A bf16 model tiles every projection and a copy of its LM head; its logits match the same model
    with [N, K] weights (EECORE_AMX=0) to bf16 rounding (against HF: tests/test_engine_models.py)."""
    from eecore.models.llama import LlamaModel
    from eecore.models.loader import load_model
    from model_factory import make_tiny_hf_model

    path, _ = make_tiny_hf_model(tmp_path, num_layers=2, hidden_size=64, intermediate_size=96, vocab_size=320,
                                 tie=True, with_tokenizer=False)
    loaded = load_model(path, dtype=BF16)
    tiled = LlamaModel(loaded.config, loaded.state_dict, BF16, torch.device("cpu"))
    monkeypatch.setenv("EECORE_AMX", "0")
    plain = LlamaModel(loaded.config, loaded.state_dict, BF16, torch.device("cpu"))
    for w, p in zip(tiled.layers, plain.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            assert getattr(w, name).dim() == 4 and torch.equal(untile(getattr(w, name)), getattr(p, name))
    assert tiled.lm_head is tiled.embed and torch.equal(untile(tiled.lm_head_proj), plain.lm_head)
    assert plain.lm_head_proj is plain.lm_head
    x = torch.randn(5, 64, dtype=BF16)
    torch.testing.assert_close(tiled.lm_head_logits(x, torch.empty(5, 320, dtype=BF16)),
                               plain.lm_head_logits(x, torch.empty(5, 320, dtype=BF16)), **tol(BF16, scale=4))


@needs_amx
def test_bf16_t5_runs_its_decoder_projections_in_tiles(tmp_path, monkeypatch):
    """T5's decoder tiles what its shapes allow (wo [32, 48] cannot: K % 32), its LM head gets a
    tiled copy, and kv_fill's stacked K/V weights are the same from tiles (outputs against HF in
    fp32: tests/test_t5_model.py)."""
    import eecore
    from t5_factory import make_tiny_t5

    path, _ = make_tiny_t5(tmp_path, "v1.1")
    def model():
        return eecore.LLM(path, dtype="bfloat16", device="cpu", num_blocks=16, block_size=4).model
    tiled = model()
    monkeypatch.setenv("EECORE_AMX", "0")
    plain = model()
    for w, p in zip(tiled.layers, plain.layers, strict=True):
        for name in ("qkv", "self_o", "cross_q", "cross_o", "wi"):
            assert getattr(w, name).dim() == 4 and torch.equal(untile(getattr(w, name)), getattr(p, name))
        assert w.wo.dim() == 2 and torch.equal(w.wo, p.wo)
    assert torch.equal(untile(tiled.lm_head_proj), plain.lm_head) and plain.lm_head_proj is plain.lm_head
    assert torch.equal(tiled.kv_fill_weights()[0], plain.kv_fill_weights()[0])
    x = torch.randn(3, tiled.config.hidden_size, dtype=BF16)
    vocab = tiled.config.vocab_size
    torch.testing.assert_close(tiled.lm_head_logits(x, torch.empty(3, vocab, dtype=BF16)),
                               plain.lm_head_logits(x, torch.empty(3, vocab, dtype=BF16)), **tol(BF16, scale=4))
