"""linear_gguf and dequantize_gguf (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K weights in
their own bytes) against the `gguf` package's dequantizer followed by a float64 matmul, on random
blocks: scales of every magnitude fp16 holds (zeros, subnormals, the largest), odd row counts, bias
and accumulate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from eecore import _C, ops
from eecore.testing import reference
from cuda_tests import needs_cuda

TYPES = ops.GGUF_QUANT_TYPES
# byte offsets of each block's fp16 fields (scales, and the minimums of Q4_1, Q5_1 and the K formats)
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
K_FORMATS = {"Q4_K", "Q5_K", "Q6_K"}


def block_layout(name: str) -> tuple[int, int]:
    """(weights, bytes) of one block."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(TYPES[name])]


def features(name: str, groups_of_256: int) -> int:
    """An input size with whole blocks of `name` (and, for the 32-weight formats, an odd count of them)."""
    return 256 * groups_of_256 if name in K_FORMATS else 256 * groups_of_256 - 32


def random_blocks(name: str, n: int, k: int, seed: int, extreme: bool = False) -> torch.Tensor:
    """`[n, k / W * block bytes]` uint8: random quants (and K-format sub-scales), and fp16 scales
    (and minimums) drawn around 0.02, or with `extreme` from every binade fp16 has (zero and
    subnormals included)."""
    rng = np.random.default_rng(seed)
    weights, nbytes = block_layout(name)
    blocks = k // weights
    raw = rng.integers(0, 256, size=(n, blocks, nbytes), dtype=np.uint8)

    def scales():
        if extreme:
            bits = rng.integers(0, 0x7BFF, size=(n, blocks), dtype=np.uint16)  # finite, both signs below
            bits |= (rng.integers(0, 2, size=(n, blocks), dtype=np.uint16) << 15)
            bits[:, ::7] = 0  # exact zeros
            return bits.view(np.float16)
        return (rng.standard_normal((n, blocks)) * 0.02).astype(np.float16)

    for offset in HALF_FIELDS[name]:
        raw[:, :, offset:offset + 2] = scales().view(np.uint8).reshape(n, blocks, 2)
    return torch.from_numpy(raw.reshape(n, blocks * nbytes))


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("extreme", [False, True])
def test_dequantize_is_the_gguf_packages_values_exactly(name, extreme):
    k = features(name, 2)
    weight = random_blocks(name, 37, k, seed=1, extreme=extreme)
    got = ops.dequantize_gguf(weight, TYPES[name], k)
    expected = reference.dequantize_gguf(weight, TYPES[name], k)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 10, 11, 13, 24, 47, 48, 49, 96, 97, 130])
@pytest.mark.parametrize("groups_of_256", [2, 16])
def test_linear_matches_dequantized_matmul(name, rows, groups_of_256):
    # 70 output rows: whole register tiles and an edge; past the streamed sizes (10 rows on AVX2,
    # 96 on AVX-512), 4,096 features make GEMM slices of 16 weight rows, so 4 whole and an edge
    n, k = 70, features(name, groups_of_256)
    weight = random_blocks(name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = torch.empty(rows, n)
    ops.linear_gguf(out, x, weight, TYPES[name])
    dense = reference.dequantize_gguf(weight, TYPES[name], k).double()
    expected = x.double() @ dense.T
    # fp32 sums of k products, in another order than float64's
    tolerance = 1e-5 * (x.double().abs() @ dense.abs().T).max().item()
    assert (out.double() - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_rows_sums_do_not_depend_on_the_pass(name):
    """Each row of a streamed pass (2 rows up to the build's bound: 96 with AVX-512, 10 with AVX2)
    is summed in one order whatever register tile it falls in (4 x 4, 5 x 4, 8 x 2, AVX2's 2 x 2
    and 3 x 2, the last weight rows one at a time), so a verification pass gives a row the bits a
    wider streamed pass gives it (one row alone takes the two-accumulator order; passes past the
    bound take a BLAS GEMM a slice, in its order)."""
    widest = min(20, _C.gguf_stream_max_rows())
    n, k = 37, features(name, 2)
    weight = random_blocks(name, n, k, seed=4)
    x = torch.randn(widest, k, generator=torch.Generator().manual_seed(4))
    full = ops.linear_gguf(torch.empty(widest, n), x, weight, TYPES[name])
    for m in range(2, widest):
        assert torch.equal(ops.linear_gguf(torch.empty(m, n), x[:m], weight, TYPES[name]), full[:m])


@pytest.mark.parametrize("name", list(TYPES))
def test_extreme_scales(name):
    k = features(name, 1)
    weight = random_blocks(name, 20, k, seed=3, extreme=True)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3)) * 1e-3
    out = torch.empty(3, 20)
    ops.linear_gguf(out, x, weight, TYPES[name])
    dense = reference.dequantize_gguf(weight, TYPES[name], k).double()
    expected = x.double() @ dense.T
    scale = (x.double().abs() @ dense.abs().T)
    assert torch.isfinite(out).all()
    assert ((out.double() - expected).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6, 60, 100])
