"""argmax against torch.argmax: values, ties, NaN and infinities, strides, the out buffer, errors."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES

SHAPES = [(1, 1), (3, 5), (17, 777), (2, 16411), (1, 49152), (8, 49152), (3, 128256), (64, 4099)]


def assert_matches_torch(logits):
    got = ops.argmax(logits)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    assert torch.equal(got, reference.argmax(logits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_argmax_matches_torch(device, dtype, shape):
    for scale in (0.01, 3.0):  # bf16 at scale 0.01 has many exact ties
        assert_matches_torch((torch.randn(shape, device=device) * scale).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_and_special_values(device, dtype):
    vocab = 128256
    logits = torch.randn(7, vocab, device=device).to(dtype)
    logits[0] = 0.25  # every entry tied: 0
    logits[1, 7] = logits[1, 100000] = 9.0  # the max twice, far apart: the first
    logits[2, vocab - 1] = logits[2, vocab - 2] = 9.0  # at the very end, in the unaligned tail's reach
    logits[3] = float("-inf")  # nothing finite: 0
    logits[4, 70000] = float("inf")
    logits[4, 9] = float("inf")  # +inf twice: the first
    logits[5, 90000] = float("nan")
    logits[5, 100001] = float("nan")
    logits[5, 3] = 50.0  # the first NaN beats any value
    logits[6, 0] = float("nan")  # a NaN first
    got = ops.argmax(logits)
    assert got.tolist() == [0, 7, vocab - 2, 0, 9, 90000, 0]
    assert torch.equal(got, reference.argmax(logits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_row_strides_and_out(device, dtype):
    padded = torch.randn(5, 50000 + 37, device=device).to(dtype)
    assert_matches_torch(padded[:, :50000])
    assert_matches_torch(padded[::2, 37:])  # unaligned rows: no 16-byte loads
    assert_matches_torch(torch.randn(1, 999, device=device).to(dtype).expand(4, 999))  # row stride 0
    buffer = torch.full((10,), -7, dtype=torch.int64, device=device)
    out = ops.argmax(padded, out=buffer[2:7])
    assert out.data_ptr() == buffer[2:7].data_ptr()
    assert buffer[:2].tolist() == [-7, -7] and buffer[7:].tolist() == [-7, -7, -7]
    assert torch.equal(out, reference.argmax(padded))
    strided = torch.zeros(10, dtype=torch.int64, device=device)[::2]
    assert torch.equal(ops.argmax(padded, out=strided), reference.argmax(padded))


def test_argmax_empty_batch(device):
    assert ops.argmax(torch.randn(0, 10, device=device)).shape == (0,)


@pytest.mark.parametrize("make, message", [
    (lambda d: (torch.empty(2, dtype=torch.int64, device=d), torch.randn(2, 3, 4, device=d)), "logits"),
    (lambda d: (torch.empty(2, dtype=torch.int64, device=d), torch.randn(2, 0, device=d)), "at least 1 vocab"),
    (lambda d: (torch.empty(2, dtype=torch.int64, device=d), torch.randn(2, 8, device=d).to(torch.int32)), "logits"),
    (lambda d: (torch.empty(2, dtype=torch.int64, device=d), torch.randn(8, 2, device=d).t()), "unit stride"),
    (lambda d: (torch.empty(3, dtype=torch.int64, device=d), torch.randn(2, 8, device=d)), "'out'"),
    (lambda d: (torch.empty(2, dtype=torch.int32, device=d), torch.randn(2, 8, device=d)), "'out'"),
    (lambda d: (torch.empty(2, 1, dtype=torch.int64, device=d), torch.randn(2, 8, device=d)), "'out'"),
])
def test_argmax_bad_arguments(device, make, message):
    out, logits = make(device)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.eecore.argmax(out, logits)


def test_argmax_opcheck(device):
    torch.library.opcheck(torch.ops.eecore.argmax.default,
                          (torch.empty(3, dtype=torch.int64, device=device), torch.randn(3, 40, device=device)))
