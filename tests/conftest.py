"""Shared fixtures: the devices every op test runs on, a seeded generator per test, and the GPU's
batch-invariant mode."""
import zlib

import pytest
import torch

from cuda_tests import DEVICES


def pytest_generate_tests(metafunc):
    # Every test that takes a `device` argument runs on the CPU and on CUDA; where no GPU (or no CUDA
    # build) is there, its CUDA case is collected and skipped with the reason (cuda_tests.py).
    if "device" in metafunc.fixturenames and not any(m.name == "parametrize" and "device" in m.args[0]
                                                     for m in metafunc.definition.iter_markers()):
        metafunc.parametrize("device", DEVICES)


@pytest.fixture(autouse=True)
def _seed(request):
    # A fresh, reproducible stream per test: inputs differ between tests but not between runs.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def batch_invariant(monkeypatch):
    """EECORE_BATCH_INVARIANT=1 with cuBLASLt's split-K off (eecore.device.apply_batch_invariance),
    torch's process-wide switches restored afterwards. GPU tests only."""
    from eecore.device import apply_batch_invariance

    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    saved_library = torch.backends.cuda.preferred_blas_library()
    monkeypatch.setenv("EECORE_BATCH_INVARIANT", "1")
    assert apply_batch_invariance(torch.device("cuda"))
    yield
    matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved
    torch.backends.cuda.preferred_blas_library(saved_library)
