"""Pure-PyTorch oracles of every eecore op.

Each function takes exactly the arguments of the op in `eecore.ops`, mutates the same arguments
and returns the same values, so a test can run both on cloned inputs and compare everything.
They are written for clarity, not speed: Python loops over sequences are fine here. All math
runs in fp32; results are cast to the dtype of the tensor they are stored in.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[t].to(k_cache.dtype)
        v_cache[block, offset] = value[t].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence, `[seq_len, Hkv, D]`, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention(out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len,
                    scale, causal=True, position_bias: Optional[torch.Tensor] = None,
                    tree_mask: Optional[torch.Tensor] = None) -> None:
    """`tree_mask` (int64 `[Tq]`, with causal): row i of a chunk sees every key before its chunk and
    chunk key j (position seq_len - q_len + j) only when bit j of its entry is set."""
    num_q_heads = query.shape[1]
    group = num_q_heads // k_cache.shape[2]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_table[b], seq_len).float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = gather_kv(v_cache, block_table[b], seq_len).float().repeat_interleave(group, dim=1)
        q = query[q_begin:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        distance = q_pos[:, None] - k_pos[None, :]  # [q_len, S]
        if position_bias is not None:
            column = distance.clamp(0, position_bias.shape[1] - 1)
            scores = scores + position_bias.float()[:, column]
        if causal:
            scores = scores.masked_fill(distance[None] < 0, float("-inf"))
        if tree_mask is not None:
            bits = tree_mask[q_begin:q_end].long()
            j = torch.arange(q_len, device=query.device)
            in_tree = ((bits[:, None] >> j[None, :]) & 1).bool()  # [q_len, q_len]: row i sees chunk key j
            before_chunk = torch.ones(q_len, seq_len - q_len, dtype=torch.bool, device=query.device)
            visible = torch.cat([before_chunk, in_tree], dim=1)  # [q_len, S]
            scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm(out, input, weight, eps) -> None:
    out.copy_((_rms(input, eps) * weight.float()).to(out.dtype))


def fused_add_rms_norm(input, residual, weight, eps) -> None:
    residual.copy_((residual.float() + input.float()).to(residual.dtype))
    input.copy_((_rms(residual, eps) * weight.float()).to(input.dtype))


def silu_and_mul(out, input) -> None:
    gate, up = input.float().chunk(2, dim=-1)
    out.copy_((F.silu(gate) * up).to(out.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of x `[T, H, D]`; cos/sin `[T, rot_dim / 2]`."""
    rot_dim = 2 * cos.shape[-1]
    x = x.float()
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rot, rest], dim=-1)


def _cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor):
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    return cos, sin


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox=True) -> None:
    cos, sin = _cos_sin(cos_sin_cache, positions)
    query.copy_(_rotate(query, cos, sin, is_neox).to(query.dtype))
    key.copy_(_rotate(key, cos, sin, is_neox).to(key.dtype))


def rotary_embedding_and_cache(positions, query, key, value, cos_sin_cache, is_neox, k_cache, v_cache,
                               slot_mapping) -> None:
    rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def _top2_gap_of_logits(logits: torch.Tensor):
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    top2 = probs.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).contiguous(), logits.argmax(dim=-1)


def softmax_top2_gap(logits):
    return _top2_gap_of_logits(logits)


def argmax(logits):
    return logits.float().argmax(dim=-1)


def prefetch_l2(weight, max_bytes):
    """A cache hint: nothing to compute."""


def lm_head_top2_gap(hidden, weight):
    return _top2_gap_of_logits(hidden.float() @ weight.float().T)


def hidden_cosine(prev, cur):
    return F.cosine_similarity(prev.float(), cur.float(), dim=-1, eps=1e-8)


def mlp_confidence(hidden, w1, b1, w2, b2):
    h = torch.relu(hidden.float() @ w1.float().T + b1.float())
    return torch.sigmoid(h @ w2.float() + b2.float())


def accept_update(status, confidence, threshold, active):
    status |= (confidence > threshold) & active
    return (active & ~status).sum().to(torch.int32)


def kv_fill(kv_cache, hidden, weight, bias, cos_sin_cache, positions, slot_mapping, start_layer, eps,
            is_neox=True) -> None:
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    normed = _rms(hidden, eps)  # no gain: it is folded into weight
    kv_width = num_kv_heads * head_dim
    for layer in range(num_layers):
        kv = normed @ weight[layer].float().T
        if bias is not None:
            kv = kv + bias[layer].float()
        k = kv[:, :kv_width].reshape(-1, num_kv_heads, head_dim)
        v = kv[:, kv_width:].reshape(-1, num_kv_heads, head_dim)
        if cos_sin_cache is not None:
            cos, sin = _cos_sin(cos_sin_cache, positions)
            k = _rotate(k, cos, sin, is_neox)
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0 or layer < int(start_layer[t]):
                continue
            block, offset = divmod(slot, block_size)
            kv_cache[layer, 0, block, offset] = k[t].to(kv_cache.dtype)
            kv_cache[layer, 1, block, offset] = v[t].to(kv_cache.dtype)


