"""What `paged_attention` costs a decode step and a verify pass at SmolLM2-135M's head shapes (9 query
heads over 3 KV heads, 64 dims, blocks of 16 scattered at random over the cache), by batch, context
and query rows a sequence: the time, the KV bytes it reads per second and the multiply-adds per
second (two per query head, key and dim: the scores and the value sums).

Decode attention on a CPU is bound by that arithmetic rather than by the cache's bytes, so the
multiply-add rate is the figure to compare across builds (`PYTHONPATH=<checkout>/python`), run
alternately on one machine:

    python bench/ops_attention_rows.py [--dtypes float32 bfloat16] [--repeats 300] [--out-name attention-rows]

writes bench/results/<machine>/<out-name>-<date>.json.
"""
from __future__ import annotations

import argparse
import time

import torch

from common import cpu_model, save_results
from eecore import ops

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# (sequences, context, query rows a sequence): decode and verify passes at batch 8, a long
# context, batch 1 and a serving batch
CASES = ((8, 128, 1), (8, 128, 2), (8, 1024, 1), (8, 1024, 2), (1, 1024, 1), (32, 512, 1))


def time_case(dtype: torch.dtype, num_seqs: int, context: int, q_len: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    per_seq = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = num_seqs * per_seq + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    block_table = torch.randperm(num_blocks, generator=g)[: num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    starts = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
    query = torch.randn(num_seqs * q_len, NUM_Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    out = torch.empty_like(query)

    def run():
        ops.paged_attention(out, query, k_cache, v_cache, block_table, seq_lens, starts, q_len, HEAD_DIM ** -0.5, True)

    for _ in range(20):
        run()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    seconds = (time.perf_counter() - start) / repeats
    kv_bytes = num_seqs * context * NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()
    macs = 2 * num_seqs * q_len * NUM_Q_HEADS * context * HEAD_DIM
    return dict(dtype=str(dtype).removeprefix("torch."), seqs=num_seqs, context=context, q_len=q_len,
                us=seconds * 1e6, kv_gbs=kv_bytes / seconds / 1e9, gmacs=macs / seconds / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--out-name", default="attention-rows")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}")
    rows = []
    for name in args.dtypes:
        for case in CASES:
            r = time_case(getattr(torch, name), *case, args.repeats)
            rows.append(r)
            print(f"{r['dtype']:9s} B={r['seqs']:2d} context {r['context']:4d} q_len {r['q_len']}: {r['us']:7.1f} us, "
                  f"KV {r['kv_gbs']:5.1f} GB/s, {r['gmacs']:5.1f} G multiply-adds/s", flush=True)
    print(f"results: {save_results(args.out_name, dict(heads=[NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM], cases=rows))}")


if __name__ == "__main__":
    main()
