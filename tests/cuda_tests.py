"""Where a test needs CUDA: the reason a CUDA test skips on this machine (or None where it runs), the
marks that skip it, and the devices a `device`-parametrized test runs on.

A CUDA test is collected everywhere and skipped, with what is missing as the reason, where it cannot
run, so `pytest -rs` shows the gap (`-m "not cuda"` leaves them out). Deciding costs nothing on a
machine without a GPU: torch is asked first, and eecore._C only where torch sees a GPU.
"""
from __future__ import annotations

import pytest
import torch

NEEDS = "needs a CUDA GPU and eecore built with CUDA kernels"


def _missing() -> str | None:
    if torch.version.cuda is None:
        return f"{NEEDS}: torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"{NEEDS}: torch sees no CUDA device"
    from eecore import _C

    if not _C.build_info().get("cuda"):
        return f"{NEEDS}: this eecore build has CPU kernels only (eecore._C.build_info()['cuda'] is false)"
    return None


CUDA_MISSING: str | None = _missing()

# a test function's decorator (with @pytest.mark.cuda), or a module's pytestmark (CUDA_MARKS)
needs_cuda = pytest.mark.skipif(CUDA_MISSING is not None, reason=CUDA_MISSING or "")
CUDA_MARKS = [pytest.mark.cuda, needs_cuda]

# the values of a test's `device` argument: "cuda" is always there, skipped where CUDA_MISSING says why
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]
