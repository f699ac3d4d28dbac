"""Projections tiled for the AMX tile engine (Intel Sapphire Rapids and newer CPUs).

`ops.linear` takes a weight `[N, K]` as it is, or pre-tiled in 16-row tiles of 64 bytes, each tile
contiguous: a bf16 weight as `[N/16, K/32, 16, 32]` (AMX-BF16), a weight-only int8 weight
(eecore.models.int8_weights) as `[N/16, K/64, 16, 64]` with its scales unchanged (AMX-INT8); the
tile of output rows 16 b.. and input features depth * s.. sits at `[b, s]`. The tiled forms run on
the CPU's tile engine, where the rows of a decode batch or a verify pass are almost free beside
reading the weight, and each input row's outputs keep their bits whatever the batch.

- bf16: on an Intel Xeon (2 threads) SmolLM2-shaped projections from DRAM took 1.07x the dot
  kernel's time at 1 row, and 0.75x / 0.43x at 8 / 16 rows (csrc/linear/linear_amx_bf16.h). A whole
  bf16 SmolLM2 pass of 1 / 2 rows took 1.03x / 1.07x the dot kernel's time, of 5 rows 0.93x, and at
  batch 8 one of 8 / 16 / 24 rows 0.80x / 0.56x / 0.49x (bench/cost_round.py verify-rows); a prompt of
  8 x 94 tokens took 1.03x oneDNN's bf16 GEMM's time.
- int8: the draft copy of separate draft layers (csrc/linear/linear_amx_int8.h); its 8 layers at
  1 / 8 / 16 / 94 rows took 0.96x / 0.53x / 0.38x / 0.37x the int16 x int8 dot kernel's time
  (bench/ops_linear_rows.py, weights in the last-level cache), and six copies with their heads cycled
  (216 MB) 1.10x / 0.90x / 0.57x / 0.34x. A batch-8 pass of the copy's 8 layers and head at one row
  a sequence went from 4.3 to 2.3 ms.

A model tiles every projection it can. Where batch-1 decode alone matters, or to compare,
`EECORE_AMX=0` keeps the `[N, K]` weights.
"""

from __future__ import annotations

import dataclasses

from typing import Iterable

import torch

from eecore import envs

TILE_ROWS, TILE_BYTES = 16, 64
_KERNELS = {torch.bfloat16: "amx_bf16_available", torch.int8: "amx_int8_available"}


def amx_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this process runs weights of `dtype` (bf16, or int8 for weight-only int8) tiled: the
    CPU has the AMX unit for it, the extension was built for it, Linux grants the tile state, and
    EECORE_AMX=0 is not set."""
    if not envs.flag("EECORE_AMX") or dtype not in _KERNELS:
        return False
    from eecore import _C

    return bool(getattr(_C, _KERNELS[dtype])())


def tile_depth(dtype: torch.dtype) -> int:
    """Input features per tile row: 64 bytes of `dtype`."""
    return TILE_BYTES // torch.empty((), dtype=dtype).element_size()


def can_tile(weight: torch.Tensor) -> bool:
    """A 2-D bf16 or int8 CPU weight whose output rows fill whole tiles (N % 16 == 0) and input
    features whole tile rows (K % 32 for bf16, K % 64 for int8; int8 below 65,536 features)."""
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in _KERNELS
            and weight.device.type == "cpu" and weight.numel() > 0):
        return False
    n, k = weight.shape
    return n % TILE_ROWS == 0 and k % tile_depth(weight.dtype) == 0 and (weight.dtype != torch.int8 or k < 65536)


def tile(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` -> `[N/16, K/depth, 16, depth]` (a copy), for `ops.linear` on AMX."""
    if not can_tile(weight):
        raise ValueError(f"tile: expected a bf16 or int8 CPU weight [N, K] with N % {TILE_ROWS} == 0 and K a multiple "
                         f"of 64 bytes, got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    depth = tile_depth(weight.dtype)
    return weight.view(n // TILE_ROWS, TILE_ROWS, k // depth, depth).permute(0, 2, 1, 3).contiguous()


def untile(weight: torch.Tensor) -> torch.Tensor:
    """`[N/16, K/depth, 16, depth]` -> `[N, K]` (a copy); a 2-D weight is returned as it is."""
    if weight.dim() == 2:
        return weight
    blocks, steps, rows, depth = weight.shape
    return weight.permute(0, 2, 1, 3).reshape(blocks * rows, steps * depth)


def tiled(weight):
    """`weight` (a tensor, or an Int8Weight: its int8 `data` beside its scales) tiled where this
    process runs its tiles and its shape allows; else `weight` itself (GGUF weights always). An
    Int8Weight is recognised by its int8 `data`, not imported: int8_weights imports this module."""
    if not isinstance(weight, torch.Tensor):
        data = getattr(weight, "data", None)  # an Int8Weight's integers (GGUF block weights never tile)
        if isinstance(data, torch.Tensor) and data.dtype == torch.int8 and amx_available(torch.int8) and can_tile(data):
            return dataclasses.replace(weight, data=tile(weight.data))
        return weight
    return tile(weight) if can_tile(weight) and amx_available(weight.dtype) else weight


def tile_projections(layers: Iterable[object], names: tuple[str, ...], lm_head=None):
    """A CPU model's projections on AMX: each layer's weight attributes in `names` replaced by
    `tiled` ones. Returns the LM head as the logits should multiply it: a tiled copy, or `lm_head`
    itself (the head stays `[V, d]` for the confidence ops, the draft heads and, when tied, the
    embedding); None without one."""
    for layer in layers:
        for name in names:
            setattr(layer, name, tiled(getattr(layer, name)))
    return None if lm_head is None else tiled(lm_head)
