"""rms_norm and fused_add_rms_norm against eecore.testing.reference."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES, poison, tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (13, 576), (3, 5, 2048), (0, 64)])
def test_rms_norm_matches_reference(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    out = poison(torch.empty_like(x))
    expected = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    reference.rms_norm(expected, x, w, 1e-6)
    torch.testing.assert_close(out, expected, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (9, 576), (2, 3, 1000)])
def test_fused_add_rms_norm_matches_reference(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device)
    r = torch.randn(shape, dtype=dtype, device=device) * 2
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    x_ref, r_ref = x.clone(), r.clone()
    ops.fused_add_rms_norm(x, r, w, 1e-5)
    reference.fused_add_rms_norm(x_ref, r_ref, w, 1e-5)
    torch.testing.assert_close(r, r_ref, atol=0, rtol=0)  # the add is rounded exactly like torch's
    torch.testing.assert_close(x, x_ref, **tol(dtype))


def test_rms_norm_matches_hf_llama_norm(device):
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = hf.LlamaRMSNorm(64, eps=1e-5).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(5, 64, device=device)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, norm.weight.detach(), 1e-5)
    torch.testing.assert_close(out, norm(x).detach(), **tol(torch.float32))


def test_rms_norm_opcheck(device):
    x = torch.randn(4, 33, device=device)
    w = torch.randn(33, device=device)
    torch.library.opcheck(torch.ops.eecore.rms_norm.default, (torch.empty_like(x), x, w, 1e-6))
    torch.library.opcheck(torch.ops.eecore.fused_add_rms_norm.default, (x.clone(), x.clone(), w, 1e-6))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: (torch.empty(4, 8, device=d), torch.randn(4, 8, device=d), torch.randn(7, device=d)), "'weight'"),
        (lambda d: (torch.empty(4, 8, device=d), torch.randn(4, 8, device=d).half(), torch.randn(8, device=d)),
         "'weight'"),
        (lambda d: (torch.empty(4, 9, device=d), torch.randn(4, 8, device=d), torch.randn(8, device=d)), "'out'"),
        (lambda d: (torch.empty(4, 8, device=d), torch.randn(8, 4, device=d).T, torch.randn(8, device=d)),
         "'input'.*contiguous"),
        (lambda d: (torch.empty(4, 8, device=d, dtype=torch.int32), torch.ones(4, 8, device=d, dtype=torch.int32),
                    torch.ones(8, device=d, dtype=torch.int32)), "'input'.*dtype"),
    ],
)
def test_rms_norm_bad_arguments(device, make, message):
    out, x, w = make(device)
    with pytest.raises(RuntimeError, match=message):
        ops.rms_norm(out, x, w, 1e-6)


def test_rms_norm_negative_eps(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(RuntimeError, match="'eps'"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(8, device=device), -1.0)
