"""Host data for the GPU without waiting for it, and the GPU's results back in one wait.

`torch.tensor(values, device="cuda")`, or any copy from pageable host memory, first waits for every
kernel already queued on the stream. Where the host means to run ahead of the GPU (decode ahead
launches a step before reading the last one back; draft and verify ahead queue a round's passes
back to back), such a copy quietly turns the overlap back into lockstep.
"""
from __future__ import annotations

from typing import Optional

import torch


def device_tensor(values: list, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A small host list as a tensor on `device`, staged in pinned memory (the caching host
    allocator reuses it once the copy is done) and copied behind the queued work: a sampled decode
    step's parameters or a batch's row indices, which a pageable copy would send only once the step
    that decode ahead means to overlap had finished."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def read_back(*tensors: torch.Tensor, packed: Optional[bool] = None) -> list[list]:
    """Each tensor `.tolist()`. On a GPU (`packed`, by default where the first tensor is) every
    read-back waits for the queued work, so the tensors come back in one copy, packed as float64
    (exact for fp32 values and for integers below 2**53) and split again, integer tensors as ints."""
    if not (tensors[0].is_cuda if packed is None else packed):
        return [t.tolist() for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        part = flat[start: start + t.numel()]
        start += t.numel()
        if not t.is_floating_point():
            part = [int(v) for v in part]
        if t.dim() == 2:
            width = t.shape[1]
            part = [part[i * width: (i + 1) * width] for i in range(t.shape[0])]
        elif t.dim() != 1:
            raise ValueError(f"read_back: tensors of 1 or 2 dimensions, got shape {tuple(t.shape)}")
        out.append(part)
    return out
