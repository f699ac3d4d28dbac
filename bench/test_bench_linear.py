"""linear (the model's projections) against torch.mm / addmm at decode sizes of SmolLM2 and a
2048-wide model. Run: python -m pytest bench/test_bench_linear.py --benchmark-enable"""
import pytest
import torch

from eecore import ops

SHAPES = {"smollm2-gate-up": (576, 3072), "smollm2-down": (1536, 576), "2048-qkv": (2048, 3072)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["eecore", "torch"])
def test_bench_linear(benchmark, impl, shape, rows, dtype):
    k, n = SHAPES[shape]
    inp = torch.randn(rows, k, dtype=dtype)
    weight = torch.randn(n, k, dtype=dtype) / k ** 0.5
    out = torch.empty(rows, n, dtype=dtype)
    benchmark.group = f"linear {shape} M={rows} {dtype}"
    if impl == "eecore":
        benchmark(ops.linear, out, inp, weight)
    else:
        benchmark(torch.mm, inp, weight.t(), out=out)
