"""rotary_embedding_and_cache against eecore.testing.reference (rotary_embedding, then
reshape_and_cache of the rotated keys) and against the two ops it fuses: strided slices of one
QKV buffer as a layer passes them, NeoX and GPT-J, partial rotary, skipped slots, every dtype; on
CUDA under both kernels (EECORE_ROTARY_AND_CACHE_KERNEL: separate launches, or the fused one);
and bad input, which changes nothing."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES, poison, tol
from test_op_rotary_embedding import cos_sin_cache

KERNEL_ENV = "EECORE_ROTARY_AND_CACHE_KERNEL"


def layer_inputs(device, dtype, num_tokens, hq, hkv, head_dim, rot_dim, num_blocks=9, block_size=16, max_pos=200):
    """q/k/v as views of one fused [T, Hq + 2 Hkv, D] buffer (as llama.py slices its QKV output),
    poisoned caches, positions and distinct slots with every third token skipped."""
    qkv = torch.randn(num_tokens, hq + 2 * hkv, head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::3] = -1
    caches = [poison(torch.empty(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device))
              for _ in range(2)]
    return dict(qkv=qkv, positions=positions, slots=slots.to(device), caches=caches,
                cos_sin=cos_sin_cache(max_pos, rot_dim, device=device))


def split(qkv, hq, hkv):
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


@pytest.mark.parametrize("kernel", ["separate", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("shape", [(1, 9, 3, 64, 64), (7, 32, 8, 128, 128), (13, 4, 4, 80, 32), (33, 8, 2, 64, 16)])
def test_matches_reference_and_the_two_ops(device, dtype, is_neox, shape, kernel, monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, kernel)  # the CUDA kernel's selector; no effect on the CPU
    num_tokens, hq, hkv, head_dim, rot_dim = shape
    x = layer_inputs(device, dtype, num_tokens, hq, hkv, head_dim, rot_dim)
    runs = {}
    for name in ("op", "two ops", "reference"):
        qkv = x["qkv"].clone()
        k_cache, v_cache = (c.clone() for c in x["caches"])
        q, k, v = split(qkv, hq, hkv)
        if name == "op":
            ops.rotary_embedding_and_cache(x["positions"], q, k, v, x["cos_sin"], is_neox, k_cache, v_cache,
                                           x["slots"])
        elif name == "two ops":
            ops.rotary_embedding(x["positions"], q, k, x["cos_sin"], is_neox)
            ops.reshape_and_cache(k, v, k_cache, v_cache, x["slots"])
        else:
            reference.rotary_embedding_and_cache(x["positions"], q, k, v, x["cos_sin"], is_neox, k_cache, v_cache,
                                                 x["slots"])
        runs[name] = (qkv, k_cache, v_cache)
    for got, want in zip(runs["op"], runs["two ops"]):  # the same kernels' arithmetic: bit for bit
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    for got, want in zip(runs["op"], runs["reference"]):
        torch.testing.assert_close(got, want, equal_nan=True, **tol(dtype))
    written = x["slots"][x["slots"] >= 0]
    assert not runs["op"][1].flatten(0, 1)[written].isnan().any(), "a slot was not written"
    k_cache = runs["op"][1]
    assert k_cache.isnan().sum() == k_cache[0, 0].numel() * (k_cache.shape[0] * k_cache.shape[1] - len(written))


@pytest.mark.parametrize("kernel", ["separate", "fused"])
def test_empty_batch_is_a_no_op(device, kernel, monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, kernel)
    x = layer_inputs(device, torch.bfloat16, 0, 4, 2, 64, 64)
    q, k, v = split(x["qkv"], 4, 2)
    k_cache, v_cache = x["caches"]
    ops.rotary_embedding_and_cache(x["positions"], q, k, v, x["cos_sin"], True, k_cache, v_cache, x["slots"])
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_bad_slot_or_position_changes_nothing():
    """The CPU kernel raises, naming the argument, before either half writes."""
    x = layer_inputs("cpu", torch.float32, 5, 4, 2, 64, 64)
    for arg, bad in (("slot_mapping", x["slots"].clone().index_fill_(0, torch.tensor([4]), 10_000)),
                     ("positions", x["positions"].clone().index_fill_(0, torch.tensor([2]), 200))):
        qkv = x["qkv"].clone()
        k_cache, v_cache = (c.clone() for c in x["caches"])
        q, k, v = split(qkv, 4, 2)
        slots, positions = (bad, x["positions"]) if arg == "slot_mapping" else (x["slots"], bad)
        with pytest.raises(RuntimeError, match=f"rotary_embedding_and_cache.*'{arg}'"):
            ops.rotary_embedding_and_cache(positions, q, k, v, x["cos_sin"], True, k_cache, v_cache, slots)
        assert torch.equal(qkv, x["qkv"]) and k_cache.isnan().all() and v_cache.isnan().all()


def test_shape_errors_name_the_fused_op(device):
    x = layer_inputs(device, torch.float32, 5, 4, 2, 64, 64)
    q, k, v = split(x["qkv"], 4, 2)
    k_cache, v_cache = x["caches"]
    with pytest.raises(RuntimeError, match="rotary_embedding_and_cache.*'value'"):
        ops.rotary_embedding_and_cache(x["positions"], q, k, v[:, :1], x["cos_sin"], True, k_cache, v_cache,
                                       x["slots"])
    with pytest.raises(RuntimeError, match="rotary_embedding_and_cache.*'key'"):
        ops.rotary_embedding_and_cache(x["positions"], q, k[:3], v, x["cos_sin"], True, k_cache, v_cache, x["slots"])
    with pytest.raises(RuntimeError, match="rotary_embedding_and_cache.*'k_cache'"):
        ops.rotary_embedding_and_cache(x["positions"], q, k, v, x["cos_sin"], True, k_cache.to(torch.float64),
                                       v_cache, x["slots"])