def int16_row_range(k: int) -> int:
    """The integer a row's absmax maps to when a weight-only int8 linear rounds its input rows
    (include/eecore/int8_linear.h: no int32 lane of the integer dot product can overflow)."""
    lane_products = 2 * ((k + 15) // 16)
    return min(32767, (2 ** 31 - 1) // (128 * max(1, lane_products)))


def round_rows_to_int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[M, K]` as integers q (fp32 values in [-range, range]) and scales `[M]`, x ~ q * scale:
    q = round-half-even(x * (range / max|x|)) in fp32, scale = max|x| / range; a zero row has scale
    0, a row holding inf or NaN scale NaN (and q = 0)."""
    x = x.float()
    if x.shape[1] == 0:  # rows of no elements: nothing to round
        return x, x.new_zeros(x.shape[0])
    rng = float(int16_row_range(x.shape[1]))
    amax = x.abs().amax(dim=1, keepdim=True)
    finite = x.isfinite().all(dim=1, keepdim=True)
    usable = finite & (amax > 0)
    q = torch.where(usable, (x * (torch.full_like(amax, rng) / amax)).round().clamp(-rng, rng), torch.zeros_like(x))
    scale = torch.where(finite, amax / rng, torch.full_like(amax, float("nan")))
    return q, scale[:, 0]


def linear(out, input, weight, bias=None, accumulate=False, weight_scale=None) -> None:
    if weight.dim() == 4:  # tiled for AMX-BF16 [N/16, K/32, 16, 32]
        weight = weight.permute(0, 2, 1, 3).reshape(weight.shape[0] * weight.shape[2], -1)
    if weight_scale is None:
        y = input.float() @ weight.float().T
    else:  # weight-only int8: rows rounded to int16, exact integer products, both scales
        q, row_scale = round_rows_to_int16(input)
        y = (q @ weight.float().T) * row_scale[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    if accumulate:
        y = y + out.float()
    out.copy_(y.to(out.dtype))


def qkv_projection(out, normed, input, norm_weight, eps, weight, bias, positions, cos_sin_cache, is_neox, k_cache,
                   v_cache, slot_mapping) -> None:
    rms_norm(normed, input, norm_weight, eps)
    linear(out, normed, weight, bias)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q_width = out.shape[1] - 2 * kv_heads * head_dim
    q, k, v = out.split([q_width, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    T = out.shape[0]
    query, key, value = (x.view(T, -1, head_dim) for x in (q, k, v))
    rotary_embedding_and_cache(positions, query, key, value, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping)


def gate_up_projection(act, out, normed, input, norm_weight, eps, weight) -> None:
    rms_norm(normed, input, norm_weight, eps)
    linear(out, normed, weight)
    silu_and_mul(act, out)


def linear_residual(out, residual, input, weight, bias=None) -> None:
    linear(out, input, weight, bias)
    residual.copy_((residual.float() + out.float()).to(residual.dtype))


def dequantize_gguf(weight, quant_type, features) -> torch.Tensor:
    """The `gguf` package's own dequantizer (llama.cpp's reference values)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(weight.cpu().numpy(), GGMLQuantizationType(int(quant_type)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(weight.shape[0], features)


def linear_gguf(out, input, weight, quant_type, bias=None, accumulate=False) -> None:
    linear(out, input, dequantize_gguf(weight, quant_type, input.shape[1]), bias, accumulate)


def embedding_gguf(out, token_ids, weight, quant_type) -> None:
    out.copy_(dequantize_gguf(weight, quant_type, out.shape[1])[token_ids.cpu()].to(out.dtype))


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_gguf_q8's activations: each row's blocks of 32 as (int8 values, scale) with
    q = round(x * (127 / amax)) (float32 arithmetic, ties to even) and scale amax / 127."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(blocks * inverse), amax / 127.0


def linear_gguf_q8(out, input, weight, quant_type, bias=None, accumulate=False) -> None:
    """Against the unpacked GGUF `weight`: the dequantized weight times the rounded activations, in float64."""
    q, scale = quantize_rows_q8(input)
    x = (q.double() * scale.double()).reshape(input.shape)
    y = x @ dequantize_gguf(weight, quant_type, input.shape[1]).double().T
    if bias is not None:
        y = y + bias.double()
    if accumulate:
        y = y + out.double()
    out.copy_(y.to(out.dtype))

