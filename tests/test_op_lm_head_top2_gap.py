"""lm_head_top2_gap against eecore.testing.reference (hidden @ weight.T, then the softmax top-2 gap)."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES

# The logits are fp32 dot products summed in a different order than the reference matmul, so
# each may differ by a few ulps of the magnitude of its terms, sum_k |h_k w_k| (bf16/fp16 inputs
# are exact in fp32: every dtype gets the same bound). A logit error delta moves p1 - p2 by at
# most ~2 * p1 * delta, which near a tie is far more than any relative tolerance of the gap.
LOGIT_RTOL = 1e-6  # of sum_k |h_k w_k|: ~16 fp32 ulps
GAP_RTOL = 1e-4


def make_inputs(batch, d, vocab, dtype, device, logit_scale=3.0):
    """hidden, weight whose logits are ~N(0, logit_scale^2): neither flat nor one-hot softmaxes."""
    hidden = (torch.randn(batch, d, device=device) * logit_scale / d**0.5).to(dtype)
    weight = torch.randn(vocab, d, device=device).to(dtype)
    return hidden, weight


def assert_matches_reference(hidden, weight):
    gap, top1 = ops.lm_head_top2_gap(hidden, weight)
    gap_ref, _ = reference.lm_head_top2_gap(hidden, weight)
    assert gap.dtype == torch.float32 and top1.dtype == torch.int64
    assert gap.shape == top1.shape == (hidden.shape[0],)
    logits = hidden.double() @ weight.double().T
    logit_tol = LOGIT_RTOL * (hidden.double().abs() @ weight.double().abs().T).max(dim=1).values
    p1 = torch.softmax(logits, dim=-1).max(dim=1).values
    gap_tol = 2 * p1 * logit_tol + GAP_RTOL * gap_ref.double().abs() + 1e-9
    error = (gap.double() - gap_ref.double()).abs()
    assert (error <= gap_tol).all(), f"gap {gap.tolist()} vs reference {gap_ref.tolist()}, tolerance {gap_tol.tolist()}"
    # Near-ties may resolve either way under a different summation order, so check that top1 is
    # a maximal logit (to rounding) rather than the reference's exact index.
    picked = logits.gather(1, top1[:, None]).squeeze(1)
    best = logits.max(dim=1).values
    assert (best - picked <= 2 * logit_tol).all(), f"top1 {top1.tolist()} is not a maximal logit"
    return gap, top1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch, d, vocab",
    [(1, 7, 2), (3, 577, 1001), (8, 64, 513), (17, 33, 1000), (5, 2048, 3001), (1, 576, 49152), (8, 576, 49152),
     (3, 64, 128256), (1, 128, 128256)],
)
def test_lm_head_top2_gap_matches_reference(device, dtype, batch, d, vocab):
    assert_matches_reference(*make_inputs(batch, d, vocab, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("logit_scale", [0.3, 30.0])
def test_lm_head_top2_gap_flat_and_peaked(device, dtype, logit_scale):
    assert_matches_reference(*make_inputs(6, 96, 20000, dtype, device, logit_scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_top2_gap_strided_rows(device, dtype):
    # A slice of a wider weight (e.g. tied embeddings padded to a multiple) and strided hidden rows.
    hidden, weight = make_inputs(10, 100, 7000, dtype, device)
    padded_weight = torch.zeros(7000, 131, device=device, dtype=dtype)
    padded_weight[:, 5:105] = weight
    assert_matches_reference(hidden[::3], padded_weight[:, 5:105])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_top2_gap_planted_winner_and_tie(device, dtype):
    d, vocab = 64, 128256
    hidden, weight = make_inputs(3, d, vocab, dtype, device)
    # Row 0: one vocab row aligned with the hidden state wins by a mile.
    weight[77777] = hidden[0] * 4
    # Row 1: the same winning vocab row twice, in different tiles and threads: a tie, the lower
    # index wins and the gap is exactly 0 (identical rows give bitwise identical logits).
    weight[1000] = weight[vocab - 3] = hidden[1] * 4
    gap, top1 = assert_matches_reference(hidden, weight)
    assert top1[0] == 77777 and gap[0] > 0.99
    assert top1[1] == 1000 and gap[1] == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_top2_gap_large_magnitudes(device, dtype):
    # Logits in the thousands: every exp(x) would overflow without the running-max shift.
    hidden, weight = make_inputs(4, 256, 5000, dtype, device, logit_scale=3000.0 if dtype != torch.float16 else 300.0)
    gap, _ = assert_matches_reference(hidden, weight)
    assert torch.isfinite(gap).all()


def test_lm_head_top2_gap_empty_batch(device):
    gap, top1 = ops.lm_head_top2_gap(torch.randn(0, 16, device=device), torch.randn(50, 16, device=device))
    assert gap.shape == top1.shape == (0,)


def test_lm_head_top2_gap_opcheck(device):
    for dtype in DTYPES:
        hidden, weight = make_inputs(3, 40, 1500, dtype, device)
        torch.library.opcheck(torch.ops.eecore.lm_head_top2_gap.default, (hidden, weight))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: (torch.randn(16, device=d), torch.randn(50, 16, device=d)), "'hidden'.*2-D"),
        (lambda d: (torch.ones(2, 16, device=d, dtype=torch.int64), torch.randn(50, 16, device=d)), "'hidden'.*dtype"),
        (lambda d: (torch.randn(2, 0, device=d), torch.randn(50, 0, device=d)), "'hidden'.*d >= 1"),
        (lambda d: (torch.randn(16, 2, device=d).T, torch.randn(50, 16, device=d)), "'hidden'.*unit stride"),
        (lambda d: (torch.randn(2, 16, device=d), torch.randn(50, 16, 1, device=d)), "'weight'.*2-D"),
        (lambda d: (torch.randn(2, 16, device=d), torch.randn(50, 16, device=d).half()), "'weight'.*dtype"),
        (lambda d: (torch.randn(2, 16, device=d), torch.randn(50, 17, device=d)), "'weight'.*hidden size"),
        (lambda d: (torch.randn(2, 16, device=d), torch.randn(1, 16, device=d)), "'weight'.*at least 2"),
        (lambda d: (torch.randn(2, 16, device=d), torch.randn(16, 50, device=d).T), "'weight'.*unit stride"),
    ],
)
def test_lm_head_top2_gap_bad_arguments(device, make, message):
    hidden, weight = make(device)
    with pytest.raises(RuntimeError, match=message):
        ops.lm_head_top2_gap(hidden, weight)


def test_lm_head_top2_gap_same_bits_on_any_thread_count():
    hidden, weight = make_inputs(5, 96, 49152, torch.float32, "cpu")
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(ops.lm_head_top2_gap(hidden, weight))
    finally:
        torch.set_num_threads(threads)
    for gap, top1 in results[1:]:
        assert torch.equal(gap, results[0][0]) and torch.equal(top1, results[0][1])
