"""Typed wrappers of the `torch.ops.eecore.*` ops, and their fake (meta) implementations.

The ops are the public, engine-neutral contract (see csrc/bindings.cpp for every schema). The
wrappers add nothing but names, defaults and return values: every check lives in the C++ op, so
other engines calling `torch.ops.eecore.<name>` directly get the same errors.

The fake implementations let `torch.compile` and `torch.library.opcheck` trace the ops without
running them; the ops that only mutate their arguments need none beyond returning nothing.
"""
from __future__ import annotations

from typing import Optional

import torch

from eecore import _C  # noqa: F401  (loading the library registers torch.ops.eecore)

_ops = torch.ops.eecore

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "softmax_top2_gap",
    "argmax",
    "lm_head_top2_gap",
    "hidden_cosine",
    "mlp_confidence",
    "accept_update",
    "kv_fill",
    "linear",
    "qkv_projection",
    "gate_up_projection",
    "linear_residual",
    "prefetch_l2",
]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value `[T, Hkv, D]` into the paged caches `[NB, BS, Hkv, D]` at `slot_mapping` (int64, -1 skips)."""
    _ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    max_query_len: int, scale: float, causal: bool = True,
                    position_bias: Optional[torch.Tensor] = None,
                    tree_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Varlen attention of `query [Tq, Hq, D]` over the paged KV; writes and returns `out`.

    `tree_mask` (int64 `[Tq]`, causal, `max_query_len <= 64`) verifies a token tree: row i of a chunk
    sees the keys before its chunk and chunk key j iff bit j is set (bit i set, none above).
    """
    _ops.paged_attention(out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                         int(max_query_len), float(scale), bool(causal), position_bias, tree_mask)
    return out


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`out = input * rsqrt(mean(input**2) + eps) * weight`; returns `out`."""
    _ops.rms_norm(out, input, weight, float(eps))
    return out


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: `residual += input`, then `input = rms_norm(residual) * weight`."""
    _ops.fused_add_rms_norm(input, residual, weight, float(eps))


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """`out [..., d] = silu(gate) * up` for `input [..., 2d] = [gate | up]`; returns `out`."""
    _ops.silu_and_mul(out, input)
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """Rotate `query [T, Hq, D]` and `key [T, Hkv, D]` in place at `positions` (int64 `[T]`)."""
    _ops.rotary_embedding(positions, query, key, cos_sin_cache, bool(is_neox))


def rotary_embedding_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`rotary_embedding(positions, query, key, ...)`, then `reshape_and_cache(key, value, ...)` of
    the rotated keys (one launch on a GPU)."""
    _ops.rotary_embedding_and_cache(positions, query, key, value, cos_sin_cache, bool(is_neox), k_cache, v_cache,
                                    slot_mapping)


def softmax_top2_gap(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(gap, top1)`: fp32 `p1 - p2` of `softmax(logits [B, V])` and the int64 argmax, per row."""
    return _ops.softmax_top2_gap(logits)


def argmax(logits: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 `[B]`: each row's argmax of `logits [B, V]` (the first NaN, else the first maximal
    index, as `torch.argmax`), into `out` if given; returns it."""
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _ops.argmax(out, logits)
    return out


def prefetch_l2(weight: torch.Tensor, max_bytes: Optional[int] = None) -> None:
    """On CUDA, asks the L2 cache to fetch the first `max_bytes` (default: all) of contiguous
    `weight` on the current stream, and returns at once: a hint, which changes no value."""
    _ops.prefetch_l2(weight, weight.numel() * weight.element_size() if max_bytes is None else int(max_bytes))


def lm_head_top2_gap(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_top2_gap(hidden @ weight.T)` without materializing the `[B, V]` logits."""
    return _ops.lm_head_top2_gap(hidden, weight)


