"""The RoPE cos/sin table `[max_pos, head_dim]` = cat(cos, sin) that `rotary_embedding` and
`kv_fill` read, with the rope_scaling variants of the Llama family."""
from __future__ import annotations

import math
from typing import Optional

import torch


def inverse_frequencies(rot_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} (supported: default, linear, llama3)")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def cos_sin_cache(max_positions: int, rot_dim: int, theta: float, scaling: Optional[dict] = None,
                  device=None) -> torch.Tensor:
    """fp32 `[max_positions, rot_dim]`: cos of each position's angles, then their sin."""
    inv_freq = inverse_frequencies(rot_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
