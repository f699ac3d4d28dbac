"""Which device an engine runs on: `LLM(device=...)`, and the presets tuned per kind of device."""
from __future__ import annotations


import torch

from eecore import envs


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


# EECORE_BATCH_INVARIANT=1: on a GPU, kernels whose result for a row does not depend on how many rows
# share the call (include/eecore/batch_invariant.h says what the ops change), so self-speculation's
# verify passes give each row a decode step's bits and its greedy outputs are exactly full depth's
# at any batch size. cuBLAS must not split K for that, which torch allows only on the cuBLASLt
# backend: both switches are process-wide, so they are set when an engine is built on a GPU with
# the variable set, and stay set. The cost is in docs/cuda.md "Batch invariance".
def apply_batch_invariance(device: torch.device) -> bool:
    """Turns cuBLAS's split-K off for bf16 and fp16 where EECORE_BATCH_INVARIANT=1 on a GPU; whether
    it did."""
    if device.type != "cuda" or not envs.flag("EECORE_BATCH_INVARIANT"):
        return False
    # torch honours allow_splitk=False only on the cuBLASLt backend, and refuses it elsewhere.
    torch.backends.cuda.preferred_blas_library("cublaslt")
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = (False, False)
    matmul.allow_fp16_reduced_precision_reduction = (False, False)
    from eecore import _C

    _C.set_batch_invariant(True)  # the kernels' side, where LLM(batch_invariant=True) set it
    return True
