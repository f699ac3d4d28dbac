"""Quantizing a dense weight to GGUF blocks: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 with the `gguf`
package (llama.cpp's reference quantizers), Q4_K, Q5_K and Q6_K here, since the `gguf` package only
dequantizes those.

The K quantizers take each group's range directly (round to nearest, no search for the scale that
minimises the error, as llama.cpp's `quantize` does): valid blocks every GGUF reader decodes, a
little less accurate than llama.cpp's. They serve `LLM(quantization="q4_k")` and the benchmarks,
which measure speed on the values a file holds, whatever quantizer chose them.
"""
from __future__ import annotations

import numpy as np

SUPER = 256  # weights in a K-format superblock


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _divide(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """x / d, 0 where d is 0."""
    safe = np.where(d == 0, 1, d)
    return np.where(d == 0, 0, x / safe)


def _k_blocks(weight: np.ndarray, levels: int):
    """The shared part of Q4_K (levels 15) and Q5_K (31): per superblock the fp16 d and dmin, the
    6-bit scales and mins of its 8 groups packed in 12 bytes, and each weight's integer [S, 8, 32]."""
    x = weight.astype(np.float32).reshape(-1, 8, 32)            # [superblocks, group, weight]
    low = np.minimum(x.min(axis=2), 0)                           # w = scale q - min, min >= 0
    scale = (x.max(axis=2) - low) / levels
    mins = -low
    d = _fp16(scale.max(axis=1) / 63).astype(np.float32)         # [superblocks]
    dmin = _fp16(mins.max(axis=1) / 63).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_divide(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc                                       # [superblocks, group]
    offset = dmin[:, None] * mn
    q = np.clip(np.rint(_divide(x + offset[:, :, None], step[:, :, None])), 0, levels).astype(np.uint8)
    head = np.zeros((x.shape[0], 16), dtype=np.uint8)
    head[:, 0:2] = _fp16(d).view(np.uint8).reshape(-1, 2)
    head[:, 2:4] = _fp16(dmin).view(np.uint8).reshape(-1, 2)
    head[:, 4:8] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    head[:, 8:12] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    head[:, 12:16] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return head, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Groups 2p and 2p + 1 share 32 bytes, the first in the low nibbles: [S, 128]."""
    return ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """`[N, K]` float (K a multiple of 256) -> `[N, K / 256 * 144]` uint8 Q4_K blocks."""
    n, k = weight.shape
    head, q = _k_blocks(weight, 15)
    return np.concatenate([head, _nibbles(q)], axis=1).reshape(n, k // SUPER * 144)


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    """`[N, K]` float (K a multiple of 256) -> `[N, K / 256 * 176]` uint8 Q5_K blocks."""
    n, k = weight.shape
    head, q = _k_blocks(weight, 31)
    # weight l of group g: its fifth bit is bit g of byte l
    fifth = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([head, fifth, _nibbles(q)], axis=1).reshape(n, k // SUPER * 176)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """`[N, K]` float (K a multiple of 256) -> `[N, K / 256 * 210]` uint8 Q6_K blocks."""
    n, k = weight.shape
    x = weight.astype(np.float32).reshape(-1, 16, 16)           # [superblocks, sub-block, weight]
    scale = np.abs(x).max(axis=2) / 31
    d = _fp16(scale.max(axis=1) / 127).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = (np.clip(np.rint(_divide(x, step[:, :, None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)

    blocks = np.zeros((q.shape[0], 210), dtype=np.uint8)
    # half h, quarter j, weight l: low nibble of ql[64 h + 32 (j % 2) + l] (j < 2) or its high one,
    # and bits 2 j of qh[32 h + l]
    ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)       # [superblocks, half, j % 2, l]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    blocks[:, 0:128] = ql.reshape(-1, 128)
    blocks[:, 128:192] = qh.reshape(-1, 64)
    blocks[:, 192:208] = sc.view(np.uint8)
    blocks[:, 208:210] = _fp16(d).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, k // SUPER * 210)


_OWN = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(weight: np.ndarray, type_name: str) -> np.ndarray:
    """`weight [N, K]` as `type_name` blocks `[N, row bytes]` uint8."""
    if type_name in _OWN:
        if weight.shape[1] % SUPER:
            raise ValueError(f"quantize: {type_name} needs rows of whole 256-weight blocks, got {weight.shape[1]}")
        return _OWN[type_name](weight)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    return gguf_quantize(weight.astype(np.float32), GGMLQuantizationType[type_name])
