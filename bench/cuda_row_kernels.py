"""A decoder layer's row kernels on CUDA, each against its alternative behind a selector, at
SmolLM2-135M's and Llama-3.2-1B's shapes (bf16):

    PYTHONPATH=python python bench/cuda_row_kernels.py [--models smollm2-135m llama-3.2-1b]
        [--rows 1 4 8] [--repeats 20]

  * linear, each projection of a layer and the LM head: cuBLAS against the few-row kernels
    (EECORE_LINEAR_KERNEL=gemv, and gemv_mma on tensor cores), beside the weight's read time at
    the copy bandwidth;
  * silu_and_mul: ATen's four launches (EECORE_SILU_AND_MUL_KERNEL=aten) against the fused kernel,
    the default;
  * rotary_embedding_and_cache: two launches (EECORE_ROTARY_AND_CACHE_KERNEL=separate) against
    one, the default;
  * argmax over a step's fp32 logits: ATen's max over the last dim (what the engine ran before)
    against eecore's argmax op, the default;
  * a layer's chain of them (norm, QKV, RoPE and cache, output projection, norm, gate/up,
    activation, down): default, with the tensor-core few-row linear, and with it and programmatic
    dependent launch (EECORE_PDL=1); and the same layer in the four launches of the fused
    projections (qkv_projection, linear_residual, gate_up_projection, down), without and with PDL.

Each figure is one call's share of a CUDA graph that repeats the call `--repeats` times back to
back, replayed and timed with CUDA events: what the call costs inside a captured decode step,
launch gaps included. Writes bench/results/<gpu>/<device>-row-kernels-<date>.json. `--device cpu`
runs every call once eagerly (a check of the script, no timing).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from common import device_folder, device_slug, save_results
from cuda_e2e import MODELS, SHAPES, with_env

FLAGGED = {"EECORE_LINEAR_KERNEL": "gemv_mma"}


def per_call_us(fn, repeats: int, device: str) -> float:
    """Microseconds a call of fn costs inside a CUDA graph of `repeats` calls (fn once on the CPU)."""
    if device != "cuda":
        fn()
        return 0.0
    fn()  # warm-up outside the capture (cuBLAS handles, lazy state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(times)


class Layer:
    """One decoder layer's weights and buffers at a model's shape, for `rows` decode rows."""

    def __init__(self, name: str, rows: int, device: str):
        from eecore import ops

        self.ops, self.rows = ops, rows
        c = SHAPES[name]
        d, ff, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim", d // hq)
        self.hq, self.hkv = hq, hkv
        g = torch.Generator().manual_seed(0)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)

        qkv_out = (hq + 2 * hkv) * self.head_dim
        self.weights = {"qkv": randn(qkv_out, d, scale=d ** -0.5), "o": randn(d, hq * self.head_dim, scale=d ** -0.5),
                        "gate_up": randn(2 * ff, d, scale=d ** -0.5), "down": randn(d, ff, scale=ff ** -0.5),
                        "lm_head": randn(vocab, d, scale=d ** -0.5)}
        self.norm = randn(d).abs() + 0.5
        self.hidden, self.x = randn(rows, d), randn(rows, d)
        self.qkv, self.attn = randn(rows, qkv_out), randn(rows, hq * self.head_dim)
        self.gate_up, self.act = randn(rows, 2 * ff), randn(rows, ff)
        self.logits = randn(rows, vocab)
        self.logits_f32 = self.logits.float()
        self.top_values = torch.empty(rows, device=device)
        self.top_ids = torch.empty(rows, dtype=torch.int64, device=device)
        angles = torch.randn(4096, self.head_dim // 2, generator=g)
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
        self.k_cache, self.v_cache = (torch.zeros(64, 16, hkv, self.head_dim, dtype=torch.bfloat16, device=device)
                                      for _ in range(2))
        self.positions = torch.arange(rows, device=device) + 100
        self.slots = torch.arange(rows, device=device) * 5
        self.inputs = {"qkv": self.x, "o": self.attn, "gate_up": self.x, "down": self.act, "lm_head": self.x}
        self.outputs = {"qkv": self.qkv, "o": self.x, "gate_up": self.gate_up, "down": self.x, "lm_head": self.logits}

    def linear(self, which: str):
        return lambda: self.ops.linear(self.outputs[which], self.inputs[which], self.weights[which])

    def silu(self):
        return lambda: self.ops.silu_and_mul(self.act, self.gate_up)

    def rotary_and_cache(self):
        q, k, v = self.qkv.view(self.rows, self.hq + 2 * self.hkv, self.head_dim).split(
            [self.hq, self.hkv, self.hkv], dim=1)
        return lambda: self.ops.rotary_embedding_and_cache(self.positions, q, k, v, self.cos_sin, True, self.k_cache,
                                                           self.v_cache, self.slots)

    def argmax(self, aten: bool):
        if aten:
            return lambda: torch.max(self.logits_f32, dim=-1, out=(self.top_values, self.top_ids))
        return lambda: self.ops.argmax(self.logits_f32, out=self.top_ids)

    def chain(self):
        """A layer's row kernels in decode order (attention itself left out: it is no row kernel)."""
        steps = [lambda: self.ops.rms_norm(self.x, self.hidden, self.norm, 1e-5), self.linear("qkv"),
                 self.rotary_and_cache(), self.linear("o"),
                 lambda: self.ops.fused_add_rms_norm(self.x, self.hidden, self.norm, 1e-5), self.linear("gate_up"),
                 self.silu(), lambda: self.ops.linear(self.hidden, self.act, self.weights["down"], accumulate=True)]

        return _in_turn(steps)

    def fused_chain(self):
        """The same layer through the fused projection ops (EECORE_FUSED_PROJECTIONS=1's path)."""
        ops, w = self.ops, self.weights
        steps = [lambda: ops.qkv_projection(self.qkv, self.x, self.hidden, self.norm, 1e-5, w["qkv"], None,
                                            self.positions, self.cos_sin, True, self.k_cache, self.v_cache,
                                            self.slots),
                 lambda: ops.linear_residual(self.x, self.hidden, self.attn, w["o"]),
                 lambda: ops.gate_up_projection(self.act, self.gate_up, self.x, self.hidden, self.norm, 1e-5,
                                                w["gate_up"]),
                 lambda: ops.linear(self.hidden, self.act, w["down"], accumulate=True)]
        return _in_turn(steps)


