"""rotary_embedding against eecore.testing.reference (and HF transformers' Llama RoPE)."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES, tol


def cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0, dtype=torch.float32, device="cpu"):
    """vLLM's layout: row p = cat(cos(p * inv_freq), sin(p * inv_freq)), rot_dim / 2 each."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


def run_both(positions, query, key, cache, is_neox):
    """Runs the op and the reference on clones; returns (op query, op key, ref query, ref key)."""
    q, k = query.clone(), key.clone()
    q_ref, k_ref = query.clone(), key.clone()
    ops.rotary_embedding(positions, q, k, cache, is_neox)
    reference.rotary_embedding(positions, q_ref, k_ref, cache, is_neox)
    return q, k, q_ref, k_ref


# (T, Hq, Hkv, D, rot_dim): decode and prefill sizes, GQA 1/2/4/8, odd T, partial rotary; NeoX
# halves of whole vectors of 8 (the CPU's vector path) and not (20: its scalar loop).
SHAPES = [
    (3, 4, 2, 64, 20),
    (1, 32, 8, 64, 64),
    (7, 4, 4, 128, 128),
    (13, 6, 3, 80, 32),
    (5, 8, 1, 64, 16),
    (33, 16, 2, 96, 48),
    (0, 4, 2, 64, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cache_in_activation_dtype", [False, True])
def test_rotary_embedding_matches_reference(device, dtype, is_neox, shape, cache_in_activation_dtype):
    num_tokens, hq, hkv, head_dim, rot_dim = shape
    max_pos = 300
    cache = cos_sin_cache(max_pos, rot_dim, dtype=dtype if cache_in_activation_dtype else torch.float32,
                          device=device)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device)
    if num_tokens > 1:
        positions[0], positions[-1] = 0, max_pos - 1  # both ends of the cache
    query = torch.randn(num_tokens, hq, head_dim, dtype=dtype, device=device)
    key = torch.randn(num_tokens, hkv, head_dim, dtype=dtype, device=device)

    q, k, q_ref, k_ref = run_both(positions, query, key, cache, is_neox)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k, k_ref, **tol(dtype))
    # Partial rotary: the dims past rot_dim pass through bit for bit.
    torch.testing.assert_close(q[..., rot_dim:], query[..., rot_dim:], atol=0, rtol=0)
    torch.testing.assert_close(k[..., rot_dim:], key[..., rot_dim:], atol=0, rtol=0)
    if num_tokens and rot_dim:  # and the rotated dims did change (the test can fail)
        moved = positions != 0
        if moved.any():
            assert not torch.equal(q[moved][..., :rot_dim], query[moved][..., :rot_dim])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_on_views_of_a_fused_qkv_buffer(device, dtype, is_neox):
    # query and key are strided views into one [T, (Hq + 2 Hkv) * D + pad] projection output, as a
    # fused qkv GEMM leaves them. The V part and the padding must not change.
    num_tokens, hq, hkv, head_dim, pad = 9, 8, 2, 64, 5
    q_width, kv_width = hq * head_dim, hkv * head_dim
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width + pad, dtype=dtype, device=device)
    qkv[:, -pad:] = float("nan")
    original = qkv.clone()
    query = qkv[:, :q_width].view(num_tokens, hq, head_dim)
    key = qkv[:, q_width:q_width + kv_width].view(num_tokens, hkv, head_dim)
    assert not query.is_contiguous()
    cache = cos_sin_cache(64, head_dim, device=device)
    positions = torch.randint(0, 64, (num_tokens,), device=device)

    q_ref, k_ref = query.contiguous(), key.contiguous()
    reference.rotary_embedding(positions, q_ref, k_ref, cache, is_neox)
    ops.rotary_embedding(positions, query, key, cache, is_neox)
    torch.testing.assert_close(query, q_ref, **tol(dtype))
    torch.testing.assert_close(key, k_ref, **tol(dtype))
    torch.testing.assert_close(qkv[:, q_width + kv_width:], original[:, q_width + kv_width:], atol=0, rtol=0,
                               equal_nan=True)


def test_rotary_embedding_on_head_major_views(device):
    # [H, T, D] storage seen as [T, H, D]: the token stride is smaller than the head stride.
    def head_major(x):
        return x.transpose(0, 1).contiguous().transpose(0, 1)

    num_tokens, hq, hkv, head_dim = 6, 4, 2, 32
    query = torch.randn(num_tokens, hq, head_dim, device=device)
    key = torch.randn(num_tokens, hkv, head_dim, device=device)
    cache = cos_sin_cache(16, head_dim, device=device)
    positions = torch.randint(0, 16, (num_tokens,), device=device)
    q, k = head_major(query), head_major(key)
    assert q.stride(0) < q.stride(1)
    q_ref, k_ref = query.clone(), key.clone()
    ops.rotary_embedding(positions, q, k, cache, True)
    reference.rotary_embedding(positions, q_ref, k_ref, cache, True)
    torch.testing.assert_close(q, q_ref, **tol(torch.float32))
    torch.testing.assert_close(k, k_ref, **tol(torch.float32))


