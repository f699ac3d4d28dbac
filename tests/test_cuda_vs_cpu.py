"""Every op on CUDA against its CPU kernel and its fp32 reference, on the same random inputs.

The per-op tests (test_op_*.py) already run on CUDA when a GPU is visible; these add what is
specific to the CUDA kernels: the shapes that pick each kernel variant (decode split-K, tensor-core
prefill with packed GQA rows, SIMT fallbacks for fp32, odd head dims and unaligned views), the
flash-attn accuracy bound for bf16/fp16 (error <= 3x PyTorch's own error at that dtype), and the
device-side guards that replace the CPU's data-dependent errors (no raise, no out-of-bounds write).
Skipped where no GPU is visible.
"""
from __future__ import annotations

import math

import pytest
import torch

from eecore import ops
from eecore.testing import reference
from cuda_tests import CUDA_MARKS
from op_utils import DTYPES, assert_within_torch_error, poison, random_block_tables, tol

pytestmark = CUDA_MARKS

LOW_PRECISION = [torch.bfloat16, torch.float16]


@pytest.fixture(params=["auto", "decode", "decode_mma", "decode_mma-2stages", "decode_mma-4stages", "decode_mma-v1",
                        "decode_mma-v2", "decode_mma-lookahead", "decode_mma-splits64", "rows", "mma"])
def attention_kernel(request, monkeypatch):
    """Each paged-attention kernel forced in turn (EECORE_PAGED_ATTENTION_KERNEL, read on every call;
    a kernel that cannot take a shape, e.g. decode or mma for fp32, leaves it to the planner), so
    every kernel is held to the same oracle on the same shapes, whichever the planner prefers.
    "decode_mma-2stages" / "-4stages" is decode_mma with EECORE_DECODE_MMA_STAGES=2 / 4 (4: D <= 64
    only, the others run 3), "decode_mma-v1" / "-v2" with
    EECORE_DECODE_MMA_LDMATRIX=0 / 1 (its first version, or v2: ldmatrix fragments,
    whole-tile copies and masks, lazy rescaling), "decode_mma-lookahead" with every v2 flag and the
    block ids looked up a round ahead (EECORE_DECODE_MMA_V2_FLAGS=31), "decode_mma-splits64" with
    context splits as short as one tile of 64 keys (EECORE_DECODE_MIN_SPLIT_TOKENS=64: short
    contexts split and combined too)."""
    kernel, _, variant = request.param.partition("-")
    monkeypatch.setenv("EECORE_PAGED_ATTENTION_KERNEL", kernel)
    if variant in ("2stages", "4stages"):
        monkeypatch.setenv("EECORE_DECODE_MMA_STAGES", variant[0])
    if variant in ("v1", "v2"):
        monkeypatch.setenv("EECORE_DECODE_MMA_LDMATRIX", "0" if variant == "v1" else "1")
    if variant == "lookahead":
        monkeypatch.setenv("EECORE_DECODE_MMA_V2_FLAGS", "31")
    if variant == "splits64":
        monkeypatch.setenv("EECORE_DECODE_MIN_SPLIT_TOKENS", "64")
    return request.param


def cuda(*tensors):
    out = tuple(None if t is None else t.cuda() for t in tensors)
    return out if len(out) > 1 else out[0]


def cpu(*tensors):
    out = tuple(None if t is None else t.cpu() for t in tensors)
    return out if len(out) > 1 else out[0]


# ---- paged_attention -----------------------------------------------------------------------

def make_attention(dtype, seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, causal=True,
                   max_distance=None, extra_rows=0):
    """CPU tensors of one batch; the caches are a layer view of a [L, 2, NB, BS, Hkv, D] tensor."""
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 2
    kv = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return dict(
        query=torch.randn(starts[-1] + extra_rows, num_q_heads, head_dim, dtype=dtype),
        k_cache=kv[1, 0], v_cache=kv[1, 1],
        block_table=random_block_tables(seq_lens, block_size, num_blocks),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q_lens), scale=head_dim ** -0.5, causal=causal,
        position_bias=None if max_distance is None else torch.randn(num_q_heads, max_distance),
    )


def attention_args(case, out, device):
    move = (lambda t: t.to(device)) if device is not None else (lambda t: t)
    return (out, move(case["query"]), move(case["k_cache"]), move(case["v_cache"]), move(case["block_table"]),
            move(case["seq_lens"]), move(case["query_start_loc"]), case["max_query_len"], case["scale"],
            case["causal"], None if case["position_bias"] is None else move(case["position_bias"]))


