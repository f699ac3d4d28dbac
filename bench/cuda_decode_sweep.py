"""paged_attention decode on CUDA, every kernel against SDPA on the same KV, as a fraction of the
device-to-device copy bandwidth measured in the same process.

    PYTHONPATH=python python bench/cuda_decode_sweep.py [--quick] [--headline-only]
        [--kernels auto decode_mma:v1 decode_mma:v2 decode_mma:2 decode mma] [--max-kv-gib 16]

The sweep crosses batch B (1..256), context (256..32k), GQA (1, 4, 8 query heads per KV head with
32 query heads) and head dim (64, 128), bf16, block size 16, random block tables, and skips cells
whose KV exceeds --max-kv-gib (SDPA needs a second, gathered copy). Each kernel is forced in turn
through EECORE_PAGED_ATTENTION_KERNEL ("auto" is the planner's own choice), with options after
colons: `decode_mma:2` (EECORE_DECODE_MMA_STAGES=2: 2-stage pipelines, 3 CTAs per SM) and
`decode_mma:v1` / `decode_mma:v2` (EECORE_DECODE_MMA_LDMATRIX=0 / 1: the first version, or v2:
ldmatrix fragments, whole-tile copies and masks, lazy rescaling), combinable as
`decode_mma:2:v2`; without v1 or v2 the build's default; `f<N>` sets EECORE_DECODE_MMA_V2_FLAGS=N
(which of v2's changes run, e.g. `decode_mma:v2:f0` for ldmatrix alone), `s<N>` sets
EECORE_DECODE_MIN_SPLIT_TOKENS=N (the planner's shortest context split, default 256). SDPA gets its KV
pre-gathered and contiguous, for free. Every timing is the median per call over CUDA-graph replays
of 10 calls, so launch gaps do not hide the kernels of small cells. Outputs are checked against
SDPA's before any timing.

Writes bench/results/<gpu>/<device>-decode-sweep-<date>.json and .md (cuda_ops.py names both). --headline-only runs only
B=64, context 4096, 32/8 heads, D=128 (the cell the issue's goal names), e.g. under ncu; --cell
B,CTX,HQ,HKV,D runs another one cell (neither writes results). --sequential-blocks gives each
sequence its blocks in order instead of a random permutation: what scattered blocks cost.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_ops import copy_bandwidth  # noqa: E402

KERNEL_ENV = "EECORE_PAGED_ATTENTION_KERNEL"
STAGES_ENV = "EECORE_DECODE_MMA_STAGES"
LDMATRIX_ENV = "EECORE_DECODE_MMA_LDMATRIX"
V2_FLAGS_ENV = "EECORE_DECODE_MMA_V2_FLAGS"
MIN_SPLIT_ENV = "EECORE_DECODE_MIN_SPLIT_TOKENS"
VARIANT_ENVS = (KERNEL_ENV, STAGES_ENV, LDMATRIX_ENV, V2_FLAGS_ENV, MIN_SPLIT_ENV)


def variant_env(kernel: str) -> dict:
    """The environment that selects `kernel`: a kernel name with options after colons."""
    name, *options = kernel.split(":")
    env = {KERNEL_ENV: name}
    for option in options:
        if option in ("2", "3"):
            env[STAGES_ENV] = option
        elif option in ("v1", "v2"):
            env[LDMATRIX_ENV] = "0" if option == "v1" else "1"
        elif option[:1] == "f" and option[1:].isdigit():
            env[V2_FLAGS_ENV] = option[1:]
        elif option[:1] == "s" and option[1:].isdigit():
            env[MIN_SPLIT_ENV] = option[1:]
        else:
            raise SystemExit(f"--kernels: unknown option {option!r} in {kernel!r} "
                             "(expected 2, 3, v1, v2, f<N> or s<N>)")
    return env


def select_variant(kernel: str) -> None:
    for key in VARIANT_ENVS:
        os.environ.pop(key, None)
    os.environ.update(variant_env(kernel))
HEADLINE = (64, 4096, 32, 8, 128)


def cells(headline_only: bool, only: Optional[tuple] = None):
    """(B, context, Hq, Hkv, D, query rows per sequence): the decode sweep, then verification; or
    only the headline cell, or only the cell `only`."""
    if only is not None:
        yield only
        return
    if headline_only:
        yield HEADLINE + (1,)
        return
    for B in (1, 8, 64, 256):
        for ctx in (256, 4096, 32768):
            for Hkv in (32, 8, 4):  # GQA 1, 4, 8
                for D in (64, 128):
                    yield B, ctx, 32, Hkv, D, 1
    for B in (8, 64):  # self-speculation's verify pass: d + 1 rows a sequence
        for q_len in (2, 4, 8):
            yield B, 4096, 32, 8, 128, q_len


def time_graph(fn, calls: int = 10, replays: int = 10) -> float:
    """Median milliseconds per call of `fn`, from replays of a CUDA graph holding `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def run_cell(ops, B, ctx, Hq, Hkv, D, q_len, kernels, copy_gbps, block_size=16, sequential=False):
    dtype = torch.bfloat16
    blocks = ctx // block_size
    k_cache = torch.randn(B * blocks, block_size, Hkv, D, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    # a served cache's blocks are scattered; sequential ones show what that scattering costs (a
    # block holds every KV head's rows of its 16 tokens: one head's part is 16 runs of D values)
    order = torch.arange(B * blocks, device="cuda") if sequential else torch.randperm(B * blocks, device="cuda")
    table = order.view(B, blocks).to(torch.int32)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(B + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(B * q_len, Hq, D, dtype=dtype, device="cuda")
    moved = 2 * B * ctx * Hkv * D * 2 + 2 * q.numel() * 2  # K and V once, q in, out
    scale = D ** -0.5

    k = k_cache[table.long()].view(B, ctx, Hkv, D).transpose(1, 2).contiguous()
    v = v_cache[table.long()].view(B, ctx, Hkv, D).transpose(1, 2).contiguous()
    q4 = q.view(B, q_len, Hq, D).transpose(1, 2)
    # Query row i (of q_len) sits at position ctx - q_len + i: it sees keys up to there.
    mask = None if q_len == 1 else (torch.arange(ctx, device="cuda")[None, :]
                                    <= torch.arange(ctx - q_len, ctx, device="cuda")[:, None])
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale,  # noqa: E731
                                                  enable_gqa=True)
    with torch.no_grad():
        expected = sdpa().transpose(1, 2).reshape(B * q_len, Hq, D).float()

    row = {"B": B, "context": ctx, "Hq": Hq, "Hkv": Hkv, "D": D, "q_len": q_len, "block_size": block_size,
           "bytes": moved}
    sdpa_ms = time_graph(sdpa)
    row["sdpa_us"] = sdpa_ms * 1e3
    row["sdpa_of_copy"] = moved / sdpa_ms / 1e6 / copy_gbps
    for kernel in kernels:
        select_variant(kernel)
        out = torch.full_like(q, float("nan"))
        call = lambda: ops.paged_attention(out, q, k_cache, v_cache, table, seq_lens, starts,  # noqa: E731
                                           q_len, scale, True, None)
        call()
        torch.cuda.synchronize()
        err = ((out.float() - expected).norm() / expected.norm()).item()
        ms = time_graph(call)
        row[f"{kernel}_us"] = ms * 1e3
        row[f"{kernel}_of_copy"] = moved / ms / 1e6 / copy_gbps
        row[f"{kernel}_vs_sdpa"] = sdpa_ms / ms
        row[f"{kernel}_rel_err"] = err
    for key in VARIANT_ENVS:
        os.environ.pop(key, None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["auto", "decode_mma:v1", "decode_mma:v2", "decode_mma:2",
                                                     "decode", "mma"],
                    help="kernels to time (EECORE_PAGED_ATTENTION_KERNEL values, options after colons: see above)")
    ap.add_argument("--headline-only", action="store_true")
    ap.add_argument("--sequential-blocks", action="store_true",
                    help="each sequence's blocks in order, one after another (default: a random permutation)")
    ap.add_argument("--cell", default=None, metavar="B,CTX,HQ,HKV,D[,ROWS]",
                    help="time this one cell only (Nsight Compute of a small cell: --cell 1,256,32,8,128)")
    ap.add_argument("--max-kv-gib", type=float, default=16.0)
    ap.add_argument("--out", type=Path, default=None, help="results directory (default: bench/results/<gpu>)")
    args = ap.parse_args()
    for kernel in args.kernels:
        variant_env(kernel)  # unknown options fail before any GPU work
    only = None
    if args.cell is not None:
        try:
            only = tuple(int(v) for v in args.cell.split(","))
        except ValueError:
            only = ()
        if len(only) not in (5, 6):
            raise SystemExit(f"--cell: expected B,CTX,HQ,HKV,D[,ROWS] as integers, got {args.cell!r}")
        only = only + (1,) * (6 - len(only))
    if not torch.cuda.is_available():
        raise SystemExit("cuda_decode_sweep.py needs a CUDA device")
    from eecore import ops
    from common import RESULTS_DIR, device_folder, device_slug

    device = torch.cuda.get_device_name()
    copy = copy_bandwidth(20)["GBps"]
    print(f"{device}: D2D copy {copy:.0f} GB/s (read + write)", flush=True)
    rows = []
    for B, ctx, Hq, Hkv, D, q_len in cells(args.headline_only, only):
        kv_gib = 2 * B * ctx * Hkv * D * 2 / 2 ** 30
        if kv_gib > args.max_kv_gib:
            continue
        row = run_cell(ops, B, ctx, Hq, Hkv, D, q_len, args.kernels, copy, sequential=args.sequential_blocks)
        rows.append(row)
        cols = " | ".join(f"{k} {row[f'{k}_us']:.0f} us {row[f'{k}_of_copy']:.0%} {row[f'{k}_vs_sdpa']:.2f}x"
                          for k in args.kernels)
        print(f"B={B} ctx={ctx} {Hq}/{Hkv} D={D} q={q_len}: sdpa {row['sdpa_us']:.0f} us {row['sdpa_of_copy']:.0%} | {cols}",
              flush=True)
        torch.cuda.empty_cache()

    summary = {}
    decode_rows = [r for r in rows if r["q_len"] == 1]
    for k in args.kernels:
        worst = min(decode_rows, key=lambda r: r[f"{k}_vs_sdpa"])
        summary[k] = {"decode_min_vs_sdpa": worst[f"{k}_vs_sdpa"],
                      "decode_min_cell": {c: worst[c] for c in ("B", "context", "Hq", "Hkv", "D")},
                      "max_rel_err": max(r[f"{k}_rel_err"] for r in rows)}
    head = next((r for r in rows if (r["B"], r["context"], r["Hq"], r["Hkv"], r["D"], r["q_len"]) == HEADLINE + (1,)),
                None)
    payload = {"device": device, "date": dt.date.today().isoformat(), "torch": torch.__version__,
               "copy_GBps": copy, "kernels": args.kernels, "rows": rows, "summary": summary, "headline": head}
    if not args.headline_only and only is None and not args.sequential_blocks:
        out = args.out or Path(RESULTS_DIR) / device_folder(device)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"{device_slug(device)}-decode-sweep-{payload['date']}"
        stem.with_suffix(".json").write_text(json.dumps(payload, indent=2))
        lines = [f"# paged_attention decode sweep: {device}, {payload['date']}", "",
                 f"torch {torch.__version__}; D2D copy {copy:.0f} GB/s; bf16, block size 16; "
                 "us per call (CUDA-graph replays), share of copy bandwidth, speed vs SDPA on gathered KV.", "",
                 "| B | ctx | Hq/Hkv | D | q rows | SDPA | " + " | ".join(args.kernels) + " |",
                 "|---|---|---|---|---|---|" + "---|" * len(args.kernels)]
        for r in rows:
            cols = " | ".join(f"{r[f'{k}_us']:.0f} us {r[f'{k}_of_copy']:.0%} {r[f'{k}_vs_sdpa']:.2f}x"
                              for k in args.kernels)
            lines.append(f"| {r['B']} | {r['context']} | {r['Hq']}/{r['Hkv']} | {r['D']} | {r['q_len']} | "
                         f"{r['sdpa_us']:.0f} us {r['sdpa_of_copy']:.0%} | {cols} |")
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print(f"wrote {stem}.json/.md")
    for k, s in summary.items():
        print(f"{k}: decode worst {s['decode_min_vs_sdpa']:.2f}x SDPA at {s['decode_min_cell']}, "
              f"max rel err {s['max_rel_err']:.1e}")
    if head:
        print("headline B=64 ctx=4096 32/8 D=128: " +
              ", ".join(f"{k} {head[f'{k}_of_copy']:.0%} of copy, {head[f'{k}_vs_sdpa']:.2f}x SDPA"
                        for k in args.kernels))


if __name__ == "__main__":
    main()
