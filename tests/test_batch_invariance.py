"""EECORE_BATCH_INVARIANT on the CPU: nothing to change (the CPU kernels give a row of a pass of a
few rows a one-row step's bits: test_op_linear.py; a GGUF file's exact kernel, a lone row aside, the
bits of any other streamed pass: test_op_linear_gguf.py), and torch's process-wide cuBLAS switch
left alone. The GPU side is
tested in test_cuda_vs_cpu.py (the ops) and test_engine_cuda.py (self-speculation = full depth)."""
import torch

from eecore.device import apply_batch_invariance


def test_the_cpu_changes_nothing(monkeypatch):
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    monkeypatch.setenv("EECORE_BATCH_INVARIANT", "1")
    assert not apply_batch_invariance(torch.device("cpu"))
    assert (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction) == before


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("EECORE_BATCH_INVARIANT", raising=False)
    assert not apply_batch_invariance(torch.device("cuda"))
    monkeypatch.setenv("EECORE_BATCH_INVARIANT", "0")
    assert not apply_batch_invariance(torch.device("cuda"))