def hidden_cosine(prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """fp32 `[B]` cosine similarity of the rows of `prev` and `cur` `[B, d]`."""
    return _ops.hidden_cosine(prev, cur)


def mlp_confidence(hidden: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                   b2: torch.Tensor) -> torch.Tensor:
    """fp32 `[B]` `sigmoid(w2 . relu(w1 @ h + b1) + b2)`: CALM's dedicated exit classifier."""
    return _ops.mlp_confidence(hidden, w1, b1, w2, b2)


def accept_update(status: torch.Tensor, confidence: torch.Tensor, threshold: torch.Tensor | float,
                  active: torch.Tensor) -> torch.Tensor:
    """`status |= (confidence > threshold) & active`; returns int32 `[]`: active rows not yet confident.

    `threshold` is fp32 `[]` or `[B]`; a Python number becomes a 0-dim fp32 tensor.
    """
    if not isinstance(threshold, torch.Tensor):
        threshold = torch.tensor(float(threshold), dtype=torch.float32, device=status.device)
    return _ops.accept_update(status, confidence, threshold, active)


def kv_fill(kv_cache: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            cos_sin_cache: Optional[torch.Tensor], positions: torch.Tensor, slot_mapping: torch.Tensor,
            start_layer: torch.Tensor, eps: float, is_neox: bool = True) -> None:
    """Fill the K/V of layers `>= start_layer[t]` for every token from its exit hidden state."""
    _ops.kv_fill(kv_cache, hidden, weight, bias, cos_sin_cache, positions, slot_mapping, start_layer,
                 float(eps), bool(is_neox))


def linear(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           accumulate: bool = False, weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`out = input @ weight.T + bias`, or `out += ...` with `accumulate`; returns `out`.
    Weight-only int8: an int8 `weight` [N, K] with `weight_scale` fp32 [N] stands for
    `weight_scale[:, None] * weight`, and each input row is first rounded to int16 with a scale of
    its own (`eecore.testing.reference.round_rows_to_int16`; eecore.models.int8_weights). A bf16 `weight`
    may come tiled for AMX-BF16 instead, `[N/16, K/32, 16, 32]` (CPU; eecore.models.amx_weights)."""
    _ops.linear(out, input, weight, bias, bool(accumulate), weight_scale)
    return out


def qkv_projection(out: torch.Tensor, normed: torch.Tensor, input: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor], positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """A layer's attention input in one op: `normed = rms_norm(input) * norm_weight`, `out [T, (Hq +
    2 Hkv) D] = linear(normed, weight, bias)`, then `rotary_embedding_and_cache` on out's query, key
    and value (Hkv and D from `k_cache`). One launch on a GPU for 1-8 rows; returns `out`."""
    _ops.qkv_projection(out, normed, input, norm_weight, float(eps), weight, bias, positions, cos_sin_cache,
                        bool(is_neox), k_cache, v_cache, slot_mapping)
    return out


def gate_up_projection(act: torch.Tensor, out: torch.Tensor, normed: torch.Tensor, input: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """An MLP's input in one op: `normed = rms_norm(input) * norm_weight`, `out [T, 2 I] =
    linear(normed, weight)` (gate and up stacked), `act [T, I] = silu_and_mul(out)`. One launch on a
    GPU for 1-8 rows; returns `act`."""
    _ops.gate_up_projection(act, out, normed, input, norm_weight, float(eps), weight)
    return act


def linear_residual(out: torch.Tensor, residual: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`out = linear(input, weight, bias)`, then `residual += out` (rounded after the product, as a
    separate add). One launch on a GPU for 1-8 rows; returns `residual`."""
    _ops.linear_residual(out, residual, input, weight, bias)
    return residual


# GGML's ids of the GGUF block types `linear_gguf` computes (eecore/csrc/linear/gguf_blocks.h)
GGUF_QUANT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def linear_gguf(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, quant_type: int,
                bias: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """`linear` with a weight in a GGUF block format, computed with its exact values: `weight` uint8
    `[N, K / W * block bytes]` as the file stores it (each row K / W blocks of `quant_type`, one of
    GGUF_QUANT_TYPES' ids; W = 256 weights a block for the K formats, 32 for the others); fp32
    accumulation. Returns `out`."""
    _ops.linear_gguf(out, input, weight, int(quant_type), bias, bool(accumulate))
    return out


def dequantize_gguf(weight: torch.Tensor, quant_type: int, features: int) -> torch.Tensor:
    """The fp32 values `[N, features]` of a GGUF block weight (those linear_gguf multiplies by)."""
    return _ops.dequantize_gguf(weight, int(quant_type), int(features))


def embedding_gguf(out: torch.Tensor, token_ids: torch.Tensor, weight: torch.Tensor, quant_type: int) -> torch.Tensor:
    """`out [T, K]` = the rows `token_ids` (int64 `[T]`, each in [0, N)) of a GGUF block weight,
    dequantized: a GGUF token embedding's lookup, or rows of a GGUF LM head. Returns `out`."""
    _ops.embedding_gguf(out, token_ids, weight, int(quant_type))
    return out


def repack_gguf_q8(weight: torch.Tensor, quant_type: int, features: int) -> torch.Tensor:
    """A Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K GGUF weight `[N, row bytes]` repacked for
    `linear_gguf_q8` (uint8 `[ceil(N / 16), units, unit bytes]`, a unit being a block of 32 weights, or a
    K format's superblock of 256, of 16 rows; the layout: csrc/linear/gguf_q8.h)."""
    return _ops.repack_gguf_q8(weight, int(quant_type), int(features))


def linear_gguf_q8(out: torch.Tensor, input: torch.Tensor, packed: torch.Tensor, quant_type: int,
                   bias: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """`linear_gguf` with 8-bit activations (llama.cpp's arithmetic): each input row rounded to int8
    in blocks of 32 with a scale each, integer dot products against the repacked weight. Not the
    dequantized model's values: the activations' rounding error on top. Returns `out`."""
    _ops.linear_gguf_q8(out, input, packed, int(quant_type), bias, bool(accumulate))
    return out


# --------------------------------------------------------------------------------------------
# Fake implementations: shapes and dtypes only. The ops that return nothing need no fake.
# --------------------------------------------------------------------------------------------

def _register_fake(name: str):
    return torch.library.register_fake(f"eecore::{name}")


@_register_fake("softmax_top2_gap")
def _softmax_top2_gap_fake(logits):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.int64)


@_register_fake("lm_head_top2_gap")
def _lm_head_top2_gap_fake(hidden, weight):
    rows = hidden.shape[0]
    return hidden.new_empty(rows, dtype=torch.float32), hidden.new_empty(rows, dtype=torch.int64)


@_register_fake("hidden_cosine")
def _hidden_cosine_fake(prev, cur):
    return prev.new_empty(prev.shape[0], dtype=torch.float32)


@_register_fake("mlp_confidence")
def _mlp_confidence_fake(hidden, w1, b1, w2, b2):
    return hidden.new_empty(hidden.shape[0], dtype=torch.float32)


@_register_fake("dequantize_gguf")
def _dequantize_gguf_fake(weight, quant_type, features):
    return weight.new_empty((weight.shape[0], features), dtype=torch.float32)


@_register_fake("repack_gguf_q8")
def _repack_gguf_q8_fake(weight, quant_type, features):
    name = next(n for n, t in GGUF_QUANT_TYPES.items() if t == int(quant_type))
    per_unit = 8 if name.endswith("_K") else 1
    header = {"Q4_K": 64, "Q5_K": 64, "Q6_K": 32}.get(name, 0)
    scales = 64 if name in ("Q4_1", "Q5_1") else 32
    quants = 512 if name == "Q8_0" else 256 + 64 * {"Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q6_K": 2}.get(name, 0)
    return weight.new_empty(((weight.shape[0] + 15) // 16, features // (32 * per_unit),
                             header + per_unit * (scales + quants)))


@_register_fake("accept_update")
def _accept_update_fake(status, confidence, threshold, active):
    return status.new_empty((), dtype=torch.int32)


for _name in ("reshape_and_cache", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
              "rotary_embedding_and_cache", "kv_fill", "linear", "qkv_projection", "gate_up_projection",
              "linear_residual", "linear_gguf", "embedding_gguf", "linear_gguf_q8"):
    torch.library.register_fake(f"eecore::{_name}")(lambda *args, **kwargs: None)
del _name
