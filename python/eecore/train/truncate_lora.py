"""Shrink an exit-ready adapter file's LoRA pairs to a lower rank: each delta's best approximation of
that rank (truncated SVD), the exit adapters and the draft vocabulary kept as they are.

    python -m eecore.train.truncate_lora IN.safetensors OUT.safetensors --rank 24

A trained delta's singular values fall off, so a lower rank costs little (the file records how
much of each delta's energy it kept); the draft-layers card measures what it costs in acceptance.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from eecore.models.exit_adapter import ExitAdapters


def truncate_file(src: str, dst: str, rank: int) -> ExitAdapters:
    adapters = ExitAdapters.load(src)
    if adapters.lora is None:
        raise ValueError(f"{src}: has no LoRA pairs to truncate")
    lora = adapters.lora.truncated(rank)
    # the share of each delta's squared Frobenius norm (its energy) the truncation keeps
    kept = [float(lora.delta(p).square().sum() / adapters.lora.delta(p).square().sum().clamp_min(1e-30))
            for p in adapters.lora.pairs]
    info = dict(adapters.info, truncated={"from_rank": adapters.lora.rank, "to_rank": rank,
                                          "energy_kept_min": min(kept), "energy_kept_mean": sum(kept) / len(kept)})
    out = dataclasses.replace(adapters, lora=lora, info=info)
    out.save(dst)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="an exit-ready adapter file (format 2, with LoRA pairs)")
    ap.add_argument("dst", help="where to write the truncated file")
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    out = truncate_file(args.src, args.dst, args.rank)
    t = out.info["truncated"]
    print(f"{args.dst}: rank {t['from_rank']} -> {t['to_rank']}, energy kept: mean {t['energy_kept_mean']:.4f}, "
          f"min {t['energy_kept_min']:.4f}")


if __name__ == "__main__":
    main()
