"""CUDA benchmarks of the eecore ops against their natural PyTorch baselines (issue 3's goals).

Run on a GPU machine, from the repository root, after building the extension:

    PYTHONPATH=python python bench/cuda_ops.py            # full sizes
    PYTHONPATH=python python bench/cuda_ops.py --quick    # fewer iterations

It measures, in one process so that every ratio compares numbers taken side by side:
  * device-to-device copy bandwidth (the roofline the attention decode is held to);
  * paged_attention decode, B=64, context 4096, Hq=32, Hkv=8, D=128, bf16: achieved bandwidth
    (bytes of K/V/q/out moved) vs the copy bandwidth (goal >= 80%), and time vs torch SDPA on
    pre-gathered KV, and flash_attn_with_kvcache where flash-attn is installed;
  * lm_head_top2_gap vs matmul + softmax + topk at B in {1, 8, 64}, V=128256, d=2048 (goal >= 1.5x);
  * kv_fill over 15 layers vs the per-layer loop (matmul, RoPE, reshape_and_cache) (goal >= 3x);
and writes bench/results/<gpu>/<device>-<date>.json and a short .md next to it (<gpu>: e.g. nvidia-h100
for an NVIDIA H100 80GB HBM3, whose <device> is nvidia-h100-80gb-hbm3).
Times are medians of CUDA-event timings after warm-up.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

def time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `iters` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(iters: int) -> dict:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters)
    return {"bytes": 2 * n, "ms": ms, "GBps": 2 * n / ms / 1e6}


# ---- paged_attention decode ----------------------------------------------------------------

def bench_decode(ops, iters: int, copy_gbps: float) -> dict:
    B, ctx, Hq, Hkv, D, BS = 64, 4096, 32, 8, 128, 16
    dtype = torch.bfloat16
    blocks_per_seq = ctx // BS
    num_blocks = B * blocks_per_seq
    k_cache = torch.randn(num_blocks, BS, Hkv, D, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks, device="cuda").view(B, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    scale = D ** -0.5
    eecore_ms = time_ms(lambda: ops.paged_attention(out, q, k_cache, v_cache, block_table, seq_lens, qsl, 1, scale,
                                                    True, None), iters)
    moved = 2 * B * ctx * Hkv * D * 2 + 2 * q.numel() * 2  # K and V once, q in, out
    result = {"shape": dict(B=B, context=ctx, Hq=Hq, Hkv=Hkv, D=D, block_size=BS, dtype="bf16"),
              "eecore_ms": eecore_ms, "eecore_GBps": moved / eecore_ms / 1e6}
    result["fraction_of_copy_bandwidth"] = result["eecore_GBps"] / copy_gbps

    # torch SDPA on KV gathered beforehand (the gather is not timed: the baseline gets it for free).
    k = k_cache[block_table.long()].view(B, ctx, Hkv, D).transpose(1, 2).contiguous()
    v = v_cache[block_table.long()].view(B, ctx, Hkv, D).transpose(1, 2).contiguous()
    q4 = q.view(B, Hq, 1, D)
    try:
        sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
        sdpa()
    except TypeError:  # torch without enable_gqa
        k_rep, v_rep = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        sdpa = lambda: F.scaled_dot_product_attention(q4, k_rep, v_rep, scale=scale)  # noqa: E731
    result["sdpa_ms"] = time_ms(sdpa, iters)
    result["speedup_vs_sdpa"] = result["sdpa_ms"] / eecore_ms
    with torch.no_grad():
        ref = sdpa().view(B, Hq, D)
    result["max_abs_diff_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
    k = v = None  # free the gathered KV (sdpa holds it) before flash-attn's own

    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        result["flash_attn"] = "not installed"
    else:
        page = 256  # flash-attn's paged KV wants pages of a multiple of 256 tokens
        fa_table = torch.randperm(B * ctx // page, device="cuda").view(B, ctx // page).to(torch.int32)
        fa_k = torch.randn(B * ctx // page, page, Hkv, D, dtype=dtype, device="cuda")
        fa_v = torch.randn_like(fa_k)
        fa = lambda: flash_attn_with_kvcache(q.view(B, 1, Hq, D), fa_k, fa_v, cache_seqlens=seq_lens,  # noqa: E731
                                             block_table=fa_table, softmax_scale=scale, causal=True)
        result["flash_attn_ms"] = time_ms(fa, iters)
        result["speedup_vs_flash_attn"] = result["flash_attn_ms"] / eecore_ms
    return result


# ---- lm_head_top2_gap -----------------------------------------------------------------------

def bench_lm_head(ops, iters: int) -> list[dict]:
    V, d = 128256, 2048
    weight = (torch.randn(V, d, device="cuda") * d ** -0.5).to(torch.bfloat16)
    rows = []
    for B in (1, 8, 64):
        hidden = torch.randn(B, d, dtype=torch.bfloat16, device="cuda")

        def baseline():
            probs = torch.softmax((hidden @ weight.T).float(), dim=-1)
            top2 = probs.topk(2, dim=-1)
            return top2.values[:, 0] - top2.values[:, 1], top2.indices[:, 0]

        fused_ms = time_ms(lambda: ops.lm_head_top2_gap(hidden, weight), iters)
        base_ms = time_ms(baseline, iters)
        gap, top1 = ops.lm_head_top2_gap(hidden, weight)
        ref_gap, ref_top1 = baseline()
        rows.append({"B": B, "V": V, "d": d, "eecore_ms": fused_ms, "matmul_softmax_topk_ms": base_ms,
                     "speedup": base_ms / fused_ms, "weight_GBps": V * d * 2 / fused_ms / 1e6,
                     "top1_agreement": (top1 == ref_top1).float().mean().item(),
                     "max_gap_diff": (gap - ref_gap).abs().max().item()})
    return rows


# ---- kv_fill --------------------------------------------------------------------------------

def bench_kv_fill(ops, iters: int) -> dict:
    # A Llama-3.2-1B-like model exiting after layer 1 of 16: 15 layers to fill for a decode batch.
    L, T, d, Hkv, D, BS, max_pos = 15, 64, 2048, 8, 64, 16, 8192
    dtype = torch.bfloat16
    num_blocks = 64
    kv_cache = torch.zeros(L, 2, num_blocks, BS, Hkv, D, dtype=dtype, device="cuda")
    hidden = torch.randn(T, d, dtype=dtype, device="cuda")
    weight = (torch.randn(L, 2 * Hkv * D, d, device="cuda") * d ** -0.5).to(dtype)
    angles = torch.randn(max_pos, D // 2, device="cuda")
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (T,), device="cuda")
    slots = torch.randperm(num_blocks * BS, device="cuda")[:T]
    start = torch.zeros(T, dtype=torch.int32, device="cuda")
    ones = torch.ones(d, dtype=dtype, device="cuda")
    normed = torch.empty_like(hidden)
    no_heads = torch.empty(T, 0, D, dtype=dtype, device="cuda")  # rotary_embedding's key: nothing

    def fused():
        ops.kv_fill(kv_cache, hidden, weight, None, cos_sin, positions, slots, start, 1e-5, True)

    def per_layer():
        ops.rms_norm(normed, hidden, ones, 1e-5)
        for layer in range(L):
            kv = normed @ weight[layer].T
            k = kv[:, :Hkv * D].view(T, Hkv, D)
            v = kv[:, Hkv * D:].view(T, Hkv, D)
            ops.rotary_embedding(positions, k, no_heads, cos_sin, True)
            ops.reshape_and_cache(k, v, kv_cache[layer, 0], kv_cache[layer, 1], slots)

    fused_ms = time_ms(fused, iters)
    loop_ms = time_ms(per_layer, iters)
    return {"layers": L, "tokens": T, "d": d, "Hkv": Hkv, "D": D, "eecore_ms": fused_ms, "per_layer_loop_ms": loop_ms,
            "speedup": loop_ms / fused_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timed iterations")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for the .json and .md results (default: bench/results/<gpu>)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_ops.py needs a CUDA device")
    from eecore import _C, ops  # noqa: F401  (imported here so --help works without a build)
    from common import RESULTS_DIR, device_folder, device_slug

    iters = 10 if args.quick else 50
    device = torch.cuda.get_device_name()
    copy = copy_bandwidth(iters)
    results = {
        "device": device,
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "build_info": dict(_C.build_info()),
        "copy_bandwidth": copy,
        "paged_attention_decode": bench_decode(ops, iters, copy["GBps"]),
        "lm_head_top2_gap": bench_lm_head(ops, iters),
        "kv_fill": bench_kv_fill(ops, iters),
    }
    decode, heads, fill = results["paged_attention_decode"], results["lm_head_top2_gap"], results["kv_fill"]
    results["goals"] = {
        "decode >= 80% of copy bandwidth": decode["fraction_of_copy_bandwidth"] >= 0.8,
        "decode faster than SDPA": decode["speedup_vs_sdpa"] > 1.0,
        "lm_head_top2_gap >= 1.5x at every B": all(r["speedup"] >= 1.5 for r in heads),
        "kv_fill >= 3x the per-layer loop": fill["speedup"] >= 3.0,
    }

    out = args.out or Path(RESULTS_DIR) / device_folder(device)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{device_slug(device)}-{results['date']}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# eecore CUDA benchmarks: {device}, {results['date']}", "",
             f"torch {results['torch']}, CUDA {results['cuda']}; medians of {iters} CUDA-event timings.", "",
             f"- D2D copy: {copy['GBps']:.0f} GB/s (read + write)",
             f"- paged_attention decode (B=64, ctx 4096, 32/8 heads, D=128, bf16): {decode['eecore_ms']:.3f} ms, "
             f"{decode['eecore_GBps']:.0f} GB/s = {100 * decode['fraction_of_copy_bandwidth']:.0f}% of copy; "
             f"SDPA on gathered KV {decode['sdpa_ms']:.3f} ms ({decode['speedup_vs_sdpa']:.2f}x)"
             + (f"; flash_attn_with_kvcache {decode['flash_attn_ms']:.3f} ms "
                f"({decode['speedup_vs_flash_attn']:.2f}x)" if "flash_attn_ms" in decode else ""),
             "- lm_head_top2_gap (V=128256, d=2048, bf16) vs matmul+softmax+topk: "
             + ", ".join(f"B={r['B']}: {r['eecore_ms']:.3f} vs {r['matmul_softmax_topk_ms']:.3f} ms "
                         f"({r['speedup']:.2f}x)" for r in heads),
             f"- kv_fill over {fill['layers']} layers ({fill['tokens']} tokens): {fill['eecore_ms']:.3f} ms vs "
             f"per-layer loop {fill['per_layer_loop_ms']:.3f} ms ({fill['speedup']:.2f}x)", "",
             "Goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in results["goals"].items()), ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out / stem}.json and .md")


if __name__ == "__main__":
    main()
