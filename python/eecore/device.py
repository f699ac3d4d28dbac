"""Which device an engine runs on: `LLM(device=...)`, and the presets tuned per kind of device."""
from __future__ import annotations

import torch


def resolve_device(device) -> torch.device:
    """`device` as LLM takes it: "cpu", "cuda" (or "cuda:N"), or None for CUDA where eecore has CUDA
    kernels and a GPU is visible, else the CPU."""
    from eecore import _C

    has_cuda_kernels = bool(_C.build_info().get("cuda"))
    if device is None:
        return torch.device("cuda" if has_cuda_kernels and torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not has_cuda_kernels:
        raise ValueError("LLM: device='cuda' but this eecore was built without CUDA kernels; rebuild with a "
                         "CUDA build of torch and nvcc (see docs/cuda.md)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"LLM: 'device' must be cpu or cuda, got {device!r}")
    return dev
