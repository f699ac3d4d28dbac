"""Host data for the GPU without waiting for it.

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
