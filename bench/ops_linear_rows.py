"""What `ops.linear` costs a decoder layer as the rows grow: SmolLM2-135M's four projections
(qkv, o, gate_up, down; random weights of their shapes), from the cache and from DRAM.

A decode step of B sequences with r rows each runs every projection over B x r rows. At one row
the pass streams the weights, so its time is their bytes over the memory bandwidth; more rows add
arithmetic, which is free only while the kernel computes faster than the weights arrive. This
measures where that stops, with the weights of a few layers (they stay in the last-level cache, so
the time is the kernel's arithmetic) and of all 30 (streamed from DRAM, as in a real step). It also
times the draft copy's prompt catch-up (8 layers, weight-only int8) against the same projections
as fp32 weights and as one bf16 `torch.mm` of the int8 values (oneDNN, which uses AMX where the CPU
has it), the comparison behind docs/draft-layers-history.md's notes on batch 8. Where the CPU runs
AMX-INT8 tiles (eecore.models.amx_weights), it also times the copy's int8 layers as `[N, K]`
weights (the dot kernel) against their tiles, by rows and for the catch-up, in the dtype
`--int8-input-dtype`.

    python bench/ops_linear_rows.py [--rows 1 4 8 12 16 24] [--cached-layers 4] [--catch-up-rows 100 752]
                                [--int8-input-dtype bfloat16] [--out-name linear-rows]

writes bench/results/<machine>/<out-name>-<date>.json.
"""
from __future__ import annotations

import argparse

import torch

from common import call_seconds, cpu_model, save_results
from eecore.models.int8_weights import Int8Weight, project

# (out_features, in_features) of one SmolLM2-135M layer: qkv, o_proj, gate_up, down
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
NUM_LAYERS = 30
DRAFT_LAYERS = 8


def layer_weights(num_layers: int) -> list[torch.Tensor]:
    return [torch.randn(n, k) / k ** 0.5 for _ in range(num_layers) for n, k in LAYER_SHAPES]


def best_seconds(fn, repeats: int) -> float:
    # the warm-up call also brings the weights into the cache, for the cached set
    return min(call_seconds(fn, repeats))


def buffers(rows: int, dtype=torch.float32):
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for _, k in LAYER_SHAPES}}
    outputs = {n: torch.empty(rows, n, dtype=dtype) for n in {n for n, _ in LAYER_SHAPES}}
    return inputs, outputs


def projections_pass(weights, rows: int, dtype=torch.float32):
    inputs, outputs = buffers(rows, dtype)

    def run():
        for w in weights:
            project(outputs[w.shape[0]], inputs[w.shape[1]], w)
    return run


def row_sweep(args) -> list[dict]:
    results = []
    for where, num_layers in (("cache", args.cached_layers), ("dram", NUM_LAYERS)):
        weights = layer_weights(num_layers)
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for rows in args.rows:
            flops = 2 * rows * sum(w.numel() for w in weights)
            seconds = best_seconds(projections_pass(weights, rows), args.repeats)
            results.append(dict(weights=where, layers=num_layers, rows=rows, ms_per_layer=1e3 * seconds / num_layers,
                                gflops=flops / seconds / 1e9, gbs=nbytes / seconds / 1e9))
            r = results[-1]
            print(f"{where:5s} ({num_layers:2d} layers, {nbytes / 1e6:4.0f} MB) rows {rows:3d}: "
                  f"{r['ms_per_layer']:.3f} ms a layer, {r['gflops']:6.1f} GFLOP/s, {r['gbs']:5.1f} GB/s", flush=True)
        del weights
    return results


def catch_up(args) -> list[dict]:
    dense = layer_weights(DRAFT_LAYERS)
    int8 = [Int8Weight.quantize(w) for w in dense]
    bf16 = [w.data.to(torch.bfloat16) for w in int8]  # the int8 values, exact in bf16
    results = []
    for rows in args.catch_up_rows:
        inputs16 = {k: x.to(torch.bfloat16) for k, x in buffers(rows)[0].items()}

        def bf16_mm():
            for w in bf16:
                torch.mm(inputs16[w.shape[1]], w.t())

        row = dict(rows=rows, layers=DRAFT_LAYERS,
                   int8_ms=1e3 * best_seconds(projections_pass(int8, rows), args.repeats),
                   fp32_ms=1e3 * best_seconds(projections_pass(dense, rows), args.repeats),
                   bf16_mm_ms=1e3 * best_seconds(bf16_mm, args.repeats))
        results.append(row)
        print(f"catch-up of {rows} rows through {DRAFT_LAYERS} layers: int8 linear {row['int8_ms']:.1f} ms, "
              f"fp32 linear {row['fp32_ms']:.1f} ms, bf16 torch.mm {row['bf16_mm_ms']:.1f} ms", flush=True)
    return results


def int8_tiles(args) -> list[dict]:
    """The draft copy's 8 int8 layers, `[N, K]` against AMX-INT8 tiles, same integers, same inputs."""
    from eecore.models.amx_weights import amx_available, tiled

    if not amx_available(torch.int8):
        print("no AMX-INT8 here: int8 tiles not timed")
        return []
    dtype = getattr(torch, args.int8_input_dtype)
    flat = [Int8Weight.quantize(w) for w in layer_weights(DRAFT_LAYERS)]
    tiles = [tiled(w) for w in flat]
    results = []
    for rows in list(args.rows) + list(args.catch_up_rows):
        row = dict(rows=rows, layers=DRAFT_LAYERS, input_dtype=args.int8_input_dtype,
                   flat_ms=1e3 * best_seconds(projections_pass(flat, rows, dtype), args.repeats),
                   tiled_ms=1e3 * best_seconds(projections_pass(tiles, rows, dtype), args.repeats))
        results.append(row)
        print(f"int8 copy ({DRAFT_LAYERS} layers, {args.int8_input_dtype} rows) rows {rows:3d}: [N, K] "
              f"{row['flat_ms']:.2f} ms, AMX tiles {row['tiled_ms']:.2f} ms ({row['flat_ms'] / row['tiled_ms']:.2f}x)",
              flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24])
    ap.add_argument("--cached-layers", type=int, default=4, help="layers whose weights stay in the cache")
    ap.add_argument("--catch-up-rows", type=int, nargs="*", default=[100, 752])
    ap.add_argument("--repeats", type=int, default=7, help="best of this many passes")
    ap.add_argument("--int8-input-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                    help="the rows' dtype against the int8 copy's [N, K] and tiled weights")
    ap.add_argument("--out-name", default="linear-rows", help="results file prefix")
    args = ap.parse_args()
    for name in ("rows", "catch_up_rows"):
        if any(r < 1 for r in getattr(args, name)):
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.cached_layers <= NUM_LAYERS:
        ap.error(f"--cached-layers must be in [1, {NUM_LAYERS}], got {args.cached_layers}")
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}")
    path = save_results(args.out_name, dict(model_shapes="SmolLM2-135M", layer_shapes=LAYER_SHAPES,
                                            rows=row_sweep(args), catch_up=catch_up(args),
                                            int8_tiles=int8_tiles(args)))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