@pytest.mark.parametrize("k", [128, 4096])
def test_bias_accumulate_and_strided_rows_against_the_reference(dtype, rows, k):
    name, n = "Q4_1", 33  # 4,096 features past the streamed sizes: GEMM slices of 16, 16 and 1 rows
    weight = random_blocks(name, n, k, seed=5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, k + 8, generator=g).to(dtype)[:, :k]  # rows strided, last dim contiguous
    bias = torch.randn(n, generator=g).to(dtype)
    start = torch.randn(rows, n, generator=g).to(dtype)
    out, expected = start.clone(), start.clone()
    ops.linear_gguf(out, x, weight, TYPES[name], bias, accumulate=True)
    reference.linear_gguf(expected, x, weight, TYPES[name], bias, accumulate=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_is_the_dequantized_rows(name, dtype):
    k = features(name, 1)
    weight = random_blocks(name, 50, k, seed=11)
    ids = torch.tensor([3, 0, 49, 3, 17], dtype=torch.long)
    out = torch.full((5, k + 16), float("nan"), dtype=dtype)[:, :k]  # rows strided
    ops.embedding_gguf(out, ids, weight, TYPES[name])
    expected = torch.empty(5, k, dtype=dtype)
    reference.embedding_gguf(expected, ids, weight, TYPES[name])
    assert torch.equal(out, expected)


def test_embedding_refuses_ids_out_of_range():
    weight = random_blocks("Q8_0", 4, 64, seed=0)
    out = torch.empty(2, 64)
    for bad in (4, -1):
        with pytest.raises(RuntimeError, match=f"'token_ids'.*\\[0, 4\\).*got {bad} at index 1"):
            ops.embedding_gguf(out, torch.tensor([0, bad]), weight, TYPES["Q8_0"])
    with pytest.raises(RuntimeError, match="'token_ids'.*expected dtype Long"):
        ops.embedding_gguf(out, torch.tensor([0, 1], dtype=torch.int32), weight, TYPES["Q8_0"])
    with pytest.raises(RuntimeError, match="'out'.*the number of token ids"):
        ops.embedding_gguf(torch.empty(3, 64), torch.tensor([0, 1]), weight, TYPES["Q8_0"])


def test_bad_arguments_name_the_argument():
    weight = random_blocks("Q4_0", 4, 64, seed=0)
    x = torch.randn(2, 64)
    out = torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="'quant_type'.*2 \\(Q4_0\\), 3 \\(Q4_1\\).*14 \\(Q6_K\\); got 10"):
        ops.linear_gguf(out, x, weight, 10)  # Q2_K
    with pytest.raises(RuntimeError, match="'input'.*multiple of 256 features \\(whole Q4_K blocks\\)"):
        ops.linear_gguf(out, x, weight, TYPES["Q4_K"])
    with pytest.raises(RuntimeError, match="'weight'.*the bytes of one row"):
        ops.linear_gguf(out, x, weight, TYPES["Q8_0"])
    with pytest.raises(RuntimeError, match="'input'.*multiple of 32 features"):
        ops.linear_gguf(torch.empty(2, 4), torch.randn(2, 48), weight, TYPES["Q4_0"])
    with pytest.raises(RuntimeError, match="'weight'.*expected dtype Byte"):
        ops.linear_gguf(out, x, weight.to(torch.int8), TYPES["Q4_0"])
    with pytest.raises(RuntimeError, match="'out'.*the output features N"):
        ops.linear_gguf(torch.empty(2, 5), x, weight, TYPES["Q4_0"])
    with pytest.raises(RuntimeError, match="'features'.*multiple of 32"):
        ops.dequantize_gguf(weight, TYPES["Q4_0"], 60)


def test_fake_shapes():
    weight = random_blocks("Q8_0", 6, 64, seed=0)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = mode.from_tensor(weight)
        assert ops.dequantize_gguf(fake, TYPES["Q8_0"], 64).shape == (6, 64)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(TYPES))
def test_cuda_matches_the_cpu(name):
    k = features(name, 1)
    weight = random_blocks(name, 40, k, seed=9)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(9))
    cpu = ops.linear_gguf(torch.empty(5, 40), x, weight, TYPES[name])
    cuda = ops.linear_gguf(torch.empty(5, 40, device="cuda"), x.cuda(), weight.cuda(), TYPES[name])
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-4, atol=1e-4)
    assert torch.equal(ops.dequantize_gguf(weight.cuda(), TYPES[name], k).cpu(),
                       ops.dequantize_gguf(weight, TYPES[name], k))
    ids = torch.tensor([39, 0, 7])
    rows = ops.embedding_gguf(torch.empty(3, k, device="cuda"), ids.cuda(), weight.cuda(), TYPES[name])
    assert torch.equal(rows.cpu(), ops.embedding_gguf(torch.empty(3, k), ids, weight, TYPES[name]))
