"""linear with weight-only int8 weights tiled for AMX-INT8 (csrc/linear/linear_amx_int8.h): the
exact integers of the op's definition (eecore/int8_linear.h), the bits of the split-GEMM path, the
bits of a row whatever the batch, the tiled Int8Weight, and an int8 draft copy running on tiles."""
import pytest
import torch

from eecore import _C, ops

from eecore.testing import reference
from eecore.models.amx_weights import amx_available, tile, tiled, untile
from eecore.models.int8_weights import Int8Weight
from op_utils import poison, tol

needs_amx_int8 = pytest.mark.skipif(not amx_available(torch.int8), reason="no AMX-INT8 on this CPU (or build, or OS)")
BF16 = torch.bfloat16


def _case(rows, k, n, dtype, row_stride=None):
    inp = (torch.randn(rows, row_stride or k) * 3).to(dtype)[:, :k]
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) / 64
    return inp, weight, scale


def _exact(inp, weight, scale):
    """The op's definition in exact integers: each row rounded to int16, sum_k q w in float64 (exact
    at these sizes), rounded to fp32 once, times both scales (no bias: one more rounding the C++
    compiler may fuse)."""
    q, row_scale = reference.round_rows_to_int16(inp)
    return (q.double() @ weight.double().T).float() * row_scale[:, None] * scale[None, :]


def test_int8_tile_and_untile_are_inverse():
    w = torch.randint(-127, 128, (32, 128), dtype=torch.int8)
    t = tile(w)
    assert t.shape == (2, 2, 16, 64) and t.is_contiguous()
    assert torch.equal(t[1, 1], w[16:32, 64:128])  # tile [b, s]: output rows 16b.., features 64s..
    assert torch.equal(untile(t), w)


def test_tiled_int8_weight_keeps_its_meaning():
    w = Int8Weight.quantize(torch.randn(48, 128))
    t = Int8Weight(tile(w.data), w.scale)
    assert t.shape == w.shape == (48, 128) and t.nbytes == w.nbytes
    assert torch.equal(t.dequantize(torch.float32), w.dequantize(torch.float32))
    rows = torch.tensor([5, 40, 17])
    assert torch.equal(t.rows(rows).data, w.rows(rows).data) and torch.equal(t.rows(rows).scale, w.rows(rows).scale)


@needs_amx_int8
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
# 1-16 rows: one chunk of input rows; 17-48: several, and a short last one; 100: prompt sizes
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 33, 100])
# 128 x 16: one block; 576 x 960: 60 blocks in pairs; 1536 x 80: a pair and a single block left
@pytest.mark.parametrize("k, n", [(128, 16), (576, 960), (1536, 80)])
def test_tiled_int8_linear_is_the_exact_integer_product(dtype, rows, k, n):
    inp, weight, scale = _case(rows, k, n, dtype, row_stride=k + 5)
    out = poison(torch.empty(rows, n, dtype=dtype))
    ops.linear(out, inp, tile(weight), None, False, scale)
    assert torch.equal(out, _exact(inp, weight, scale).to(dtype))


@needs_amx_int8
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_tiled_int8_linear_with_bias_and_accumulate(dtype):
    inp, weight, scale = _case(20, 576, 192, dtype)
    bias = torch.randn(192, dtype=dtype)
    out = torch.randn(20, 192, dtype=dtype)
    expected = out.clone()
    ops.linear(out, inp, tile(weight), bias, True, scale)
    reference.linear(expected, inp, weight, bias, True, scale)
    torch.testing.assert_close(out, expected, **tol(dtype, scale=4))


@needs_amx_int8
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_tiled_int8_has_the_bits_of_the_split_gemm_path(dtype):
    """Past 48 rows a [N, K] int8 weight runs as int8 GEMMs of the rows' bytes (linear_int8_split.h),
    whose int64 totals round as the tiles' do: the same bits, bias included."""
    inp, weight, scale = _case(60, 576, 960, dtype)
    bias = torch.randn(960, dtype=dtype)
    flat, tiles = torch.empty(60, 960, dtype=dtype), torch.empty(60, 960, dtype=dtype)
    ops.linear(flat, inp, weight, bias, False, scale)
    ops.linear(tiles, inp, tile(weight), bias, False, scale)
    assert torch.equal(flat, tiles)


