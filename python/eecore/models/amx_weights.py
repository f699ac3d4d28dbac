"""bf16 projections tiled for AMX-BF16 (Intel Sapphire Rapids and newer CPUs).

`ops.linear` takes a bf16 weight `[N, K]` as it is, or pre-tiled as `[N/16, K/32, 16, 32]`, the
16 x 32 tile of output rows 16 b.. and input features 32 s.. at `[b, s]`, each tile contiguous. The
tiled form runs on the CPU's tile engine, where the rows of a decode batch or a verify pass are
almost free beside reading the weight: on an Intel Xeon (2 threads) SmolLM2-shaped projections from
DRAM took 1.07x the dot kernel's time at 1 row, and 0.75x / 0.43x at 8 / 16 rows
(csrc/linear/linear_amx_bf16.h). Each input row's outputs keep their bits whatever the batch, so
a bf16 model tiles every projection it can and runs all of them there. The cost is at batch 1: a
whole bf16 SmolLM2 pass of 1 / 2 rows took 1.03x / 1.07x the dot kernel's time, of 5 rows 0.93x,
and at batch 8 one of 8 / 16 / 24 rows 0.80x / 0.56x / 0.49x (bench/verify_row_cost.py); a
prompt of 8 x 94 tokens took 1.03x oneDNN's bf16 GEMM's time. Where batch-1 decode alone
matters, EECORE_AMX=0.

`EECORE_AMX=0` keeps the `[N, K]` weights (to compare, or to rule the tile engine out).
"""
from __future__ import annotations

import os
from typing import Iterable

import torch

TILE_ROWS, TILE_DEPTH = 16, 32
ENV_VAR = "EECORE_AMX"


def amx_available() -> bool:
    """Whether this process runs tiled bf16 weights: the CPU has AMX-BF16, the extension was built
    for it, Linux grants the tile state, and EECORE_AMX=0 is not set."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return False
    from eecore import _C

    return bool(_C.amx_bf16_available())


def can_tile(weight: torch.Tensor) -> bool:
    """A 2-D bf16 CPU weight whose output rows fill whole tiles (N % 16 == 0) and input features
    whole tile rows (K % 32 == 0)."""
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[0] % TILE_ROWS == 0 and weight.shape[1] % TILE_DEPTH == 0
            and weight.numel() > 0)


def tile(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` -> `[N/16, K/32, 16, 32]` (a copy), for `ops.linear` on AMX."""
    if not can_tile(weight):
        raise ValueError(f"tile: expected a bf16 CPU weight [N, K] with N % {TILE_ROWS} == 0 and K % {TILE_DEPTH} == 0, "
                         f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    return weight.view(n // TILE_ROWS, TILE_ROWS, k // TILE_DEPTH, TILE_DEPTH).permute(0, 2, 1, 3).contiguous()


def untile(weight: torch.Tensor) -> torch.Tensor:
    """`[N/16, K/32, 16, 32]` -> `[N, K]` (a copy); a 2-D weight is returned as it is."""
    if weight.dim() == 2:
        return weight
    blocks, steps, rows, depth = weight.shape
    return weight.permute(0, 2, 1, 3).reshape(blocks * rows, steps * depth)


def tile_projections(layers: Iterable[object], names: tuple[str, ...], lm_head: torch.Tensor) -> torch.Tensor:
    """A bf16 CPU model's projections on AMX, where this process runs tiles (`amx_available`): each
    layer's weight attributes in `names` replaced by their tiles where they can be tiled (the others
    stay `[N, K]`, which `ops.linear` runs as well). Returns the LM head as the logits should
    multiply it: a tiled copy, or `lm_head` itself; the head stays `[V, d]` for the confidence ops,
    the draft heads and (when tied) the embedding."""
    if not amx_available():
        return lm_head
    for layer in layers:
        for name in names:
            weight = getattr(layer, name)
            if can_tile(weight):
                setattr(layer, name, tile(weight))
    return tile(lm_head) if can_tile(lm_head) else lm_head
