"""mlp_confidence against eecore.testing.reference: sigmoid(w2 . relu(w1 h + b1) + b2), CALM's classifier."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES

CONF_TOL = dict(rtol=1e-5, atol=1e-6)


def make_classifier(d, m, dtype, device):
    """Weights whose pre-sigmoid logit is O(1), so the output is not saturated at 0 or 1."""
    w1 = (torch.randn(m, d, device=device) / d**0.5).to(dtype)
    b1 = (torch.randn(m, device=device) * 0.1).to(dtype)
    w2 = (torch.randn(m, device=device) * 2 / max(m, 1) ** 0.5).to(dtype)
    b2 = (torch.randn(1, device=device) * 0.1).to(dtype)
    return w1, b1, w2, b2


def assert_matches_reference(hidden, *weights):
    conf = ops.mlp_confidence(hidden, *weights)
    assert conf.dtype == torch.float32 and conf.shape == (hidden.shape[0],)
    torch.testing.assert_close(conf, reference.mlp_confidence(hidden, *weights), **CONF_TOL)
    return conf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, d, m", [(1, 7, 1), (3, 577, 130), (8, 576, 128), (17, 64, 65), (8, 2048, 512),
                                         (2, 33, 1000)])
def test_mlp_confidence_matches_reference(device, dtype, batch, d, m):
    hidden = torch.randn(batch, d, device=device).to(dtype)
    conf = assert_matches_reference(hidden, *make_classifier(d, m, dtype, device))
    assert batch < 8 or ((conf > 0.02) & (conf < 0.98)).any()  # a live classifier, not a saturated one


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mlp_confidence_fp32_weights_with_half_hidden(device, dtype):
    # A classifier trained (and kept) in fp32 serves a bf16/fp16 model without a cast.
    hidden = torch.randn(5, 200, device=device).to(dtype)
    assert_matches_reference(hidden, *make_classifier(200, 48, torch.float32, device))


def test_mlp_confidence_zero_width(device):
    # m = 0: no hidden units, the classifier is the constant sigmoid(b2).
    hidden = torch.randn(3, 16, device=device)
    w1, b1, w2, b2 = make_classifier(16, 0, torch.float32, device)
    conf = assert_matches_reference(hidden, w1, b1, w2, b2)
    torch.testing.assert_close(conf, torch.sigmoid(b2).expand(3))


def test_mlp_confidence_saturates_cleanly(device):
    hidden = torch.randn(2, 64, device=device)
    w1, b1, w2, b2 = make_classifier(64, 32, torch.float32, device)
    for shift, expected in ((1e4, 1.0), (-1e4, 0.0)):
        conf = assert_matches_reference(hidden, w1, b1, w2, b2 + shift)
        assert conf.tolist() == [expected, expected]


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_confidence_strided(device, dtype):
    hidden = torch.randn(10, 2 * 97, device=device).to(dtype)[::2, 97:]
    w1, b1, w2, b2 = make_classifier(97, 40, dtype, device)
    w1_padded = torch.zeros(40, 101, device=device, dtype=dtype)
    w1_padded[:, 2:99] = w1
    b1_strided = torch.stack([b1, b1]).T[:, 1]
    assert_matches_reference(hidden, w1_padded[:, 2:99], b1_strided, w2.repeat(3)[::3], b2)


def test_mlp_confidence_empty_batch(device):
    assert ops.mlp_confidence(torch.randn(0, 8, device=device), *make_classifier(8, 4, torch.float32, device)).shape == (0,)


def test_mlp_confidence_opcheck(device):
    for dtype in DTYPES:
        hidden = torch.randn(3, 45, device=device).to(dtype)
        torch.library.opcheck(torch.ops.eecore.mlp_confidence.default, (hidden, *make_classifier(45, 70, dtype, device)))


def _args(device, d=16, m=8, **override):
    args = dict(hidden=torch.randn(3, d, device=device), w1=torch.randn(m, d, device=device),
                b1=torch.randn(m, device=device), w2=torch.randn(m, device=device), b2=torch.randn(1, device=device))
    args.update({k: v(device) for k, v in override.items()})
    return args


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(hidden=lambda d: torch.randn(16, device=d)), "'hidden'.*2-D"),
        (dict(hidden=lambda d: torch.ones(3, 16, device=d, dtype=torch.int32)), "'hidden'.*dtype"),
        (dict(hidden=lambda d: torch.randn(16, 3, device=d).T), "'hidden'.*unit stride"),
        (dict(hidden=lambda d: torch.randn(3, 0, device=d), w1=lambda d: torch.randn(8, 0, device=d)), "'hidden'.*d >= 1"),
        (dict(w1=lambda d: torch.randn(8, 15, device=d)), "'w1'.*hidden size"),
        (dict(w1=lambda d: torch.randn(8, device=d)), "'w1'.*2-D"),
        (dict(w1=lambda d: torch.randn(8, 16, device=d).half()), "'w1'.*dtype"),
        (dict(b1=lambda d: torch.randn(7, device=d)), "'b1'.*width m"),
        (dict(b1=lambda d: torch.randn(8, device=d).half()), "'b1'.*dtype"),
        (dict(w2=lambda d: torch.randn(1, 8, device=d)), "'w2'.*1-D"),
        (dict(w2=lambda d: torch.randn(9, device=d)), "'w2'.*width m"),
        (dict(b2=lambda d: torch.randn((), device=d)), "'b2'.*1-D"),
        (dict(b2=lambda d: torch.randn(2, device=d)), "'b2'"),
        (dict(b2=lambda d: torch.randn(1, device=d, dtype=torch.float64)), "'b2'.*dtype"),
    ],
)
def test_mlp_confidence_bad_arguments(device, override, message):
    with pytest.raises(RuntimeError, match=message):
        ops.mlp_confidence(**_args(device, **override))


def test_mlp_confidence_half_weights_need_half_hidden(device):
    args = _args(device)
    args.update(w1=args["w1"].bfloat16(), b1=args["b1"].bfloat16(), w2=args["w2"].bfloat16(), b2=args["b2"].bfloat16())
    with pytest.raises(RuntimeError, match="'w1'.*dtype"):
        ops.mlp_confidence(**args)  # fp32 hidden with bf16 weights: only fp32 weights serve any hidden
