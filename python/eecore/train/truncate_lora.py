"""Shrink an exit-ready adapter file: its LoRA pairs to a lower rank (each delta's best approximation
of that rank, by truncated SVD), and/or its projections to int8 storage (format 3, see
eecore.models.exit_adapter); the draft vocabulary is kept as it is.

    python -m eecore.train.truncate_lora IN.safetensors OUT.safetensors --rank 24
    python -m eecore.train.truncate_lora IN.safetensors OUT.safetensors --int8

A trained delta's singular values fall off, so a lower rank costs little in energy (the file records
how much of each delta's it kept), but the draft-layers card found the rank-64 pairs' gain in
acceptance in their weak directions: int8 storage keeps every rank at half the bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional

from eecore.models.exit_adapter import ExitAdapters


def truncate_file(src: str, dst: str, rank: Optional[int], int8: bool = False) -> ExitAdapters:
    adapters = ExitAdapters.load(src)
    if rank is None:
        adapters.save(dst, int8=int8)
        return adapters
    if adapters.lora is None:
        raise ValueError(f"{src}: has no LoRA pairs to truncate")
    lora = adapters.lora.truncated(rank)
    # the share of each delta's squared Frobenius norm (its energy) the truncation keeps
    kept = [float(lora.delta(p).square().sum() / adapters.lora.delta(p).square().sum().clamp_min(1e-30))
            for p in adapters.lora.pairs]
    info = dict(adapters.info, truncated={"from_rank": adapters.lora.rank, "to_rank": rank,
                                          "energy_kept_min": min(kept), "energy_kept_mean": sum(kept) / len(kept)})
    out = dataclasses.replace(adapters, lora=lora, info=info)
    out.save(dst, int8=int8)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="an exit-ready adapter file (with LoRA pairs, for --rank)")
    ap.add_argument("dst", help="where to write the smaller file")
    ap.add_argument("--rank", type=int, default=None, help="the pairs' new rank (default: as they are)")
    ap.add_argument("--int8", action="store_true", help="store the projections as int8 (format 3)")
    args = ap.parse_args(argv)
    if args.rank is None and not args.int8:
        ap.error("nothing to shrink: give --rank R, --int8, or both")
    out = truncate_file(args.src, args.dst, args.rank, args.int8)
    size = f"{os.path.getsize(args.dst):,} bytes{' (int8)' if args.int8 else ''}"
    if args.rank is None:
        print(f"{args.dst}: {size}")
        return
    t = out.info["truncated"]
    print(f"{args.dst}: rank {t['from_rank']} -> {t['to_rank']}, energy kept: mean {t['energy_kept_mean']:.4f}, "
          f"min {t['energy_kept_min']:.4f}; {size}")


if __name__ == "__main__":
    main()