@needs_amx_int8
def test_tiled_int8_a_rows_bits_do_not_depend_on_the_other_rows():
    inp, weight, scale = _case(40, 576, 960, BF16)
    t = tile(weight)
    alone = torch.empty(40, 960, dtype=BF16)
    for i in range(40):
        ops.linear(alone[i:i + 1], inp[i:i + 1], t, None, False, scale)
    for rows in (2, 7, 16, 17, 40):
        out = torch.empty(rows, 960, dtype=BF16)
        ops.linear(out, inp[:rows], t, None, False, scale)
        assert torch.equal(out, alone[:rows]), rows


@needs_amx_int8
def test_tiled_int8_rows_of_zeros_and_of_inf():
    inp, weight, scale = _case(3, 128, 32, torch.float32)
    inp[1] = 0
    inp[2, 5] = float("inf")
    out = torch.empty(3, 32)
    ops.linear(out, inp, tile(weight), None, False, scale)
    assert torch.equal(out[1], torch.zeros(32)) and torch.isnan(out[2]).all()
    assert torch.equal(out[0], _exact(inp[:1], weight, scale)[0])


@needs_amx_int8
def test_tiled_int8_linear_opcheck():
    inp, weight, scale = _case(5, 128, 32, BF16)
    torch.library.opcheck(torch.ops.eecore.linear.default,
                          (torch.empty(5, 32, dtype=BF16), inp, tile(weight), None, False, scale))


def test_tiled_int8_weight_without_amx_int8_is_refused():
    if _C.amx_int8_available():  # the op's own check (EECORE_AMX=0 only stops models from tiling)
        pytest.skip("this machine runs tiled int8 weights (the refusal is for CPUs without AMX-INT8)")
    with pytest.raises(RuntimeError, match="'weight'.*tiled for AMX-INT8"):
        ops.linear(torch.empty(2, 16), torch.randn(2, 64), torch.zeros(1, 1, 16, 64, dtype=torch.int8), None, False,
                   torch.ones(16))


def test_tiled_leaves_what_it_cannot_tile(monkeypatch):
    odd = Int8Weight.quantize(torch.randn(40, 128))  # N % 16
    assert tiled(odd) is odd
    monkeypatch.setenv("EECORE_AMX", "0")
    w = Int8Weight.quantize(torch.randn(48, 128))
    assert tiled(w) is w


@needs_amx_int8
def test_int8_draft_copy_runs_on_tiles_and_drafts_the_same(tmp_path, monkeypatch):
    """An int8 LlamaModel (a draft copy) tiles its layers; the same copy untiled (EECORE_AMX=0)
    gives the same layer-E states to the int8 rounding of the other kernel (the streaming kernel
    sums in fp32 lanes, the tiles in exact integers)."""
    from eecore.models.llama import LlamaModel
    from eecore.models.loader import load_model
    from model_factory import make_tiny_hf_model

    path, _ = make_tiny_hf_model(tmp_path, num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=320,
                                 tie=True, with_tokenizer=False)
    loaded = load_model(path, dtype=torch.float32)
    cpu = torch.device("cpu")
    tiles = LlamaModel(loaded.config, loaded.state_dict, torch.float32, cpu, torch.int8)
    monkeypatch.setenv("EECORE_AMX", "0")
    plain = LlamaModel(loaded.config, loaded.state_dict, torch.float32, cpu, torch.int8)
    for w, p in zip(tiles.layers, plain.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            a, b = getattr(w, name), getattr(p, name)
            assert a.data.dim() == 4 and torch.equal(untile(a.data), b.data) and torch.equal(a.scale, b.scale)
    assert tiles.lm_head_proj.data.dim() == 2  # no tiled copy of its head: its draft head takes rows of it
    x = torch.randn(6, 64)
    for name in ("qkv", "gate_up"):
        n = getattr(plain.layers[0], name).shape[0]
        a, b = torch.empty(6, n), torch.empty(6, n)
        w, p = getattr(tiles.layers[0], name), getattr(plain.layers[0], name)
        ops.linear(a, x, w.data, None, False, w.scale)
        ops.linear(b, x, p.data, None, False, p.scale)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
