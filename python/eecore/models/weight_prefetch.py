"""Weights read into a GPU's L2 cache on a side stream while the main stream leaves HBM idle.

At small batches a decode layer's kernels take turns with the memory bus: its projections stream
their weights from HBM, while attention over a short context, the norms and the activation are
bound by latency and read almost nothing (on an H200 a Llama-3.2-1B step at batch 1 spent ~15 us a
layer in such kernels). With `EECORE_PREFETCH_WEIGHTS=1`, each layer forks a side stream as its
attention starts and asks L2 for the output projection's weights and the first part of the MLP's
gate/up weights (`ops.prefetch_l2`, up to half the L2); the projections then read them from L2.
The fork joins the main stream at the end of the layer, so a CUDA graph captures both streams. A
prefetch is a hint: no value changes, on or off. Steps of more than `EECORE_PREFETCH_MAX_ROWS` rows
(default: no limit) fetch nothing, for when attention over long contexts at large batches keeps
HBM busy itself. Off: on an H200 the projections it fed took the same time with it (Llama-1B's
gate/up 18.1 and 18.4 us at batch 1) and end to end it gave 0.99-1.03x at batch 1-8
(bench/results/nvidia-h200/nvidia-h200-2026-11-27-switches.md).
"""
from __future__ import annotations

from typing import Optional

import torch

from eecore import envs, ops


class WeightPrefetch:
    def __init__(self, device: torch.device, budget_bytes: int, max_rows: int):
        self.side = torch.cuda.Stream(device)
        self.budget = budget_bytes
        self.max_rows = max_rows
        self.forks = 0  # prefetches issued (the tests read it)

    @classmethod
    def for_device(cls, device: torch.device) -> Optional["WeightPrefetch"]:
        """A prefetcher where EECORE_PREFETCH_WEIGHTS=1 and the device is a GPU, else None."""
        if device.type != "cuda" or not envs.flag("EECORE_PREFETCH_WEIGHTS"):
            return None
        max_rows = envs.integer("EECORE_PREFETCH_MAX_ROWS")
        return cls(device, torch.cuda.get_device_properties(device).L2_cache_size // 2, max_rows)

    def takes(self, rows: int) -> bool:
        return rows <= self.max_rows

    def fetch(self, weights) -> None:
        """Asks L2 for `weights` in order (dense CUDA tensors; others are skipped), up to the budget,
        on the side stream, after the work queued so far on the current stream."""
        self.side.wait_stream(torch.cuda.current_stream())
        left = self.budget
        with torch.cuda.stream(self.side):
            for w in weights:
                if left <= 0:
                    break
                if isinstance(w, torch.Tensor) and w.is_cuda and w.is_contiguous():
                    size = w.numel() * w.element_size()
                    ops.prefetch_l2(w, min(size, left))
                    left -= size
        self.forks += 1

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.side)
