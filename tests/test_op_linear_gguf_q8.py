"""linear_gguf_q8 (GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights repacked, 8-bit
activations) against its reference: the activations rounded as the kernel rounds them, times the
dequantized weight, in float64; the rounding error against the exact product bounded; bad
arguments; and a model built with EECORE_GGUF_ACTIVATIONS=q8 decoding close to the exact one."""
from __future__ import annotations

import pytest
import torch

import eecore
from eecore import ops
from eecore.testing import reference
from test_op_linear_gguf import TYPES, random_blocks

Q8_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# 37 rows = 3 groups of 16; units of one block of 32 (K formats: a superblock of 256) holding the
# file's bytes for 16 rows (the K formats' 6-bit sub-scales unpacked to a byte each).
PACKED_SHAPES = {
    "Q4_0": lambda k: (3, k // 32, 16 * 18), "Q4_1": lambda k: (3, k // 32, 16 * 20),
    "Q5_0": lambda k: (3, k // 32, 16 * 22), "Q5_1": lambda k: (3, k // 32, 16 * 24),
    "Q8_0": lambda k: (3, k // 32, 16 * 34), "Q6_K": lambda k: (3, k // 256, 16 * 210),
    "Q4_K": lambda k: (3, k // 256, 16 * 144 + 64), "Q5_K": lambda k: (3, k // 256, 16 * 176 + 64),
}


@pytest.mark.parametrize("name", Q8_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_matches_the_reference(name, rows):
    n, k = 37, 512 if name.endswith("_K") else 160  # 37 output rows: two whole groups of 16, a partial one
    weight = random_blocks(name, n, k, seed=rows)
    packed = ops.repack_gguf_q8(weight, TYPES[name], k)
    assert packed.shape == PACKED_SHAPES[name](k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = ops.linear_gguf_q8(torch.full((rows, n), float("nan")), x, packed, TYPES[name])
    expected = torch.empty(rows, n, dtype=torch.float64)
    reference.linear_gguf_q8(expected, x, weight, TYPES[name])
    scale = (x.double().abs() @ reference.dequantize_gguf(weight, TYPES[name], k).double().abs().T).max()
    assert (out.double() - expected).abs().max() <= 1e-5 * scale
    # the activations' rounding: within a percent of the exact product's scale
    exact = x.double() @ reference.dequantize_gguf(weight, TYPES[name], k).double().T
    assert (out.double() - exact).abs().max() <= 1e-2 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_accumulate_strided_rows(dtype):
    name, n, k = "Q4_1", 20, 64
    weight = random_blocks(name, n, k, seed=2)
    packed = ops.repack_gguf_q8(weight, TYPES[name], k)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, k + 32, generator=g).to(dtype)[:, :k]
    bias, start = torch.randn(n, generator=g).to(dtype), torch.randn(3, n, generator=g).to(dtype)
    out, expected = start.clone(), start.clone()
    ops.linear_gguf_q8(out, x, packed, TYPES[name], bias, accumulate=True)
    reference.linear_gguf_q8(expected, x, weight, TYPES[name], bias, accumulate=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_bad_arguments_name_the_argument():
    weight = random_blocks("Q4_0", 20, 64, seed=0)
    with pytest.raises(RuntimeError, match="'quant_type'.*2 \\(Q4_0\\), 3 \\(Q4_1\\).*14 \\(Q6_K\\).*got 10"):
        ops.repack_gguf_q8(random_blocks("Q4_K", 4, 256, seed=0), 10, 256)  # Q2_K
    packed = ops.repack_gguf_q8(weight, TYPES["Q4_0"], 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="'out'.*2 groups of 16 rows"):
        ops.linear_gguf_q8(torch.empty(2, 40), x, packed, TYPES["Q4_0"])
    with pytest.raises(RuntimeError, match="'packed'.*K / 32 blocks"):
        ops.linear_gguf_q8(torch.empty(2, 20), torch.randn(2, 96), packed, TYPES["Q4_0"])
    with pytest.raises(RuntimeError, match="'packed'.*unit bytes"):
        ops.linear_gguf_q8(torch.empty(2, 20), x, packed, TYPES["Q8_0"])


@pytest.mark.parametrize("name", Q8_TYPES)
def test_fake_shape_is_the_real_one(name):
    k = 512 if name.endswith("_K") else 64
    weight = random_blocks(name, 33, k, seed=0)
    real = ops.repack_gguf_q8(weight, TYPES[name], k)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        assert ops.repack_gguf_q8(mode.from_tensor(weight), TYPES[name], k).shape == real.shape


def test_model_with_8_bit_activations_decodes_close_to_exact(tmp_path, monkeypatch):
    from model_factory import make_tiny_hf_model, write_gguf

    path, hf = make_tiny_hf_model(tmp_path, "llama", hidden_size=64, intermediate_size=128, vocab_size=320)
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", tokenizer_dir=path, qtype="Q4_1")
    exact = eecore.LLM(gguf_path, device="cpu", num_blocks=32)
    monkeypatch.setenv("EECORE_GGUF_ACTIVATIONS", "q8")
    q8 = eecore.LLM(gguf_path, device="cpu", num_blocks=32)
    assert q8.model.layers[0].qkv.packed is not None and exact.model.layers[0].qkv.packed is None
    assert (exact.weight_format, q8.weight_format) == ("Q4_1", "Q4_1, 8-bit activations")
    params = eecore.SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    for prompt in ([5, 17, 3, 99], [200, 1, 7]):
        a, b = exact.generate([prompt], params)[0], q8.generate([prompt], params)[0]
        shared = a.logprobs[0].keys() & b.logprobs[0].keys()
        assert len(shared) >= 10
        assert max(abs(a.logprobs[0][t] - b.logprobs[0][t]) for t in shared) < 0.05
    monkeypatch.setenv("EECORE_GGUF_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="EECORE_GGUF_ACTIVATIONS must be one of exact, q8"):
        eecore.LLM(gguf_path, device="cpu", num_blocks=32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu():
    weight = random_blocks("Q4_1", 40, 64, seed=9)
    x = torch.randn(3, 64)
    cpu = ops.linear_gguf_q8(torch.empty(3, 40), x, ops.repack_gguf_q8(weight, TYPES["Q4_1"], 64), TYPES["Q4_1"])
    packed = ops.repack_gguf_q8(weight.cuda(), TYPES["Q4_1"], 64)
    cuda = ops.linear_gguf_q8(torch.empty(3, 40, device="cuda"), x.cuda(), packed, TYPES["Q4_1"])
    torch.testing.assert_close(cuda.cpu(), cpu)
