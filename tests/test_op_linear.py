"""linear against eecore.testing.reference: every CPU path (weight streaming for few rows, in row blocks for
more, GEMM above kBlockedMaxRows)."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES, poison, tol


def _case(device, dtype, rows, k, n, bias, row_stride=None):
    inp = torch.randn(rows, row_stride or k, dtype=dtype, device=device)[:, :k]
    weight = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    return inp, weight, b


@pytest.mark.parametrize("dtype", DTYPES)
# rows 25-48: row blocks (linear_cpu.cpp: 25 -> 15 + 10, 40 -> 21 + 19, 47 -> 18 + 18 + 11); 49: GEMM
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 24, 25, 40, 47, 48, 49])
# (4100, 70): from 8 rows the hidden rows pass kHiddenChunkBytes and are cut into chunks of the
# length (cpu_dots.h), and 4100 leaves a tail that is not a whole vector step in the last chunk
@pytest.mark.parametrize("k, n", [(576, 960), (37, 65), (64, 1), (4100, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(device, dtype, rows, k, n, bias):
    inp, weight, b = _case(device, dtype, rows, k, n, bias, row_stride=k + 3)
    out = poison(torch.empty(rows, n, dtype=dtype, device=device))
    expected = torch.empty_like(out)
    ops.linear(out, inp, weight, b)
    reference.linear(expected, inp, weight, b)
    torch.testing.assert_close(out, expected, **tol(dtype, scale=4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(576, 960), (37, 65)])
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype, k, n):
    """CPU, weight streaming (up to 24 rows): each output row is computed alone, whatever the row
    grouping, so a speculative verify pass of m rows gives each row the bits of a one-row step
    (greedy self-speculation then reproduces full depth exactly)."""
    inp, weight, _ = _case("cpu", dtype, 24, k, n, False)
    alone = torch.empty(24, n, dtype=dtype)
    for i in range(24):
        ops.linear(alone[i:i + 1], inp[i:i + 1], weight)
    for rows in range(2, 25):
        out = torch.empty(rows, n, dtype=dtype)
        ops.linear(out, inp[:rows], weight)
        assert torch.equal(out, alone[:rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_linear_accumulates_into_out(device, dtype, rows):
    inp, weight, b = _case(device, dtype, rows, 96, 70, True)
    out = torch.randn(rows, 70, dtype=dtype, device=device)
    expected = out.clone()
    ops.linear(out, inp, weight, b, accumulate=True)
    reference.linear(expected, inp, weight, b, accumulate=True)
    torch.testing.assert_close(out, expected, **tol(dtype, scale=4))


def test_linear_writes_only_its_rows_of_a_strided_out(device):
    inp, weight, _ = _case(device, torch.float32, 4, 32, 24, False)
    buf = poison(torch.empty(4, 40, device=device))
    ops.linear(buf[:, :24], inp, weight)
    assert torch.isnan(buf[:, 24:]).all()
    torch.testing.assert_close(buf[:, :24], inp @ weight.T, **tol(torch.float32, scale=4))


def test_linear_opcheck(device):
    for rows in (2, 20):
        inp, weight, b = _case(device, torch.float32, rows, 24, 12, True)
        torch.library.opcheck(torch.ops.eecore.linear.default, (torch.empty(rows, 12, device=device), inp, weight,
                                                                b, False))
        torch.library.opcheck(torch.ops.eecore.linear.default, (torch.randn(rows, 12, device=device), inp, weight,
                                                                None, True))


@pytest.mark.parametrize("make, message", [
    (lambda d: (torch.empty(2, 5, device=d), torch.randn(2, 4, device=d), torch.randn(5, 3, device=d), None),
     "'weight'.*input features"),
    (lambda d: (torch.empty(3, 5, device=d), torch.randn(2, 4, device=d), torch.randn(5, 4, device=d), None),
     "'out'.*rows"),
    (lambda d: (torch.empty(2, 6, device=d), torch.randn(2, 4, device=d), torch.randn(5, 4, device=d), None),
     "'out'.*output features"),
    (lambda d: (torch.empty(2, 5, device=d), torch.randn(2, 4, device=d), torch.randn(5, 4, device=d),
                torch.randn(4, device=d)), "'bias'"),
    (lambda d: (torch.empty(2, 5, device=d), torch.randn(2, 4, device=d), torch.randn(5, 4, device=d).half(), None),
     "'weight'.*dtype"),
    (lambda d: (torch.empty(2, 5, device=d), torch.randn(4, 2, device=d).T, torch.randn(5, 4, device=d), None),
     "'input'.*unit stride"),
    (lambda d: (torch.empty(2, 5, device=d), torch.randn(2, 4, 1, device=d), torch.randn(5, 4, device=d), None),
     "'input'.*2-D"),
])
def test_linear_bad_arguments(device, make, message):
    out, inp, weight, bias = make(device)
    with pytest.raises(RuntimeError, match=message):
        ops.linear(out, inp, weight, bias)


# ---- weight-only int8: weight int8 [N, K] with weight_scale fp32 [N] -----------------------------

def _int8_case(device, dtype, rows, k, n, bias):
    inp = torch.randn(rows, k + 3, dtype=dtype, device=device)[:, :k]
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    scale = torch.rand(n, device=device) * 3 / (127 * k ** 0.5)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    return inp, weight, scale, b


@pytest.mark.parametrize("dtype", DTYPES)
# streaming (1-24 rows, 4 x 4 and leftover blocks), then row blocks at every size on the CPU (a
# widened-weight GEMM on CUDA)
@pytest.mark.parametrize("rows", [1, 3, 8, 24, 25, 49, 150])
@pytest.mark.parametrize("k, n", [(576, 960), (37, 65), (4100, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weight_matches_reference(device, dtype, rows, k, n, bias):
    inp, weight, scale, b = _int8_case(device, dtype, rows, k, n, bias)
    out = poison(torch.empty(rows, n, dtype=dtype, device=device))
    expected = torch.empty_like(out)
    ops.linear(out, inp, weight, b, weight_scale=scale)
    reference.linear(expected, inp, weight, b, weight_scale=scale)
    torch.testing.assert_close(out, expected, **tol(dtype, scale=4))


@pytest.mark.parametrize("rows", [3, 60])  # one block, several
def test_int8_weight_rows_of_zeros_and_of_non_finite_values(device, rows):
    """A zero input row gives the bias alone; a row holding inf or NaN gives NaN (its int16 scale
    is NaN), where rounding it would otherwise give a finite, wrong value."""
    inp, weight, scale, b = _int8_case(device, torch.float32, rows, 64, 40, True)
    inp[0] = 0.0
    inp[1, 7] = float("inf")
    inp[2, 3] = float("nan")
    out = torch.empty(rows, 40, device=device)
    ops.linear(out, inp, weight, b, weight_scale=scale)
    torch.testing.assert_close(out[0], b)
    assert torch.isnan(out[1:3]).all()
    expected = torch.empty_like(out)
    reference.linear(expected, inp, weight, b, weight_scale=scale)
    torch.testing.assert_close(out[3:], expected[3:], **tol(torch.float32, scale=4))


@pytest.mark.parametrize("rows", [3, 60])
def test_int8_weight_with_no_input_features_gives_the_bias(device, rows):
    """K = 0, as with float weights: each output is its bias (no row to round, no max to take)."""
    out = torch.empty(rows, 5, device=device)
    bias = torch.randn(5, device=device)
    ops.linear(out, torch.empty(rows, 0, device=device), torch.empty(5, 0, dtype=torch.int8, device=device), bias,
               weight_scale=torch.ones(5, device=device))
    expected = torch.empty_like(out)
    reference.linear(expected, torch.empty(rows, 0, device=device), torch.empty(5, 0, dtype=torch.int8, device=device),
                     bias, weight_scale=torch.ones(5, device=device))
    torch.testing.assert_close(out, bias.expand(rows, 5))
    torch.testing.assert_close(expected, out)


@pytest.mark.parametrize("rows", [1, 4, 60])
@pytest.mark.parametrize("k", [5000, 9000])
def test_int8_weight_long_rows_do_not_overflow(device, rows, k):
    """The worst case of a long row: every product at its largest magnitude (|q| = range, weights
    -128). int16_row_range keeps each int32 lane of the integer dot product from wrapping: at 5000
    elements the full int16 range would still fit vpdpwssd's 16 lanes, not AVX2 vpmaddwd's 8."""
    assert reference.int16_row_range(k) < 32767
    inp = torch.ones(rows, k, device=device)
    weight = torch.full((16, k), -128, dtype=torch.int8, device=device)
    scale = torch.full((16,), 1e-3, device=device)
    out = torch.empty(rows, 16, device=device)
    ops.linear(out, inp, weight, weight_scale=scale)
    torch.testing.assert_close(out, torch.full_like(out, -128 * 1e-3 * k), rtol=1e-5, atol=0)


@pytest.mark.parametrize("k, n", [(576, 960), (37, 65)])
def test_int8_weight_a_rows_bits_do_not_depend_on_the_other_rows(k, n):
    inp, weight, scale, _ = _int8_case("cpu", torch.float32, 24, k, n, False)
    alone = torch.empty(24, n)
    for i in range(24):
        ops.linear(alone[i:i + 1], inp[i:i + 1], weight, weight_scale=scale)
    for rows in (2, 3, 5, 9, 13, 24):
        out = torch.empty(rows, n)
        ops.linear(out, inp[:rows], weight, weight_scale=scale)
        assert torch.equal(out, alone[:rows]), rows


@pytest.mark.parametrize("rows", [24, 60, 150])  # streaming, then prompt sizes (int8 GEMMs with AMX)
@pytest.mark.parametrize("k", [37, 576, 4100])
def test_int8_weight_sums_are_the_exact_integer_sums(rows, k):
    """The CPU kernels' integer products (AVX512-VNNI, AVX2 vpmaddwd, AMX tiles). Every int16 value
    a row can round to (both extremes, -1, values of either byte alone) against weights at -128 and
    127: each output is the exact integer sum times the two scales, to within fp32 rounding of the
    products' magnitudes (the streaming kernel sums its int32 lanes in fp32; the AMX path splits
    each int16 into two bytes, and a wrong byte or offset would be off by at least 128 x the
    weights' sum). CUDA's int8 path is an fp32 GEMM, held to the reference by the tests above."""
    device = "cpu"
    gen = torch.Generator().manual_seed(k + rows)
    rng = reference.int16_row_range(k)
    specials = torch.tensor([rng, -rng, -1, 1, 255, -256, 256, 128, -129, 0], dtype=torch.float32)
    q = torch.randint(-rng, rng + 1, (rows, k), generator=gen).float()
    q[:, :len(specials)] = specials[:k]
    q[:, 0] = torch.where(torch.arange(rows) % 2 == 0, rng, -rng)  # every row reaches its range
    inp = (q * 0.01).to(device)  # a row's absmax maps to rng, so these round back to q exactly
    weight = torch.randint(-128, 128, (19, k), dtype=torch.int8, generator=gen)
    weight[0] = -128
    weight[1] = 127
    weight = weight.to(device)
    scale = (torch.rand(19, generator=gen) + 0.5).to(device)
    out = torch.empty(rows, 19, device=device)
    ops.linear(out, inp, weight, weight_scale=scale)
    q_ref, row_scale = reference.round_rows_to_int16(inp.cpu())
    assert torch.equal(q_ref, q)
    exact = (q.double() @ weight.cpu().double().T).float()
    scales = row_scale[:, None] * scale.cpu()[None, :]
    magnitude = (q.abs().double() @ weight.cpu().double().abs().T).float() * scales  # (int8 abs wraps at -128)
    error = (out.cpu() - exact * scales).abs()
    assert (error <= 1e-6 * magnitude).all(), (error / magnitude).max()


@pytest.mark.parametrize("rows", [1, 5, 33, 60])  # streaming, blocks, and the prompt-size path
def test_int8_weight_accumulates_into_out(device, rows):
    inp, weight, scale, b = _int8_case(device, torch.float32, rows, 96, 70, True)
    out = torch.randn(rows, 70, device=device)
    expected = out.clone()
    ops.linear(out, inp, weight, b, accumulate=True, weight_scale=scale)
    reference.linear(expected, inp, weight, b, accumulate=True, weight_scale=scale)
    torch.testing.assert_close(out, expected, **tol(torch.float32, scale=4))


def test_int8_weight_opcheck(device):
    for rows in (2, 60):
        inp, weight, scale, b = _int8_case(device, torch.float32, rows, 24, 12, True)
        torch.library.opcheck(torch.ops.eecore.linear.default,
                              (torch.empty(rows, 12, device=device), inp, weight, b, False, scale))


@pytest.mark.parametrize("make, message", [
    (lambda d: (torch.zeros(5, 4, dtype=torch.int8, device=d), None), "'weight_scale' is required with an int8"),
    (lambda d: (torch.randn(5, 4, device=d), torch.ones(5, device=d)), "'weight_scale' applies to an int8 'weight' only"),
    (lambda d: (torch.zeros(5, 4, dtype=torch.int8, device=d), torch.ones(5, device=d).half()), "'weight_scale'.*Float"),
    (lambda d: (torch.zeros(5, 4, dtype=torch.int8, device=d), torch.ones(4, device=d)), "'weight_scale'.*output features"),
    (lambda d: (torch.zeros(5, 4, dtype=torch.int8, device=d), torch.ones(5, 1, device=d)), "'weight_scale'.*1-D"),
    (lambda d: (torch.zeros(5, 4, dtype=torch.int8, device=d), torch.ones(10, device=d)[::2]), "'weight_scale'.*contiguous"),
    (lambda d: (torch.zeros(5, 4, dtype=torch.uint8, device=d), None), "'weight'.*or int8"),
])
def test_int8_weight_bad_arguments(device, make, message):
    weight, scale = make(device)
    with pytest.raises(RuntimeError, match=message):
        ops.linear(torch.empty(2, 5, device=device), torch.randn(2, 4, device=device), weight, weight_scale=scale)
