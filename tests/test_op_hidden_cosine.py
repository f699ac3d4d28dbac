"""hidden_cosine against eecore.testing.reference (F.cosine_similarity in fp32, eps=1e-8)."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES

COS_TOL = dict(rtol=1e-5, atol=1e-6)


def assert_matches_reference(prev, cur):
    sim = ops.hidden_cosine(prev, cur)
    assert sim.dtype == torch.float32 and sim.shape == (prev.shape[0],)
    torch.testing.assert_close(sim, reference.hidden_cosine(prev, cur), **COS_TOL)
    return sim


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 577), (8, 2048), (17, 64), (64, 4099)])
def test_hidden_cosine_matches_reference(device, dtype, shape):
    prev = torch.randn(shape, device=device).to(dtype)
    # Correlated rows, so the similarities spread over (-1, 1) instead of all being ~0.
    mix = torch.rand(shape[0], 1, device=device) * 2 - 1
    cur = (mix * prev.float() + (1 - mix.abs()) * torch.randn(shape, device=device)).to(dtype)
    assert_matches_reference(prev, cur)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_cosine_special_rows(device, dtype):
    d = 300
    prev = torch.randn(5, d, device=device).to(dtype)
    cur = torch.randn(5, d, device=device).to(dtype)
    cur[0] = prev[0]  # same direction: 1
    cur[1] = -prev[1]  # opposite: -1
    prev[2] = 0  # a zero row: the norm is clamped at eps, the similarity is 0 (not NaN)
    prev[3], cur[3] = 0, 0
    prev[4] = prev[4] * 1e-9  # far below eps in norm (in fp32; flushes to ~0 in half)
    sim = assert_matches_reference(prev, cur)
    torch.testing.assert_close(sim[:2], torch.tensor([1.0, -1.0], device=device), rtol=0, atol=1e-6)
    assert sim[2] == 0 and sim[3] == 0


def test_hidden_cosine_large_magnitudes(device):
    prev = torch.randn(4, 1000, device=device) * 1e15  # squares ~1e30 summed: no fp32 overflow
    cur = prev * 3 + torch.randn(4, 1000, device=device) * 1e15
    assert_matches_reference(prev, cur)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_cosine_strided_rows(device, dtype):
    big = torch.randn(10, 2 * 513, device=device).to(dtype)
    assert_matches_reference(big[:, :513], big[:, 513:])
    assert_matches_reference(big[::2, 1:514], big[1::2, 500:1013])


def test_hidden_cosine_empty_batch(device):
    assert ops.hidden_cosine(torch.randn(0, 8, device=device), torch.randn(0, 8, device=device)).shape == (0,)


def test_hidden_cosine_opcheck(device):
    for dtype in DTYPES:
        prev, cur = torch.randn(2, 5, 33, device=device).to(dtype)
        torch.library.opcheck(torch.ops.eecore.hidden_cosine.default, (prev, cur))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: (torch.randn(8, device=d), torch.randn(8, device=d)), "'prev'.*2-D"),
        (lambda d: (torch.ones(2, 8, device=d, dtype=torch.int32), torch.ones(2, 8, device=d, dtype=torch.int32)),
         "'prev'.*dtype"),
        (lambda d: (torch.randn(2, 0, device=d), torch.randn(2, 0, device=d)), "'prev'.*d >= 1"),
        (lambda d: (torch.randn(8, 2, device=d).T, torch.randn(2, 8, device=d)), "'prev'.*unit stride"),
        (lambda d: (torch.randn(2, 8, device=d), torch.randn(3, 8, device=d)), "'cur'.*shape"),
        (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 9, device=d)), "'cur'.*shape"),
        (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 8, device=d).bfloat16()), "'cur'.*dtype"),
        (lambda d: (torch.randn(2, 8, device=d), torch.randn(8, 2, device=d).T), "'cur'.*unit stride"),
    ],
)
def test_hidden_cosine_bad_arguments(device, make, message):
    prev, cur = make(device)
    with pytest.raises(RuntimeError, match=message):
        ops.hidden_cosine(prev, cur)