def test_rotary_embedding_matches_hf_llama(device):
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    num_tokens, hq, hkv, head_dim, base = 11, 8, 2, 64, 500000.0
    positions = torch.randint(0, 1000, (num_tokens,), device=device)
    query = torch.randn(num_tokens, hq, head_dim, device=device)
    key = torch.randn(num_tokens, hkv, head_dim, device=device)
    # HF's cos/sin [T, D] repeat the rot_dim / 2 frequencies twice (rotate_half, i.e. NeoX). The
    # angles are taken in fp64 as in our cache: HF's fp32 angles drift by ~1e-4 at position 1000.
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    emb = torch.cat([positions[:, None].double() * inv_freq] * 2, dim=-1)
    q_hf, k_hf = hf.apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                         emb.cos().float()[None], emb.sin().float()[None])
    q, k = query.clone(), key.clone()
    ops.rotary_embedding(positions, q, k, cos_sin_cache(1000, head_dim, base, device=device), True)
    torch.testing.assert_close(q, q_hf[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k, k_hf[0].transpose(0, 1), atol=1e-4, rtol=1e-4)


def test_rotary_embedding_opcheck(device):
    query = torch.randn(5, 4, 32, device=device)
    key = torch.randn(5, 2, 32, device=device)
    cache = cos_sin_cache(20, 16, device=device)
    positions = torch.randint(0, 20, (5,), device=device)
    for is_neox in (True, False):
        torch.library.opcheck(torch.ops.eecore.rotary_embedding.default,
                              (positions, query.clone(), key.clone(), cache, is_neox))


def _valid(device):
    return dict(positions=torch.tensor([0, 3, 7], device=device),
                query=torch.randn(3, 4, 16, device=device),
                key=torch.randn(3, 2, 16, device=device),
                cos_sin_cache=cos_sin_cache(8, 16, device=device))


BAD_ARGUMENTS = [
    # (what to replace, a function of the valid arguments, the message)
    ("positions", lambda a: a["positions"].int(), "'positions'.*dtype"),
    ("positions", lambda a: a["positions"][:2], "'positions'.*number of tokens"),
    ("positions", lambda a: a["positions"][None], "'positions'.*1-D"),
    ("query", lambda a: a["query"].flatten(1), "'query'.*3-D"),
    ("query", lambda a: a["query"].int(), "'query'.*dtype"),
    ("query", lambda a: a["query"].transpose(1, 2), "'query'.*unit stride"),
    ("query", lambda a: a["query"][:, :1].expand(3, 4, 16), "'query'.*overlapping"),
    ("key", lambda a: a["key"].half(), "'key'.*dtype"),
    ("key", lambda a: a["key"][:2], "'key'.*number of tokens"),
    ("key", lambda a: a["key"][..., :8], "'key'.*head dim"),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"][:, :15], "'cos_sin_cache'.*even"),
    ("cos_sin_cache", lambda a: torch.cat([a["cos_sin_cache"]] * 2, dim=1), "'cos_sin_cache'.*<= the head dim"),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"].half(), "'cos_sin_cache'.*dtype"),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"][None], "'cos_sin_cache'.*2-D"),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"].t().contiguous().t(), "'cos_sin_cache'.*contiguous"),
]


@pytest.mark.parametrize("name, make, message", BAD_ARGUMENTS)
def test_rotary_embedding_bad_arguments(device, name, make, message):
    args = _valid(device)
    args[name] = make(args)
    with pytest.raises(RuntimeError, match=message):
        ops.rotary_embedding(args["positions"], args["query"], args["key"], args["cos_sin_cache"], True)


@pytest.mark.parametrize("bad_position", [-1, 8, 1 << 40])
def test_rotary_embedding_position_out_of_cache(bad_position):
    # The CPU kernel reads the positions, raises, and leaves query and key untouched.
    args = _valid("cpu")
    args["positions"][1] = bad_position
    query, key = args["query"].clone(), args["key"].clone()
    with pytest.raises(RuntimeError, match=r"'positions'.*\[0, 8\)"):
        ops.rotary_embedding(args["positions"], query, key, args["cos_sin_cache"], True)
    assert torch.equal(query, args["query"]) and torch.equal(key, args["key"])