def _in_turn(steps):
    def run():
        for step in steps:
            step()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu only to check the script itself")
    ap.add_argument("--no-save", action="store_true", help="print only (a run under a profiler)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_row_kernels.py needs a CUDA device")
    copy_gbps = None
    if args.device == "cuda":
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_gbps = 2 * src.numel() / per_call_us(lambda: dst.copy_(src), 3, "cuda") / 1e3
        del src, dst
    rows_out = []
    for name in args.models:
        for rows in args.rows:
            layer = Layer(name, rows, args.device)
            timings = {}
            for which, weight in layer.weights.items():
                base = per_call_us(layer.linear(which), args.repeats, args.device)
                gemv = with_env({"EECORE_LINEAR_KERNEL": "gemv"}, per_call_us, layer.linear(which), args.repeats,
                                args.device)
                mma = with_env({"EECORE_LINEAR_KERNEL": "gemv_mma"}, per_call_us, layer.linear(which),
                               args.repeats, args.device)
                # A stream that only reads can use all the bandwidth a copy splits between reading and
                # writing (the decode sweep's convention). Weights under the L2's size (50 MB on an
                # H200) stay in it across a graph's replays and can beat this.
                read_us = weight.numel() * weight.element_size() / copy_gbps / 1e3 if copy_gbps else None
                timings[f"linear {which}"] = dict(default_us=base, selected_us=gemv, mma_us=mma,
                                                  weight_read_us=read_us)
            timings["silu_and_mul"] = dict(
                default_us=with_env({"EECORE_SILU_AND_MUL_KERNEL": "aten"}, per_call_us, layer.silu(),
                                    args.repeats, args.device),
                selected_us=per_call_us(layer.silu(), args.repeats, args.device))
            timings["rotary_embedding_and_cache"] = dict(
                default_us=with_env({"EECORE_ROTARY_AND_CACHE_KERNEL": "separate"}, per_call_us,
                                    layer.rotary_and_cache(), args.repeats, args.device),
                selected_us=per_call_us(layer.rotary_and_cache(), args.repeats, args.device))
            timings["argmax"] = dict(default_us=per_call_us(layer.argmax(aten=True), args.repeats, args.device),
                                     selected_us=per_call_us(layer.argmax(aten=False), args.repeats, args.device))
            chain = dict(default_us=per_call_us(layer.chain(), args.repeats, args.device),
                         selected_us=with_env(FLAGGED, per_call_us, layer.chain(), args.repeats, args.device),
                         selected_pdl_us=with_env(dict(FLAGGED, EECORE_PDL="1"), per_call_us, layer.chain(),
                                                  args.repeats, args.device),
                         fused_us=with_env(FLAGGED, per_call_us, layer.fused_chain(), args.repeats, args.device),
                         fused_pdl_us=with_env(dict(FLAGGED, EECORE_PDL="1"), per_call_us, layer.fused_chain(),
                                               args.repeats, args.device))
            timings["layer chain"] = chain
            rows_out.append(dict(model=name, rows=rows, timings=timings))
            print(f"{name}, {rows} rows (us a call in a graph: cuBLAS / few-row / few-row on tensor cores, "
                  "unfused / fused, ATen / eecore; the chain: default / with gemv_mma / and PDL / fused projections / "
                  "and PDL):")
            for label, t in timings.items():
                extra = (f" / with PDL {t['selected_pdl_us']:.2f} / fused {t['fused_us']:.2f}"
                         f" / fused with PDL {t['fused_pdl_us']:.2f}" if "selected_pdl_us" in t
                         else f" / mma {t['mma_us']:.2f}" if "mma_us" in t else "")
                limit = f"   (weight read at copy bandwidth {t['weight_read_us']:.2f})" if t.get("weight_read_us") else ""
                print(f"    {label:28s} {t['default_us']:8.2f} / {t['selected_us']:8.2f}{extra}{limit}", flush=True)
    if args.no_save:
        return
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    path = save_results(f"{device_slug(device_name)}-row-kernels",
                        dict(device=device_name, copy_GBps=copy_gbps, repeats=args.repeats, rows=rows_out),
                        folder=device_folder(device_name) if args.device == "cuda" else None)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
