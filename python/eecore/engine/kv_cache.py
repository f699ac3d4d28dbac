"""The paged KV cache: one tensor for every layer, allocated once, with per-layer views.

    kv = empty(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim)
    k_cache(l), v_cache(l) = kv[l, 0], kv[l, 1]          # [NB + 1, BS, Hkv, D], NHD inside a block

Block `num_blocks` is the pad block: no sequence ever owns it (the block manager hands out blocks
0..num_blocks-1). A static decode step (engine.static_decode) pads the batch to a fixed size with
rows that write their one token there and attend to it, so padding needs no special case in any
kernel, on any device.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from eecore.models.huge_pages import zeros_in_huge_pages


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return _available_host_memory()


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers = num_layers
        self.num_blocks = num_blocks  # blocks sequences may own
        self.pad_block = num_blocks
        self.block_size = block_size
        shape = (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim)
        # on the CPU in huge pages where the OS has them (attention streams the cache as the decode
        # step streams the weights; see eecore.models.huge_pages), backed only as blocks fill
        in_huge_pages = zeros_in_huge_pages(shape, dtype) if torch.device(device).type == "cpu" else None
        self.tensor = in_huge_pages if in_huge_pages is not None else torch.zeros(shape, dtype=dtype, device=device)
        self._k = [self.tensor[layer, 0] for layer in range(num_layers)]
        self._v = [self.tensor[layer, 1] for layer in range(num_layers)]

    def k(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V of slots `src` into slots `dst` (int64 `[n]`, slot = block x
        block_size + offset; no slot in both)."""
        flat = self.tensor.view(self.num_layers, 2, (self.num_blocks + 1) * self.block_size, -1)
        flat[:, :, dst] = flat[:, :, src]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def plan_num_blocks(cls, *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, device: torch.device, memory_fraction: float,
                        max_useful_tokens: int, num_blocks: Optional[int] = None) -> int:
        """Blocks for a memory budget: a fraction of what is free now, never more than the
        engine can use (every sequence slot at full length), unless `num_blocks` is explicit."""
        if num_blocks is not None:
            if num_blocks <= 0:
                raise ValueError(f"num_blocks must be positive, got {num_blocks}")
            return int(num_blocks)
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {memory_fraction}")
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        budget = int(available_memory(device) * memory_fraction) // per_block
        useful = -(-max_useful_tokens // block_size)
        blocks = min(budget, useful)
        if blocks <= 0:
            raise RuntimeError(f"not enough free memory for even one KV block of {per_block} bytes")
        return blocks
