"""The memory-bandwidth roofline of small-batch decoding on this machine.

At batch 1 a decode step reads every weight it uses once and does two flops per weight, so on a
CPU its speed is set by how fast the weights stream from memory, not by arithmetic. These helpers
turn that into numbers the benchmarks print next to their measurements:

- `read_bandwidth_gbs()`: how fast this machine streams a large fp32 buffer (a reduction over
  1 GiB, far larger than any cache), measured now, in the same run as the benchmark;
- `decode_weight_bytes(model, ...)`: the weight bytes one decode step reads at a given depth,
  counting the layers that run, the K/V projections `kv_fill` reads for the skipped layers, and
  the LM head;
- so `read_bandwidth_gbs() * 1e9 / decode_weight_bytes(...)` is the fastest a batch-1 step can go.
"""
from __future__ import annotations

import statistics

import torch

from common import call_seconds
from eecore.speculative.guard import layer_weight_bytes, weight_bytes


def read_bandwidth_gbs(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Median GB/s of summing a `size_bytes` fp32 buffer (read-only streaming)."""
    buf = torch.ones(size_bytes // 4, dtype=torch.float32)
    # the warm-up call faults the pages in
    return size_bytes / statistics.median(call_seconds(buf.sum, repeats)) / 1e9


def decode_weight_bytes(model, layers_run: float | None = None) -> float:
    """Weight bytes a decode step reads when it exits after `layers_run` layers (default: all).

    Fractional depths interpolate, so a mean exit depth can be passed. Layers above the exit cost
    only their K/V projections (what `kv_fill` reads); every step pays the final norm and LM head.
    """
    L = model.num_layers
    depth = L if layers_run is None else layers_run
    per_layer = statistics.mean(layer_weight_bytes(model, i) for i in range(L))
    c = model.config
    kv_rows = 2 * c.num_kv_heads * c.head_dim
    # kv_fill's stacked K/V projections are dense in the model's dtype, whatever form the layers keep
    kv_fill_per_layer = kv_rows * c.hidden_size * torch.empty((), dtype=model.dtype).element_size()
    head = weight_bytes(model.lm_head) + weight_bytes(model.final_norm)
    return depth * per_layer + (L - depth) * kv_fill_per_layer + head


def weight_bytes_ideal_speedup(model, mean_layers: float) -> float:
    """Full-depth bytes over exit-depth bytes: the speed-up a bandwidth-bound step can reach."""
    return decode_weight_bytes(model) / decode_weight_bytes(model, mean_layers)
