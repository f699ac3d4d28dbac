"""paged_attention decode on CUDA: both kernels against SDPA over a few shapes, as a fraction of the
device-to-device copy bandwidth measured in the same process.

    PYTHONPATH=python python bench/cuda_decode_sweep.py

The planner sends decode batches (max_query_len == 1) to the SIMT kernel. Because max_query_len is
only an upper bound, passing 2 for the same decode batch selects the tensor-core kernel instead,
so the two can be timed on identical inputs. SDPA gets its KV pre-gathered and contiguous, for free.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda import copy_bandwidth, time_ms  # noqa: E402

SHAPES = [  # B, context, Hq, Hkv, D, block size
    (64, 4096, 32, 8, 128, 16),
    (64, 4096, 32, 8, 128, 32),
    (8, 4096, 32, 8, 128, 16),
    (64, 1024, 32, 8, 128, 16),
    (64, 4096, 32, 8, 64, 16),
]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("cuda_decode_sweep.py needs a CUDA device")
    from eecore import ops

    copy = copy_bandwidth(20)["GBps"]
    print(f"{torch.cuda.get_device_name()}: D2D copy {copy:.0f} GB/s (read + write)")
    print("B ctx Hq/Hkv D block | SIMT | tensor cores | SDPA pre-gathered")
    for B, ctx, Hq, Hkv, D, BS in SHAPES:
        blocks = ctx // BS
        k_cache = torch.randn(B * blocks, BS, Hkv, D, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(B * blocks, device="cuda").view(B, blocks).to(torch.int32)
        seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        starts = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda")
        moved = 2 * B * ctx * Hkv * D * 2  # K and V, once

        def share(ms: float) -> str:
            return f"{ms * 1000:.0f} us, {moved / ms / 1e6 / copy:.0%}"

        cells = []
        for max_query_len in (1, 2):
            out = torch.empty_like(q)
            cells.append(share(time_ms(lambda: ops.paged_attention(out, q, k_cache, v_cache, table, seq_lens, starts,
                                                                   max_query_len, D ** -0.5, True, None), 30)))
        k = k_cache[table.long()].view(B, ctx, Hkv, D).transpose(1, 2).contiguous()
        v = v_cache[table.long()].view(B, ctx, Hkv, D).transpose(1, 2).contiguous()
        sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q.view(B, Hq, 1, D), k, v, scale=D ** -0.5,
                                                                  enable_gqa=True), 30)
        print(f"{B} {ctx} {Hq}/{Hkv} {D} {BS} | {cells[0]} | {cells[1]} | {share(sdpa_ms)}")


if __name__ == "__main__":
    main()