def attention_in_dtype(case):
    """The same attention computed by PyTorch in the cache dtype on the GPU (flash-attn's "pt" run):
    bf16/fp16 matmuls, softmax rounded to the dtype."""
    q_all, k_cache, v_cache = cuda(case["query"], case["k_cache"], case["v_cache"])
    out = torch.zeros_like(q_all)
    group = q_all.shape[1] // k_cache.shape[2]
    starts = case["query_start_loc"].tolist()
    for b, seq_len in enumerate(case["seq_lens"].tolist()):
        q = q_all[starts[b]:starts[b + 1]]
        if q.shape[0] == 0:
            continue
        table = cuda(case["block_table"][b])
        k = reference.gather_kv(k_cache, table, seq_len).repeat_interleave(group, dim=1)
        v = reference.gather_kv(v_cache, table, seq_len).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case["scale"]
        distance = (torch.arange(seq_len - q.shape[0], seq_len, device="cuda")[:, None]
                    - torch.arange(seq_len, device="cuda")[None, :])
        if case["position_bias"] is not None:
            bias = cuda(case["position_bias"])[:, distance.clamp(0, case["position_bias"].shape[1] - 1)]
            scores = scores + bias.to(scores.dtype)
        if case["causal"]:
            scores = scores.masked_fill(distance[None] < 0, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[b]:starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def check_attention(case, cpu_too=True):
    dtype = case["query"].dtype
    out = poison(torch.empty_like(case["query"], device="cuda"))
    ops.paged_attention(*attention_args(case, out, "cuda"))
    torch.cuda.synchronize()
    rows = int(case["query_start_loc"][-1])
    assert not out[:rows].isnan().any(), "rows that must be written were not"
    assert out[rows:].isnan().all(), "rows no sequence owns were written"

    expected = torch.empty(case["query"].shape, dtype=torch.float32)  # fp32 oracle output
    reference.paged_attention(*attention_args(case, expected, None))
    if dtype == torch.float32:
        torch.testing.assert_close(out[:rows].cpu(), expected[:rows], atol=2e-5, rtol=2e-5)
    else:
        assert_within_torch_error(out[:rows], expected[:rows], attention_in_dtype(case)[:rows])
    if cpu_too:
        on_cpu = poison(torch.empty_like(case["query"]))
        ops.paged_attention(*attention_args(case, on_cpu, None))
        torch.testing.assert_close(out[:rows].cpu(), on_cpu[:rows], **tol(dtype, 2.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (12, 3), (16, 1), (40, 2)])  # G = 1, 4, 4, 16, 20
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode(dtype, heads, block_size, attention_kernel):
    # Short and long contexts in one batch; with only a few sequences the kernel splits the
    # context (flash-decoding) and the combine pass merges the splits.
    case = make_attention(dtype, [1, 17, 300, 2500], [1, 1, 1, 1], *heads, head_dim=128, block_size=block_size)
    check_attention(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 80, 96, 128, 256, 20, 7])
def test_decode_head_dims(dtype, head_dim, attention_kernel):
    case = make_attention(dtype, [3, 64, 700], [1, 1, 1], 8, 2, head_dim=head_dim, block_size=16)
    check_attention(case)


def test_decode_large_batch_no_split(attention_kernel):
    # 160 sequences x 8 KV heads = 1280 CTAs fill an A100 or H100 (>= 8 per SM): no context split.
    case = make_attention(torch.bfloat16, [50 + 7 * i for i in range(160)], [1] * 160, 16, 8, 64, 16)
    check_attention(case, cpu_too=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (12, 3), (16, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 256, 32, 20])
def test_prefill_varlen(dtype, heads, head_dim):
    # Empty, decode, fresh prefill, chunked prefill and a d+1 = 5 token verification in one batch.
    case = make_attention(dtype, [9, 40, 37, 300, 130, 64], [0, 1, 37, 70, 5, 64], *heads, head_dim=head_dim,
                          block_size=16)
    check_attention(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [2, 5, 9])
def test_verification_long_context_splits(dtype, q_len, attention_kernel):
    # Few short queries over a long context: the tensor-core kernel splits the context too.
    case = make_attention(dtype, [3000, 1500], [q_len, q_len], 32, 8, 128, 16)
    check_attention(case)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("stages", ["2", "3", "4"])
