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


# Weight-only int8 against the dense dtypes, with the weights streamed from memory as in a decode
# step: each call walks the same number of copies of the weight, enough that even the int8 ones
# (the smallest) total 64 MB and none stays in the L3.
STREAM_BYTES = 64 << 20


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", ["smollm2-gate-up", "smollm2-down"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_bench_linear_int8_streamed(benchmark, weights, shape, rows):
    from eecore.models.int8_weights import Int8Weight, project

    k, n = SHAPES[shape]
    copies = -(-STREAM_BYTES // (n * k))
    dense = torch.randn(n, k) / k ** 0.5
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32  # int8: fp32 activations
    if weights == "int8":
        stack = [Int8Weight.quantize(dense) for _ in range(copies)]
    else:
        stack = [dense.to(dtype, copy=True) for _ in range(copies)]
    inp = torch.randn(rows, k, dtype=dtype)
    out = torch.empty(rows, n, dtype=dtype)
    benchmark.group = f"linear streamed {shape} M={rows} ({copies} weights a call)"

    def run():
        for w in stack:
            project(out, inp, w)

    benchmark(run)


# GGUF blocks (the embedded model's Q4_1, and Q8_0) against dense fp32 on the same number of
# weights, at the row counts of a decode step (1) and of a verify pass of 1-4 drafts (2, 5): enough
# copies that the smallest (Q4_1, 0.625 bytes a weight) totals 64 MB, so every format streams from
# memory. Past one row the exact kernel's register tiles run, whose weight rows are short streams
# that the tiles prefetch themselves.
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("shape", ["smollm2-gate-up", "smollm2-down"])
@pytest.mark.parametrize("weights", ["fp32", "Q4_1", "Q8_0"])
def test_bench_linear_gguf_streamed(benchmark, weights, shape, rows):
    from eecore.models.gguf_quantize import quantize

    k, n = SHAPES[shape]
    dense = torch.randn(n, k) / k ** 0.5
    copies = -(-STREAM_BYTES * 8 // (n * k * 5))  # Q4_1: 20 bytes a block of 32 weights
    if weights == "fp32":
        stack = [dense.clone() for _ in range(copies)]
        call = lambda o, x, w: ops.linear(o, x, w)  # noqa: E731
    else:
        blocks = torch.from_numpy(quantize(dense.numpy(), weights))
        stack = [blocks.clone() for _ in range(copies)]
        qtype = ops.GGUF_QUANT_TYPES[weights]
        call = lambda o, x, w: ops.linear_gguf(o, x, w, qtype)  # noqa: E731
    inp = torch.randn(rows, k)
    out = torch.empty(rows, n)
    benchmark.group = f"linear gguf streamed {shape} M={rows} ({copies} weights a call)"

    def run():
        for w in stack:
            call(out, inp, w)

    benchmark(run)
