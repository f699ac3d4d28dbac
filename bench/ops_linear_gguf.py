"""linear_gguf against eecore's dense `linear` (bf16 and fp32 weights) on SmolLM2-135M's projections.

All 30 layers' qkv, o, gate_up and down projections (random weights, the shapes of the model;
for the K formats, whose blocks hold 256 weights, the 576-wide inputs widened to 768), quantized to
each block format (eecore.models.gguf_quantize), run at M rows as a decode step does; each
configuration is timed in the same process, alternated, medians of `--repeats` passes. Prints ms
per pass over the 120 projections and the weight bytes each reads, and the GB/s that makes.
every format is also timed with 8-bit activations ("q8-act": linear_gguf_q8
on the repacked weights, EECORE_GGUF_ACTIVATIONS=q8's kernel).

`--layers 1` keeps the weights in cache (one layer's projections, 2-4 MB): the kernels' arithmetic
rate without the memory stream.

    python bench/ops_linear_gguf.py [--rows 1 4 5 8] [--types Q4_1 Q8_0 Q4_0 Q4_K Q6_K] [--threads 2] [--layers 30]
                                [--out-name linear-gguf]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
import eecore
from eecore import ops
from eecore.models.gguf_quantize import quantize
from common import call_seconds, cpu_model, save_results

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [N, K]
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8])
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_0", "Q4_K", "Q6_K"],
                    choices=list(ops.GGUF_QUANT_TYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers of projections a pass runs")
    ap.add_argument("--out-name", default="linear-gguf")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}, {args.threads} threads; {args.layers * len(SHAPES)} projections of SmolLM2-135M")
    rows = []
    for name in args.types:
        qtype = ops.GGUF_QUANT_TYPES[name]
        rng = np.random.default_rng(0)
        widen = (lambda k: -(-k // 256) * 256) if name.endswith("_K") else (lambda k: k)
        dense = [(rng.standard_normal((n, widen(k))).astype(np.float32) * 0.02, n, widen(k))
                 for _ in range(args.layers) for n, k in SHAPES]
        quantized = [(torch.from_numpy(quantize(w, name)), n, k) for w, n, k in dense]
        packed = [(ops.repack_gguf_q8(q, qtype, k), n, k) for q, n, k in quantized] \
            if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K") else None
        weights = {"bf16": [(torch.from_numpy(w).to(torch.bfloat16), n, k) for w, n, k in dense],
                   "fp32": [(torch.from_numpy(w), n, k) for w, n, k in dense]}
        for m in args.rows:
            xs = {dtype: {k: torch.randn(m, k).to(dtype) for k in {widen(576), widen(1536)}}
                  for dtype in (torch.float32, torch.bfloat16)}
            outs = {dtype: {n: torch.empty(m, n, dtype=dtype) for n in (576, 960, 3072)} for dtype in xs}
            f32, b16 = torch.float32, torch.bfloat16
            runs = {
                name: lambda: [ops.linear_gguf(outs[f32][n], xs[f32][k], q, qtype) for q, n, k in quantized],
                "bf16": lambda: [ops.linear(outs[b16][n], xs[b16][k], w) for w, n, k in weights["bf16"]],
                "fp32": lambda: [ops.linear(outs[f32][n], xs[f32][k], w) for w, n, k in weights["fp32"]],
            }
            nbytes = {name: sum(q.nbytes for q, _, _ in quantized),
                      "bf16": sum(w.nbytes for w, _, _ in weights["bf16"]),
                      "fp32": sum(w.nbytes for w, _, _ in weights["fp32"])}
            if packed is not None:  # the same weights with 8-bit activations (linear_gguf_q8)
                runs["q8-act"] = lambda: [ops.linear_gguf_q8(outs[f32][n], xs[f32][k], p, qtype) for p, n, k in packed]
                nbytes["q8-act"] = sum(p.nbytes for p, _, _ in packed)
            ms = {label: statistics.median(call_seconds(run, args.repeats)) * 1e3 for label, run in runs.items()}
            for label in runs:
                gbs = nbytes[label] / ms[label] / 1e6
                macs = m * sum(n * k for _, n, k in dense) / ms[label] / 1e6
                print(f"M={m:3d} {label:>5}: {ms[label]:7.2f} ms, {nbytes[label] / 1e6:6.1f} MB, {gbs:5.1f} GB/s, "
                      f"{macs:6.1f} G multiply-adds/s"
                      + ("" if label == name else f"   ({ms[label] / ms[name]:.2f}x the {name} time)"))
                rows.append(dict(format=name, weights=label, rows=m, ms=ms[label], mbytes=nbytes[label] / 1e6,
                                 gb_per_s=gbs, gmacs_per_s=macs))
    print(f"results: {save_results(args.out_name, dict(eecore=eecore.__version__, threads=args.threads, layers=args.layers, rows=rows))}")


if __name__ == "__main__":
    main()