@pytest.mark.parametrize("v2_flags", ["0", "7", "15", "31"])
@pytest.mark.parametrize("shape", [
    dict(heads=(32, 8), head_dim=128, block_size=16, q_lens=[1, 1, 1, 1]),    # decode, G = 4
    dict(heads=(32, 4), head_dim=64, block_size=32, q_lens=[1, 1, 1, 1]),     # G = 8, two row tiles at D = 64
    dict(heads=(12, 3), head_dim=128, block_size=1, q_lens=[5, 3, 1, 2]),     # verification rows, block size 1
    dict(heads=(16, 2), head_dim=256, block_size=16, q_lens=[2, 2, 2, 2]),    # D = 256
    dict(heads=(8, 2), head_dim=128, block_size=24, q_lens=[1, 4, 1, 1]),     # a block size that is no power of two
])
def test_decode_mma_versions_agree_bit_for_bit(dtype, stages, v2_flags, shape, monkeypatch):
    """decode_mma v2 (ldmatrix fragments; with flags 7 also whole-tile copies and masks and lazy
    rescaling, with 15 also Q's load overlapped with the first tiles', with 31 also the block ids
    looked up a round ahead) against its first version:
    the same arithmetic in the same order (a skipped rescale multiplies by exactly 1, a skipped mask
    passes every key), so the outputs must be identical."""
    case = make_attention(dtype, [1, 40, 700, 2100], shape["q_lens"], *shape["heads"], head_dim=shape["head_dim"],
                          block_size=shape["block_size"])
    monkeypatch.setenv("EECORE_PAGED_ATTENTION_KERNEL", "decode_mma")
    monkeypatch.setenv("EECORE_DECODE_MMA_STAGES", stages)
    monkeypatch.setenv("EECORE_DECODE_MMA_V2_FLAGS", v2_flags)
    outs = []
    for version in ("1", "0"):
        monkeypatch.setenv("EECORE_DECODE_MMA_LDMATRIX", version)
        out = poison(torch.empty_like(case["query"], device="cuda"))
        ops.paged_attention(*attention_args(case, out, "cuda"))
        outs.append(out)
    torch.cuda.synchronize()
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [5, 3, 1, 2]])
def test_decode_mma_pipeline_depths_agree_bit_for_bit(dtype, q_lens, monkeypatch, batch_invariant):
    """2, 3 and 4 stages change how many tiles a warp has in flight, not what it computes: at D = 64
    (where all three run) the outputs are identical. Under batch invariance, since the depth changes
    how many CTAs fit an SM, and with it how many context splits the planner chooses otherwise."""
    case = make_attention(dtype, [1, 40, 700, 2100], q_lens, 32, 8, head_dim=64, block_size=16)
    monkeypatch.setenv("EECORE_PAGED_ATTENTION_KERNEL", "decode_mma")
    outs = []
    for stages in ("2", "3", "4"):
        monkeypatch.setenv("EECORE_DECODE_MMA_STAGES", stages)
        out = poison(torch.empty_like(case["query"], device="cuda"))
        ops.paged_attention(*attention_args(case, out, "cuda"))
        outs.append(out)
    torch.cuda.synchronize()
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("max_distance", [None, 8, 64])
def test_causal_and_position_bias(dtype, causal, max_distance, attention_kernel):
    case = make_attention(dtype, [20, 45, 70], [20, 3, 1], 8, 4, 64, 5, causal=causal, max_distance=max_distance)
    check_attention(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_attention_more_queries_than_keys(dtype, attention_kernel):
    # causal=False (T5 cross-attention): q_len may exceed seq_len.
    case = make_attention(dtype, [7, 30], [19, 40], 8, 8, 64, 16, causal=False, max_distance=16)
    check_attention(case)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_rows_past_the_batch_are_untouched(dtype, attention_kernel):
    # The CUDA glue cannot read query_start_loc without a sync, so the kernels must leave the rows
    # past its end alone. The CPU kernel reads it and rejects the mismatch instead (test_op_*).
    case = make_attention(dtype, [30, 12], [4, 1], 8, 2, 64, 16, extra_rows=3)
    check_attention(case, cpu_too=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_and_strided_views(dtype, attention_kernel):
    # A query slice of a fused QKV buffer (strided heads), and one starting one element off a
    # 16-byte boundary: the kernels fall back from cp.async/mma to scalar loads.
    case = make_attention(dtype, [50, 9], [50, 1], 8, 2, 64, 16)
    num_tokens = case["query"].shape[0]
    fused = torch.randn(num_tokens, 12, 64, dtype=dtype)
    fused[:, :8] = case["query"]
    case["query"] = fused[:, :8]
    check_attention(case)
    flat = torch.randn(num_tokens * 8 * 64 + 1, dtype=dtype)
    shifted = flat[1:].view(num_tokens, 8, 64)
    shifted.copy_(case["query"])
    case["query"] = shifted
    check_attention(case)


def test_invalid_block_ids_are_skipped_not_read(attention_kernel):
    # Block ids come from device memory: an out-of-range one cannot raise on the GPU without a
    # synchronization, so the kernels treat its keys as absent. Nothing may fault.
    case = make_attention(torch.bfloat16, [40, 40], [1, 8], 8, 2, 64, 16)
    case["block_table"][0, 1] = 10 ** 6
    case["block_table"][1, 0] = -7
    out = torch.zeros(case["query"].shape, dtype=torch.bfloat16, device="cuda")
    ops.paged_attention(*attention_args(case, out, "cuda"))
    torch.cuda.synchronize()
    assert out.isfinite().all()


# ---- reshape_and_cache ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 20])
def test_reshape_and_cache(dtype, head_dim):
    num_blocks, block_size, heads, tokens = 9, 16, 4, 37
    fused = torch.randn(tokens, 3 * heads, head_dim, dtype=dtype)  # key/value as strided slices
    key, value = fused[:, heads:2 * heads], fused[:, 2 * heads:]
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[::5] = -1
    k_cache = torch.randn(num_blocks, block_size, heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_gpu, v_gpu = cuda(k_cache.clone(), v_cache.clone())
    ops.reshape_and_cache(*cuda(key, value), k_gpu, v_gpu, cuda(slots))
    ops.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_gpu.cpu(), k_cache) and torch.equal(v_gpu.cpu(), v_cache)


def test_reshape_and_cache_skips_out_of_range_slots():
    k_cache = torch.zeros(4, 8, 2, 64, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 2, 64, device="cuda")
    slots = torch.tensor([5, 4 * 8, 10 ** 9], device="cuda")
    ops.reshape_and_cache(key, key, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    assert k_cache.sum().item() == 2 * 64 and k_cache[0, 5].eq(1).all()


# ---- rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding -------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (33, 2048), (5, 8192), (4, 1000)])
def test_rms_norms(dtype, shape):
    x, r, w = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), torch.randn(shape[-1], dtype=dtype)
    out = cuda(poison(torch.empty_like(x)))
    ops.rms_norm(out, *cuda(x, w), 1e-6)
    expected = torch.empty_like(x)
    ops.rms_norm(expected, x, w, 1e-6)
    torch.testing.assert_close(out.cpu(), expected, **tol(dtype))
    xg, rg = cuda(x.clone(), r.clone())
    ops.fused_add_rms_norm(xg, rg, cuda(w), 1e-5)
    ops.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(rg.cpu(), r)  # the add is rounded exactly like torch's
    torch.testing.assert_close(xg.cpu(), x, **tol(dtype))


@pytest.mark.parametrize("kernel", ["aten", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (37, 2 * 576), (2, 3, 2 * 13), (3, 2 * 8192), (2, 2 * 8)])
def test_silu_and_mul(dtype, shape, kernel, monkeypatch):
    """Both CUDA paths (EECORE_SILU_AND_MUL_KERNEL) against the CPU kernel, with the extremes
    (a gate of +-inf, +-100, NaN) in the first row; the fused kernel bit for bit against ATen's."""
    monkeypatch.setenv("EECORE_SILU_AND_MUL_KERNEL", kernel)
    x = (torch.randn(shape) * 4)
    x.view(-1, shape[-1])[0, :5] = torch.tensor([float("inf"), float("-inf"), 100.0, -100.0, float("nan")])
    x = x.to(dtype)
    out = cuda(poison(torch.empty(shape[:-1] + (shape[-1] // 2,), dtype=dtype)))
    ops.silu_and_mul(out, cuda(x))
    expected = torch.empty(out.shape, dtype=dtype)
    ops.silu_and_mul(expected, x)
    torch.testing.assert_close(out.cpu(), expected, equal_nan=True, **tol(dtype))
    if kernel == "fused":
        monkeypatch.setenv("EECORE_SILU_AND_MUL_KERNEL", "aten")
        aten = torch.empty_like(out)
        ops.silu_and_mul(aten, cuda(x))
        assert torch.equal(out.view(-1).float().nan_to_num(7.0), aten.view(-1).float().nan_to_num(7.0))


def test_silu_and_mul_fused_on_a_view_offset_by_one_element(monkeypatch):
    """An input whose rows are not 16-byte aligned takes the scalar path, not a misaligned vector."""
    monkeypatch.setenv("EECORE_SILU_AND_MUL_KERNEL", "fused")
    base = cuda(torch.randn(4 * 2 * 64 + 1).to(torch.bfloat16))
    x = base[1:].view(4, 2 * 64)
    out = cuda(torch.empty(4, 64, dtype=torch.bfloat16))
    ops.silu_and_mul(out, x)
    expected = torch.empty(4, 64, dtype=torch.bfloat16)
    ops.silu_and_mul(expected, x.cpu())
    torch.testing.assert_close(out.cpu(), expected, **tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim, rot_dim", [(128, 128), (64, 32), (80, 80), (6, 6)])
@pytest.mark.parametrize("cache_fp32", [True, False])
def test_rotary_embedding(dtype, is_neox, head_dim, rot_dim, cache_fp32):
    tokens, hq, hkv, max_pos = 19, 8, 2, 100
    fused = torch.randn(tokens, hq + 2 * hkv, head_dim, dtype=dtype)
    positions = torch.randint(0, max_pos, (tokens,))
    angles = torch.randn(max_pos, rot_dim // 2)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32 if cache_fp32 else dtype)
    gpu = cuda(fused.clone())
    ops.rotary_embedding(cuda(positions), gpu[:, :hq], gpu[:, hq:hq + hkv], cuda(cache), is_neox)
    ops.rotary_embedding(positions, fused[:, :hq], fused[:, hq:hq + hkv], cache, is_neox)
    torch.testing.assert_close(gpu.cpu(), fused, **tol(dtype))


def test_rotary_embedding_skips_positions_outside_the_cache():
    query, key = torch.randn(3, 4, 64, device="cuda"), torch.randn(3, 2, 64, device="cuda")
    q0, k0 = query.clone(), key.clone()
    cache = torch.randn(10, 64, device="cuda")
    ops.rotary_embedding(torch.tensor([3, 10, -1], device="cuda"), query, key, cache, True)
    torch.cuda.synchronize()
    assert not torch.equal(query[0], q0[0])
    assert torch.equal(query[1:], q0[1:]) and torch.equal(key[1:], k0[1:])


# ---- linear: cuBLAS, and the few-row kernels (EECORE_LINEAR_KERNEL=gemv, gemv_mma, auto) -----------

@pytest.mark.parametrize("kernel", ["cublas", "gemv", "gemv_mma", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])
# (576, 960): SmolLM2's QKV; (2048, 4099): enough features that the few-row kernel gives a block 2
# or 4 of them from 3 rows on, the last block's partly past the end; (8192, 64): a long row;
# (64, 7): one tensor-core tile, mostly past the last feature; (40, 7): few features, K not a
# multiple of 32 (gemv_mma takes the SIMT kernel); (36, 5): K not a whole number of 16-byte vectors in
# bf16 (both few-row kernels fall back to cuBLAS)
@pytest.mark.parametrize("k, n", [(576, 960), (2048, 4099), (8192, 64), (64, 7), (40, 7), (36, 5)])
def test_linear(dtype, rows, k, n, kernel, monkeypatch):
    """Every bias / accumulate combination against the CPU kernel, with strided input and out rows."""
    monkeypatch.setenv("EECORE_LINEAR_KERNEL", kernel)
    inp = torch.randn(rows, k + 8, dtype=dtype)[:, :k]
    weight = torch.randn(n, k, dtype=dtype) / k ** 0.5
    bias = torch.randn(n, dtype=dtype)
    start = torch.randn(rows, n + 3, dtype=dtype)
    for with_bias in (False, True):
        for accumulate in (False, True):
            b = bias if with_bias else None
            out = cuda(start.clone())
            ops.linear(out[:, :n], *cuda(inp, weight), cuda(b), accumulate=accumulate)
            expected = start.clone()
            ops.linear(expected[:, :n], inp, weight, b, accumulate=accumulate)
            torch.testing.assert_close(out.cpu(), expected, **tol(dtype, scale=4))
            assert torch.equal(out[:, n:].cpu(), start[:, n:])  # the columns past N are untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["gemv", "gemv_mma", "auto"])
@pytest.mark.parametrize("n", [512, 4096])
def test_linear_gemv_rows_do_not_depend_on_the_other_rows(dtype, n, kernel, monkeypatch):
    """Each few-row kernel sums each row in one order whatever the row count, so a verify pass of
    up to 8 rows gives each row a one-row step's bits (auto: weights this small take them)."""
    monkeypatch.setenv("EECORE_LINEAR_KERNEL", kernel)
    inp, weight = cuda(torch.randn(8, 2048, dtype=dtype), torch.randn(n, 2048, dtype=dtype) / 45)
    alone = torch.cat([ops.linear(torch.empty(1, n, dtype=dtype, device="cuda"), inp[i:i + 1], weight)
                       for i in range(8)])
    for rows in range(2, 9):
        together = ops.linear(torch.empty(rows, n, dtype=dtype, device="cuda"), inp[:rows], weight)
        assert torch.equal(together, alone[:rows]), rows


@pytest.mark.parametrize("rows", [1, 8])
def test_linear_auto_takes_the_few_row_kernel_up_to_32_mib_of_weight(rows, monkeypatch):
    """EECORE_LINEAR_KERNEL=auto: a 32 MiB bf16 weight (Llama-1B's down projection) gets gemv_mma's
    bits, a weight one row of features larger gets cuBLAS's."""
    k = 8192
    inp = cuda(torch.randn(rows, k, dtype=torch.bfloat16))
    for n, like in ((2048, "gemv_mma"), (2049, "cublas")):
        weight = cuda(torch.randn(n, k, dtype=torch.bfloat16) / 90)
        outs = {}
        for kernel in ("auto", like):
            monkeypatch.setenv("EECORE_LINEAR_KERNEL", kernel)
            outs[kernel] = ops.linear(torch.empty(rows, n, dtype=torch.bfloat16, device="cuda"), inp, weight)
        assert torch.equal(outs["auto"], outs[like]), n


# ---- programmatic dependent launch (EECORE_PDL=1) -----------------------------------------------

def _layer_chain(rows: int, steps: int, graph: bool) -> torch.Tensor:
    """A decoder layer's row kernels, `steps` times over, each reading what the one before wrote
    (rms_norm, the few-row linear, fused RoPE and cache write, silu_and_mul, fused_add_rms_norm),
    run eagerly or captured and replayed as a CUDA graph; returns the final residual stream."""
    g = torch.Generator().manual_seed(3)
    d, heads, head_dim, ff = 256, 4, 64, 512
    w_qkv, w_up, w_down = (cuda((torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16))
                           for n, k in ((3 * heads * head_dim, d), (2 * ff, d), (d, ff)))
    norm = cuda(torch.rand(d, generator=g).to(torch.bfloat16) + 0.5)
    angles = torch.randn(64, head_dim // 2, generator=g)
    cos_sin = cuda(torch.cat([angles.cos(), angles.sin()], dim=-1))
    k_cache, v_cache = (torch.zeros(8, 16, heads, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    positions, slots = cuda(torch.arange(rows), torch.arange(rows) * 3)
    hidden = cuda(torch.randn(rows, d, generator=g).to(torch.bfloat16))
    start = hidden.clone()
    x, qkv = torch.empty_like(hidden), torch.empty(rows, 3 * heads * head_dim, dtype=torch.bfloat16, device="cuda")
    up, act = (torch.empty(rows, n, dtype=torch.bfloat16, device="cuda") for n in (2 * ff, ff))

    def chain():
        for _ in range(steps):
            ops.rms_norm(x, hidden, norm, 1e-6)
            ops.linear(qkv, x, w_qkv)
            q, k, v = qkv.view(rows, 3 * heads, head_dim).split(heads, dim=1)
            ops.rotary_embedding_and_cache(positions, q, k, v, cos_sin, True, k_cache, v_cache, slots)
            ops.linear(up, qkv[:, :d], w_up)
            ops.silu_and_mul(act, up)
            ops.linear(x, act, w_down)
            ops.fused_add_rms_norm(x, hidden, norm, 1e-6)

    if graph:
        chain()  # warm-up outside the capture
        hidden.copy_(start)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            chain()
        hidden.copy_(start)
        captured.replay()
    else:
        chain()
    torch.cuda.synchronize()
    return torch.cat([hidden.float().flatten(), k_cache.float().flatten()])


@pytest.mark.parametrize("linear", ["gemv", "gemv_mma", "auto"])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_pdl_gives_the_same_bits(rows, graph, linear, monkeypatch):
    """With EECORE_PDL=1 each row kernel may be scheduled while the one before it runs, and waits
    for it before touching memory: a chain of them gives the bits it gives without PDL."""
    monkeypatch.setenv("EECORE_LINEAR_KERNEL", linear)
    monkeypatch.setenv("EECORE_PDL", "0")
    plain = _layer_chain(rows, 24, graph)
    monkeypatch.setenv("EECORE_PDL", "1")
    assert torch.equal(_layer_chain(rows, 24, graph), plain)


# ---- confidence ops ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 1000), (8, 32003), (64, 128256)])
def test_softmax_top2_gap(dtype, shape):
    logits = (torch.randn(shape) * 4).to(dtype)
    gap, top1 = ops.softmax_top2_gap(cuda(logits))
    ref_gap, ref_top1 = reference.softmax_top2_gap(logits)
    torch.testing.assert_close(gap.cpu(), ref_gap, atol=1e-5, rtol=1e-4)
    assert torch.equal(top1.cpu(), ref_top1)


def test_softmax_top2_gap_special_values():
    logits = torch.randn(5, 300)
    logits[0, 7] = logits[0, 200] = 50.0  # tie: gap 0, the first index wins
    logits[1] = float("-inf")  # all -inf: NaN, top1 0
    logits[2, 3] = float("nan")
    logits[3, :299] = float("-inf")  # one finite logit: gap 1
    gap, top1 = ops.softmax_top2_gap(cuda(logits))
    cpu_gap, cpu_top1 = ops.softmax_top2_gap(logits)
    torch.testing.assert_close(gap.cpu(), cpu_gap, equal_nan=True)
    assert torch.equal(top1.cpu()[[0, 1, 3, 4]], cpu_top1[[0, 1, 3, 4]])
    assert gap[0].item() == 0 and top1[0].item() == 7 and gap[3].item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1000), (8, 32003), (1, 128256), (64, 128256), (5, 49152)])
def test_argmax(dtype, shape):
    logits = (torch.randn(shape) * 0.05).to(dtype)  # bf16 / fp16: many exact ties
    logits[0, -1] = logits.float()[0].max()  # a tie at the very end
    if shape[0] > 2:
        logits[1, shape[1] // 2] = float("nan")
        logits[2] = float("-inf")
    assert torch.equal(ops.argmax(cuda(logits)).cpu(), ops.argmax(logits))
    assert torch.equal(ops.argmax(logits), reference.argmax(logits))
    unaligned = cuda(logits)[:, 1:] if shape[1] > 1 else cuda(logits)
    assert torch.equal(ops.argmax(unaligned).cpu(), reference.argmax(unaligned.cpu()))


def test_argmax_in_a_graph_writes_its_out_buffer():
    logits = cuda(torch.randn(4, 50000))
    out = torch.empty(4, dtype=torch.int64, device="cuda")
    ops.argmax(logits, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.argmax(logits, out=out)
    logits.copy_(cuda(torch.randn(4, 50000)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference.argmax(logits.cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 17, 40, 70])
@pytest.mark.parametrize("vocab, d", [(1000, 64), (32003, 576), (4099, 100), (128256, 2048)])
def test_lm_head_top2_gap(dtype, rows, vocab, d):
    if vocab * d > 10 ** 8 and rows not in (1, 70):
        pytest.skip("the big head once per dtype at each tile shape is enough")
    hidden = torch.randn(rows, d, dtype=dtype)
    weight = (torch.randn(vocab, d) * d ** -0.5).to(dtype)
    gap, top1 = ops.lm_head_top2_gap(*cuda(hidden, weight))
    ref_gap, ref_top1 = reference.lm_head_top2_gap(hidden, weight)
    logits = hidden.float() @ weight.float().T
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # rows whose winner is not a near-tie
    assert torch.equal(top1.cpu()[clear], ref_top1[clear])
    torch.testing.assert_close(gap.cpu(), ref_gap, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (9, 576), (64, 4096)])
def test_hidden_cosine(dtype, shape):
    prev, cur = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    cur[0] = prev[0]
    sim = ops.hidden_cosine(*cuda(prev, cur))
    torch.testing.assert_close(sim.cpu(), reference.hidden_cosine(prev, cur), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights_fp32", [True, False])
@pytest.mark.parametrize("rows, d, m", [(1, 64, 16), (13, 1000, 33), (64, 2048, 256)])
def test_mlp_confidence(dtype, weights_fp32, rows, d, m):
    wdtype = torch.float32 if weights_fp32 else dtype
    hidden = torch.randn(rows, d, dtype=dtype)
    w1, b1 = (torch.randn(m, d) * d ** -0.5).to(wdtype), torch.randn(m).to(wdtype)
    w2, b2 = (torch.randn(m) * m ** -0.5).to(wdtype), torch.randn(1).to(wdtype)
    conf = ops.mlp_confidence(*cuda(hidden, w1, b1, w2, b2))
    torch.testing.assert_close(conf.cpu(), ops.mlp_confidence(hidden, w1, b1, w2, b2), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [0, 1, 7, 300, 5000])
@pytest.mark.parametrize("per_row_threshold", [True, False])
def test_accept_update(rows, per_row_threshold):
    status = torch.rand(rows) < 0.2
    confidence = torch.rand(rows)
    confidence[::11] = float("nan")
    threshold = torch.rand(rows) if per_row_threshold else torch.tensor(0.5)
    active = torch.rand(rows) < 0.8
    status_gpu = cuda(status.clone())
    remaining = ops.accept_update(status_gpu, *cuda(confidence, threshold, active))
    assert remaining.device.type == "cuda" and remaining.dtype == torch.int32 and remaining.dim() == 0
    expected = reference.accept_update(status, confidence, threshold, active)
    assert torch.equal(status_gpu.cpu(), status) and remaining.item() == expected.item()


# ---- kv_fill -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rope, with_bias", [(True, False), (True, True), (False, True), ("partial", False)])
def test_kv_fill(dtype, is_neox, rope, with_bias):
    layers, blocks, block_size, heads, head_dim, d, tokens, max_pos = 5, 6, 16, 2, 64, 96, 11, 64
    kv_cache = torch.randn(layers, 2, blocks, block_size, heads, head_dim, dtype=dtype)
    hidden = torch.randn(tokens, d, dtype=dtype) * 3
    weight = (torch.randn(layers, 2 * heads * head_dim, d) * d ** -0.5).to(dtype)
    bias = torch.randn(layers, 2 * heads * head_dim).to(dtype) if with_bias else None
    rot_dim = head_dim // 2 if rope == "partial" else head_dim
    angles = torch.randn(max_pos, rot_dim // 2)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1) if rope else None
    positions = torch.randint(0, max_pos, (tokens,))
    slots = torch.randperm(blocks * block_size)[:tokens]
    slots[3] = -1
    start = torch.randint(0, layers + 1, (tokens,), dtype=torch.int32)
    gpu_cache = cuda(kv_cache.clone())
    ops.kv_fill(gpu_cache, *cuda(hidden, weight, bias, cos_sin, positions, slots, start), 1e-5, is_neox)
    ops.kv_fill(kv_cache, hidden, weight, bias, cos_sin, positions, slots, start, 1e-5, is_neox)
    torch.testing.assert_close(gpu_cache.cpu(), kv_cache, **tol(dtype, 2.0))


def test_kv_fill_skips_bad_index_data():
    kv_cache = torch.zeros(3, 2, 2, 4, 1, 8, device="cuda")
    hidden = torch.randn(4, 16, device="cuda")
    weight = torch.randn(3, 16, 16, device="cuda")
    cos_sin = torch.randn(10, 8, device="cuda")
    positions = torch.tensor([1, 2, 30, 4], device="cuda")  # token 2: outside the cos/sin cache
    slots = torch.tensor([0, 8, 1, 2], device="cuda")  # token 1: past the cache
    start = torch.tensor([0, 0, 0, -1], dtype=torch.int32, device="cuda")  # token 3: negative
    ops.kv_fill(kv_cache, hidden, weight, None, cos_sin, positions, slots, start, 1e-5, True)
    torch.cuda.synchronize()
    written = kv_cache.abs().sum(dim=(0, 1, 4, 5)).flatten() > 0  # per slot
    assert written.tolist() == [True, False, False, False, False, False, False, False]


# ---- batch invariance (EECORE_BATCH_INVARIANT=1) --------------------------------------------------

@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("heads, head_dim", [((32, 8), 64), ((12, 3), 128), ((8, 8), 64), ((40, 5), 128)])
def test_batch_invariant_attention_rows_keep_their_bits(dtype, heads, head_dim, batch_invariant):
    """Sequence b decoded alone, in a batch of 48, and verified with 5 query rows (its row at the
    decoded position) in a batch of 48 with wider block tables: the same bits, at contexts inside
    one split, across a split boundary and over several."""
    hq, hkv = heads
    block_size, width = 16, 5
    lens = [7 + (131 * b) % 1500 for b in range(48)]
    lens[0], lens[1], lens[2] = 512, 513, 1499
    num_blocks = sum(math.ceil((s + width) / block_size) for s in lens) + 2
    k_cache, v_cache = (torch.randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, device="cuda") for _ in "kv")
    table = cuda(random_block_tables([s + width for s in lens], block_size, num_blocks, extra_cols=3))
    queries = torch.randn(48, width, hq, head_dim, dtype=dtype, device="cuda")

    def attend(batch, q_rows, table_cols):
        seq_lens = torch.tensor([lens[b] + q_rows - 1 for b in batch], dtype=torch.int32, device="cuda")
        query = queries[batch, :q_rows].reshape(-1, hq, head_dim).contiguous()
        starts = torch.arange(0, len(batch) * q_rows + 1, q_rows, dtype=torch.int32, device="cuda")
        out = torch.empty_like(query)
        ops.paged_attention(out, query, k_cache, v_cache, table[batch, :table_cols].contiguous(), seq_lens, starts,
                            q_rows, head_dim ** -0.5, True)
        return out.view(len(batch), q_rows, hq, head_dim)[:, 0]

    everyone = list(range(48))
    decoded = attend(everyone, 1, math.ceil(max(lens) / block_size))
    verified = attend(everyone, width, table.shape[1])
    for b in (0, 1, 2, 17):
        alone = attend([b], 1, math.ceil(lens[b] / block_size))
        assert torch.equal(alone[0], decoded[b]), b
    assert torch.equal(verified, decoded)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("k, n", [(2048, 3072), (8192, 2048), (2048, 2048), (576, 49152)])
def test_batch_invariant_linear_rows_keep_their_bits(dtype, k, n, batch_invariant):
    """cuBLAS without split-K: a row's output is the same whether 1, 8, 64 or 320 rows share the
    call (Llama-1B's projections, SmolLM2's LM head)."""
    inp, weight = cuda(torch.randn(320, k, dtype=dtype), torch.randn(n, k, dtype=dtype) / k ** 0.5)
    full = ops.linear(torch.empty(320, n, dtype=dtype, device="cuda"), inp, weight)
    for rows in (1, 8, 64):
        part = ops.linear(torch.empty(rows, n, dtype=dtype, device="cuda"), inp[:rows], weight)
        assert torch.equal(part, full[:rows]), rows
