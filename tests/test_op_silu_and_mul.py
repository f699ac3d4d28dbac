"""silu_and_mul against eecore.testing.reference and HF Llama's MLP activation."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES, poison, tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 1536), (3, 2, 2 * 13), (1, 2), (0, 64), (70, 2 * 576)])
def test_silu_and_mul_matches_reference(device, dtype, shape):
    # gates far into both tails (e^-g over- and underflows) as well as the usual range
    x = torch.randn(shape, device=device) * 4
    if x.numel():
        x.view(-1)[:: 7] *= 30
    x = x.to(dtype)
    out_shape = shape[:-1] + (shape[-1] // 2,)
    out = poison(torch.empty(out_shape, dtype=dtype, device=device))
    expected = torch.empty_like(out)
    ops.silu_and_mul(out, x)
    reference.silu_and_mul(expected, x)
    torch.testing.assert_close(out, expected, **tol(dtype))


def test_silu_and_mul_special_values(device):
    gate = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 100.0, -100.0, 1e-30] * 2, device=device)
    up = torch.full_like(gate, 2.0)
    out = poison(torch.empty_like(gate))[None]
    ops.silu_and_mul(out, torch.cat([gate, up])[None])
    expected = torch.nn.functional.silu(gate) * up
    # silu(-inf) * 2 is -inf / inf = NaN in torch's formula as in ours
    torch.testing.assert_close(out[0], expected, equal_nan=True, atol=1e-30, rtol=1e-6)


def test_silu_and_mul_matches_hf_llama_mlp_activation(device):
    act = pytest.importorskip("transformers.activations").ACT2FN["silu"]
    x = torch.randn(4, 2 * 96, device=device)
    gate, up = x.chunk(2, dim=-1)
    out = torch.empty(4, 96, device=device)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, act(gate) * up, **tol(torch.float32))


def test_silu_and_mul_opcheck(device):
    x = torch.randn(3, 2 * 40, device=device)
    torch.library.opcheck(torch.ops.eecore.silu_and_mul.default, (torch.empty(3, 40, device=device), x))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: (torch.empty(4, 4, device=d), torch.randn(4, 9, device=d)), "'input'.*even"),
        (lambda d: (torch.empty(4, 5, device=d), torch.randn(4, 8, device=d)), "'out'.*shape"),
        (lambda d: (torch.empty(4, 4, device=d).half(), torch.randn(4, 8, device=d)), "'out'.*dtype"),
        (lambda d: (torch.empty(4, 4, device=d), torch.randn(8, 4, device=d).T), "'input'.*contiguous"),
        (lambda d: (torch.empty(8, 4, device=d).T, torch.randn(4, 16, device=d)), "'out'.*contiguous"),
        (lambda d: (torch.empty(4, 4, device=d)[:, ::2], torch.randn(4, 4, device=d)), "'out'.*contiguous"),
        (lambda d: (torch.empty(4, 4, device=d, dtype=torch.int32), torch.ones(4, 8, device=d, dtype=torch.int32)),
         "'input'.*dtype"),
        (lambda d: (torch.empty(4, 4, device=d), torch.randn((), device=d)), "'input'.*at least 1 dim"),
    ],
)
def test_silu_and_mul_bad_arguments(device, make, message):
    out, x = make(device)
    with pytest.raises(RuntimeError, match=message):
        ops.silu_and_mul(out, x)
