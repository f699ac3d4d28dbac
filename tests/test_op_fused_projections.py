"""The fused projections (qkv_projection, gate_up_projection, linear_residual) against the ops they
fuse and against eecore.testing.reference, on fresh random inputs: the shapes of SmolLM2 and Llama
layers, 1-8 rows (the GPU's fused kernels) and more (the separate ops), biases, skipped slots, a
feature count that is not a whole tile. On a GPU the separate ops run linear's gemv_mma kernel,
whose bits the fused kernels keep, so the two must agree bit for bit there too. Bad input raises,
naming the argument, and changes nothing."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES, poison, tol
from test_op_rotary_embedding import cos_sin_cache

# linear's few-row tensor-core kernel, whose bits the fused kernels keep (no effect on the CPU)
LINEAR_KERNEL = {"EECORE_LINEAR_KERNEL": "gemv_mma"}


@pytest.fixture(autouse=True)
def _gemv_mma(monkeypatch):
    for name, value in LINEAR_KERNEL.items():
        monkeypatch.setenv(name, value)


def _weight(n, k, dtype, device):
    return (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)


def _norm_inputs(rows, d, dtype, device):
    return torch.randn(rows, d, device=device).to(dtype), (1 + 0.1 * torch.randn(d, device=device)).to(dtype)


def _equal(a, b):
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def qkv_inputs(rows, d, hq, hkv, head_dim, dtype, device, bias, num_blocks=6, block_size=16, max_pos=300):
    hidden, norm_weight = _norm_inputs(rows, d, dtype, device)
    width = (hq + 2 * hkv) * head_dim
    slots = torch.randperm(num_blocks * block_size)[:rows]
    slots[1::3] = -1
    return dict(input=hidden, norm_weight=norm_weight, weight=_weight(width, d, dtype, device),
                bias=(0.1 * torch.randn(width, device=device)).to(dtype) if bias else None,
                positions=torch.randint(0, max_pos, (rows,), device=device),
                cos_sin=cos_sin_cache(max_pos, head_dim, device=device), slots=slots.to(device),
                cache_shape=(num_blocks, block_size, hkv, head_dim), width=width)


def run_qkv(fn, x, eps=1e-5):
    """`fn` (ops.qkv_projection or reference.qkv_projection) on poisoned outputs; returns them."""
    rows, d = x["input"].shape
    dtype, device = x["input"].dtype, x["input"].device
    out = poison(torch.empty(rows, x["width"], dtype=dtype, device=device))
    normed = poison(torch.empty(rows, d, dtype=dtype, device=device))
    k_cache, v_cache = (poison(torch.empty(x["cache_shape"], dtype=dtype, device=device)) for _ in range(2))
    fn(out, normed, x["input"], x["norm_weight"], eps, x["weight"], x["bias"], x["positions"], x["cos_sin"], True,
       k_cache, v_cache, x["slots"])
    return out, normed, k_cache, v_cache


def separate_qkv(out, normed, input, norm_weight, eps, weight, bias, positions, cos_sin, is_neox, k_cache, v_cache,
                 slots):
    """What a layer ran before the fused op: rms_norm, linear, rotary_embedding_and_cache."""
    ops.rms_norm(normed, input, norm_weight, eps)
    ops.linear(out, normed, weight, bias)
    hkv, head_dim = k_cache.shape[2:]
    q, k, v = out.split([out.shape[1] - 2 * hkv * head_dim, hkv * head_dim, hkv * head_dim], dim=1)
    rows = out.shape[0]
    ops.rotary_embedding_and_cache(positions, q.view(rows, -1, head_dim), k.view(rows, hkv, head_dim),
                                   v.view(rows, hkv, head_dim), cos_sin, is_neox, k_cache, v_cache, slots)


# (rows, d, Hq, Hkv, D): SmolLM2's layer, Llama-1B's heads on a narrower d, a small model, 8 rows of
# an 8B model's d (their normed rows need more than the default 48 KiB of shared memory); 12 rows
# take the separate ops on a GPU too
QKV_SHAPES = [(1, 576, 9, 3, 64), (8, 256, 32, 8, 64), (5, 128, 4, 2, 128), (3, 64, 2, 1, 32), (8, 4096, 2, 1, 64),
              (12, 96, 3, 1, 32)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", QKV_SHAPES)
def test_qkv_projection_matches_the_ops_it_fuses(device, dtype, shape, bias):
    rows, d, hq, hkv, head_dim = shape
    x = qkv_inputs(rows, d, hq, hkv, head_dim, dtype, device, bias)
    got = run_qkv(ops.qkv_projection, x)
    for a, b in zip(got, run_qkv(separate_qkv, x)):
        assert _equal(a, b)
    for a, b in zip(got, run_qkv(reference.qkv_projection, x)):
        torch.testing.assert_close(a, b, equal_nan=True, **tol(dtype, 2))
    k_cache, v_cache = got[2:]
    written = x["slots"][x["slots"] >= 0]
    for cache in (k_cache, v_cache):
        assert not cache.flatten(0, 1)[written].isnan().any(), "a slot was not written"
        assert cache.isnan().sum() == cache[0, 0].numel() * (cache.shape[0] * cache.shape[1] - len(written))
    assert not got[0].isnan().any() and not got[1].isnan().any()


def run_gate_up(fn, hidden, norm_weight, weight, eps=1e-6):
    rows, d = hidden.shape
    like = dict(dtype=hidden.dtype, device=hidden.device)
    act = poison(torch.empty(rows, weight.shape[0] // 2, **like))
    out = poison(torch.empty(rows, weight.shape[0], **like))
    normed = poison(torch.empty(rows, d, **like))
    fn(act, out, normed, hidden, norm_weight, eps, weight)
    return act, out, normed


def separate_gate_up(act, out, normed, input, norm_weight, eps, weight):
    ops.rms_norm(normed, input, norm_weight, eps)
    ops.linear(out, normed, weight)
    ops.silu_and_mul(act, out)


# (rows, d, I): SmolLM2's MLP, Llama-1B's d, a small one, an 8B model's d, and 9 rows
GATE_UP_SHAPES = [(1, 576, 1536), (8, 2048, 64), (4, 64, 24), (8, 4096, 32), (9, 128, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GATE_UP_SHAPES)
def test_gate_up_projection_matches_the_ops_it_fuses(device, dtype, shape):
    rows, d, inter = shape
    hidden, norm_weight = _norm_inputs(rows, d, dtype, device)
    weight = _weight(2 * inter, d, dtype, device)
    got = run_gate_up(ops.gate_up_projection, hidden, norm_weight, weight)
    for a, b in zip(got, run_gate_up(separate_gate_up, hidden, norm_weight, weight)):
        assert _equal(a, b)
    for a, b in zip(got, run_gate_up(reference.gate_up_projection, hidden, norm_weight, weight)):
        torch.testing.assert_close(a, b, **tol(dtype, 2))


# (rows, K, N): Llama-1B's output projection's K, an N that is not a whole tile of 16, 10 rows
RESIDUAL_SHAPES = [(1, 2048, 64), (8, 576, 576), (3, 64, 40), (10, 96, 32)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RESIDUAL_SHAPES)
def test_linear_residual_matches_linear_then_add(device, dtype, shape, bias):
    rows, k, n = shape
    input = torch.randn(rows, k, device=device).to(dtype)
    weight = _weight(n, k, dtype, device)
    b = (0.1 * torch.randn(n, device=device)).to(dtype) if bias else None
    residual = torch.randn(rows, n, device=device).to(dtype)
    runs = {}
    for name in ("op", "separate", "reference"):
        out, res = poison(torch.empty(rows, n, dtype=dtype, device=device)), residual.clone()
        if name == "op":
            ops.linear_residual(out, res, input, weight, b)
        elif name == "separate":
            ops.linear(out, input, weight, b)
            res.add_(out)
        else:
            reference.linear_residual(out, res, input, weight, b)
        runs[name] = (out, res)
    for a, want in zip(runs["op"], runs["separate"]):
        assert _equal(a, want)
    for a, want in zip(runs["op"], runs["reference"]):
        torch.testing.assert_close(a, want, **tol(dtype, 2))


def test_empty_batch_is_a_no_op(device):
    x = qkv_inputs(0, 64, 2, 1, 32, torch.bfloat16, device, bias=False)
    out, normed, k_cache, v_cache = run_qkv(ops.qkv_projection, x)
    assert k_cache.isnan().all() and v_cache.isnan().all()
    act, gate_up, normed = run_gate_up(ops.gate_up_projection, x["input"], x["norm_weight"],
                                       _weight(48, 64, torch.bfloat16, device))
    assert act.numel() == 0


def test_bad_input_names_the_argument_and_changes_nothing():
    x = qkv_inputs(4, 64, 2, 1, 32, torch.float32, "cpu", bias=True)
    out = torch.zeros(4, x["width"])
    normed = torch.zeros(4, 64)
    k_cache, v_cache = torch.zeros(x["cache_shape"]), torch.zeros(x["cache_shape"])

    def call(**bad):
        args = dict(out=out, normed=normed, input=x["input"], norm_weight=x["norm_weight"], eps=1e-5,
                    weight=x["weight"], bias=x["bias"], positions=x["positions"], cos_sin_cache=x["cos_sin"],
                    is_neox=True, k_cache=k_cache, v_cache=v_cache, slot_mapping=x["slots"])
        args.update(bad)
        ops.qkv_projection(**args)

    cases = [
        (dict(weight=x["weight"][:, :32]), "weight"),
        (dict(weight=x["weight"].to(torch.int8)), "weight"),
        (dict(normed=torch.zeros(4, 32)), "normed"),
        (dict(norm_weight=torch.ones(32)), "norm_weight"),
        (dict(out=torch.zeros(4, x["width"] + 32)), "out"),
        (dict(bias=torch.zeros(3)), "bias"),
        (dict(eps=-1.0), "eps"),
        (dict(normed=x["input"]), "normed"),  # an in-place norm: one launch cannot do it
        (dict(positions=x["positions"].clone().fill_(10_000)), "positions"),
        (dict(slot_mapping=x["slots"].clone().fill_(10_000)), "slot_mapping"),
    ]
    for bad, arg in cases:
        with pytest.raises(RuntimeError, match=f"qkv_projection.*'{arg}'"):
            call(**bad)
        assert not out.any() and not normed.any() and not k_cache.any() and not v_cache.any(), bad

    hidden, norm_weight = _norm_inputs(2, 64, torch.float32, "cpu")
    weight = _weight(48, 64, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="gate_up_projection.*'act'"):
        ops.gate_up_projection(torch.zeros(2, 23), torch.zeros(2, 48), torch.zeros(2, 64), hidden, norm_weight, 1e-6,
                               weight)
    residual = torch.zeros(2, 48)
    with pytest.raises(RuntimeError, match="linear_residual.*'residual'"):
        ops.linear_residual(torch.zeros(2, 48), torch.zeros(2, 40), hidden, weight)
    out = torch.zeros(2, 48)
    with pytest.raises(RuntimeError, match="linear_residual.*'residual'"):
        ops.linear_residual(out, out, torch.zeros(2, 64), weight)
    with pytest.raises(RuntimeError, match="linear_residual.*'input'"):
        ops.linear_residual(torch.zeros(2, 48), residual, hidden.t(), weight)


def test_opcheck(device):
    """The schemas' mutation annotations, the fake implementations and dispatch agree with what the
    ops do (torch.library.opcheck)."""
    x = qkv_inputs(2, 64, 2, 1, 32, torch.bfloat16, device, bias=True)
    rows, d = x["input"].shape
    like = dict(dtype=torch.bfloat16, device=device)
    k_cache, v_cache = (torch.zeros(x["cache_shape"], **like) for _ in range(2))
    torch.library.opcheck(torch.ops.eecore.qkv_projection.default,
                          (torch.empty(rows, x["width"], **like), torch.empty(rows, d, **like), x["input"],
                           x["norm_weight"], 1e-5, x["weight"], x["bias"], x["positions"], x["cos_sin"], True,
                           k_cache, v_cache, x["slots"]))
    weight = _weight(48, d, torch.bfloat16, device)
    torch.library.opcheck(torch.ops.eecore.gate_up_projection.default,
                          (torch.empty(rows, 24, **like), torch.empty(rows, 48, **like), torch.empty(rows, d, **like),
                           x["input"], x["norm_weight"], 1e-6, weight))
    torch.library.opcheck(torch.ops.eecore.linear_residual.default,
                          (torch.empty(rows, 48, **like), torch.zeros(rows, 48, **like), x["input"], weight, None))
