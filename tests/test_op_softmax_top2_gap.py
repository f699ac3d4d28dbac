"""softmax_top2_gap against eecore.testing.reference: values, ties, special values, strides, errors."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES

# The op sums exp in fp32 like the reference, in a different order; the reference's fp32 sum is
# itself off by up to ~1e-5 relative at V = 128K (see the fp64 test), which scales the gap. Near
# a tie the reference's p1 - p2 also cancels: each probability carries ~1 ulp, an absolute error
# of ~1e-7 * p1 that no relative tolerance of a tiny gap covers.
GAP_RTOL = 1e-4
GAP_P1_ATOL = 4e-7


def assert_gap_close(gap, gap_ref, logits):
    p1 = torch.softmax(logits.double(), dim=-1).max(dim=-1).values.nan_to_num(0)
    tol = GAP_RTOL * gap_ref.double().abs() + GAP_P1_ATOL * p1 + 1e-12
    both_nan = gap.isnan() & gap_ref.isnan()
    ok = both_nan | ((gap.double() - gap_ref.double()).abs() <= tol)
    assert ok.all(), f"gap {gap[~ok].tolist()} vs reference {gap_ref[~ok].tolist()} (rows {(~ok).nonzero().flatten().tolist()})"

SHAPES = [(1, 2), (3, 5), (17, 777), (8, 1001), (2, 16411), (1, 49152), (8, 49152), (3, 128256), (1, 128256)]


def logits_like(shape, dtype, device, scale):
    return (torch.randn(shape, device=device) * scale).to(dtype)


def assert_matches_reference(logits):
    gap, top1 = ops.softmax_top2_gap(logits)
    gap_ref, top1_ref = reference.softmax_top2_gap(logits)
    assert gap.dtype == torch.float32 and top1.dtype == torch.int64
    assert gap.shape == top1.shape == (logits.shape[0],)
    assert_gap_close(gap, gap_ref, logits)
    # The op sees exactly the reference's fp32 values, so the argmax (first index on a tie) is exact.
    torch.testing.assert_close(top1, top1_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_top2_gap_matches_reference(device, dtype, shape):
    for scale in (0.5, 4.0, 30.0):  # from flat (tiny gaps) to peaked (gap near 1) softmaxes
        assert_matches_reference(logits_like(shape, dtype, device, scale))


def test_softmax_top2_gap_is_accurate_in_fp64(device):
    # The op's gap is -expm1(x2 - x1) / sumexp: as accurate as fp32 allows, even where the fp32
    # reference (softmax, then the difference of two probabilities) loses digits.
    logits = torch.randn(6, 128256, device=device) * torch.tensor([0.5, 1, 2, 3, 10, 30], device=device)[:, None]
    probs = torch.softmax(logits.double(), dim=-1).topk(2, dim=-1).values
    gap, _ = ops.softmax_top2_gap(logits)
    torch.testing.assert_close(gap.double(), probs[:, 0] - probs[:, 1], rtol=2e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_top2_gap_row_strides(device, dtype):
    # A slice of a padded buffer and every other row of a batch: rows with a stride, unit inner stride.
    padded = logits_like((5, 50000 + 37), dtype, device, 3.0)
    assert_matches_reference(padded[:, :50000])
    assert_matches_reference(padded[::2, 37:])
    expanded = logits_like((1, 999), dtype, device, 3.0).expand(4, 999)  # row stride 0
    assert_matches_reference(expanded)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_top2_gap_ties(device, dtype):
    vocab = 128256
    logits = logits_like((4, vocab), dtype, device, 1.0)
    logits[0] = 0.25  # every entry tied: gap 0, top1 0
    logits[1, 7] = logits[1, 100000] = 9.0  # the max twice, in different threads' segments
    logits[2, vocab - 1] = logits[2, vocab - 2] = 9.0  # at the very end
    logits[3, 70000] = 9.0  # a clear winner, tied second places below it
    logits[3, 3] = logits[3, 90000] = 8.0
    gap, top1 = ops.softmax_top2_gap(logits)
    assert top1.tolist() == [0, 7, vocab - 2, 70000]
    assert gap[:3].tolist() == [0.0, 0.0, 0.0]
    assert gap[3] > 0
    assert_matches_reference(logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_top2_gap_negative_infinity(device, dtype):
    vocab = 20000
    logits = logits_like((4, vocab), dtype, device, 2.0)
    logits[0, ::3] = float("-inf")  # masked entries take no probability
    logits[1] = float("-inf")
    logits[1, 12345] = 1.0  # the only finite entry: p1 = 1, p2 = 0
    logits[2] = float("-inf")
    logits[2, 5], logits[2, 19999] = 1.0, 1.0 - 0.5  # two finite entries, far apart
    logits[3] = float("-inf")  # nothing finite: softmax is NaN, like torch
    gap, top1 = ops.softmax_top2_gap(logits)
    assert gap[1] == 1.0 and top1[1] == 12345
    assert top1[2] == 5
    assert torch.isnan(gap[3]) and top1[3] == 0
    assert_matches_reference(logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_top2_gap_large_magnitudes(device, dtype):
    # exp is only ever taken of x - max <= 0: huge logits must neither overflow nor lose the gap.
    big = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 6e4}[dtype]
    logits = logits_like((3, 30011), dtype, device, 1.0).float()
    logits[0] = logits[0] * big / 8
    logits[1] = logits[1] * 3 - 3e4  # every exp(x) would underflow to 0 without the max shift
    logits[2] = logits[2].clamp(-2, 2)
    logits[2, 17] = big  # one logit dominates completely
    logits = logits.to(dtype)
    gap, top1 = ops.softmax_top2_gap(logits)
    assert torch.isfinite(gap).all()
    assert gap[2] == 1.0 and top1[2] == 17
    assert_matches_reference(logits)


def test_softmax_top2_gap_nonfinite_rows_give_nan(device):
    logits = torch.randn(3, 9000, device=device)
    logits[0, 4321] = float("nan")
    logits[1, 8999] = float("inf")
    gap, top1 = ops.softmax_top2_gap(logits)
    gap_ref, _ = reference.softmax_top2_gap(logits)
    assert torch.isnan(gap[:2]).all() and torch.isnan(gap_ref[:2]).all()
    assert top1[1] == 8999
    assert_gap_close(gap[2:], gap_ref[2:], logits[2:])


def test_softmax_top2_gap_empty_batch(device):
    gap, top1 = ops.softmax_top2_gap(torch.randn(0, 10, device=device))
    assert gap.shape == top1.shape == (0,)


def test_softmax_top2_gap_opcheck(device):
    for dtype in DTYPES:
        logits = torch.randn(3, 4099, device=device).to(dtype)
        torch.library.opcheck(torch.ops.eecore.softmax_top2_gap.default, (logits,))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: torch.randn(10, device=d), "'logits'.*2-D"),
        (lambda d: torch.randn(2, 3, 10, device=d), "'logits'.*2-D"),
        (lambda d: torch.ones(2, 10, device=d, dtype=torch.int32), "'logits'.*dtype"),
        (lambda d: torch.randn(2, 10, device=d, dtype=torch.float64), "'logits'.*dtype"),
        (lambda d: torch.randn(4, 1, device=d), "'logits'.*at least 2"),
        (lambda d: torch.randn(10, 4, device=d).T, "'logits'.*unit stride"),
    ],
)
def test_softmax_top2_gap_bad_arguments(device, make, message):
    with pytest.raises(RuntimeError, match=message):
        ops.softmax_top2_gap(make(device))


def test_softmax_top2_gap_same_bits_on_any_thread_count():
    # The vocab is cut by shape alone and the pieces merged in order: the thread count (and the
    # small-batch vocab split it enables) changes nothing, down to the last bit.
    logits = torch.randn(3, 128256) * 4
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(ops.softmax_top2_gap(logits))
    finally:
        torch.set_num_threads(threads)
    for gap, top1 in results[1:]:
        assert torch.equal(gap, results[0][0]) and torch.equal(top1, results[0][1])
