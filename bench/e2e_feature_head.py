"""A feature draft head (docs/feature-heads.md) against full depth and the exit-ready layer preset,
on held-out prompts of each domain, the same run, side by side.

    PYTHONPATH=python python bench/e2e_feature_head.py --head head.safetensors [--kinds code chat everyday]
        [--batch-sizes 1] [--max-tokens 64] [--requests 8] [--drafts 1 4] [--repeats 2] [--quantized] [--adaptive]
        [--lookup]

For each kind of prompt (bench/common.py's held-out sets) and batch size: full depth, the head at
each `--drafts` length and `--top-k` tree width (d = 1, k = 1: the head's first draft alone, whose
acceptance is the first-draft acceptance), the exit-ready layer preset's copy alone, the preset
without its prompt lookup (the copy and the head, the planner picking) and as it drafts (lookup
first), each group of prompts run by every engine in an order that rotates. Rows: tokens per second,
the ratio to full depth, drafts accepted / drafted, tokens a round, and whether every output equals
full depth's. Over dequantized fp32 weights by default (`--quantized`: the embedded file's own
blocks, eecore's default). Writes bench/results/<machine>/cpu-feature-head-<date>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import eecore
from common import bench_prompt_ids, cpu_model, rotated, save_results, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=None, help="a feature head file (python -m eecore.train.feature_head; "
                    "default: the shipped one)")
    ap.add_argument("--kinds", nargs="+", default=["code", "chat", "everyday"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="prompts of each kind")
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--top-k", type=int, nargs="+", default=[1], help="the head's token trees: K tokens verified "
                    "at each drafted position (FeatureDrafts.top_k)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quantized", action="store_true", help="the embedded file's own blocks (default: dequantized)")
    ap.add_argument("--adaptive", action="store_true", help="also the head with the draft planner's lengths")
    ap.add_argument("--lookup", action="store_true", help="also the head (the planner's lengths) with prompt lookup "
                    "first (LookupDrafts(2, 4)): a sequence whose text ends in a match drafts it")
    ap.add_argument("--out-name", default="cpu-feature-head")
    args = ap.parse_args()
    torch.set_num_threads(2)
    quant = None if args.quantized else "none"
    full = eecore.LLM(quantization=quant, max_num_seqs=max(args.batch_sizes))
    engines = {f"feature head d={d}" + (f" k={k}" if k > 1 else ""): eecore.LLM(
        quantization=quant, max_num_seqs=max(args.batch_sizes), speculative=eecore.SelfSpeculativeConfig(
            num_speculations=d, feature=eecore.FeatureDrafts(head=args.head, top_k=k)))
        for d in args.drafts for k in args.top_k}
    if args.adaptive:  # the head's lengths from the draft planner (which turns drafting off where it does not pay)
        engines["feature head adaptive"] = eecore.LLM(
            quantization=quant, max_num_seqs=max(args.batch_sizes),
            speculative=eecore.SelfSpeculativeConfig(num_speculations=max(args.drafts), adaptive=True,
                                                     feature=eecore.FeatureDrafts(head=args.head)))
    preset = eecore.SelfSpeculativeConfig.exit_ready("layer", device="cpu")
    # the preset as it drafts (prompt lookup first, then the copy or the shipped head, the planner
    # picking), without its lookup, and its copy alone
    head = dataclasses.replace(preset.feature, head=args.head)
    for label, config in (("exit-ready layer, copy alone", dataclasses.replace(preset, feature=None, lookup=None)),
                          ("exit-ready layer, no lookup", dataclasses.replace(preset, feature=head, lookup=None)),
                          ("exit-ready layer", dataclasses.replace(preset, feature=head))):
        engines[label] = eecore.LLM(quantization=quant, exit_adapter=True, max_num_seqs=max(args.batch_sizes),
                                    speculative=config)
    if args.lookup:
        lookup = eecore.LookupDrafts(min_ngram=2, max_ngram=4)
        engines["feature head + lookup"] = eecore.LLM(
            quantization=quant, max_num_seqs=max(args.batch_sizes), speculative=eecore.SelfSpeculativeConfig(
                num_speculations=preset.num_speculations, adaptive=True, feature=head, lookup=lookup))
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for llm in [full, *engines.values()]:  # (first calls pay one-time costs)
        llm.generate([[1, 2, 3]], eecore.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for kind in args.kinds:
        prompts = bench_prompt_ids(full.tokenizer, kind, args.requests)
        for batch in args.batch_sizes:
            groups = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
            reference = [o.token_ids for g in groups for o in full.generate(g, params)]
            # every engine, full depth among them, on each group of prompts in turn, in an order
            # that rotates from group to group: the machine's drift (a neighbour, the clock) falls
            # on all of them alike, and so does the place in the order (an engine run right after
            # full depth ran 3-5% slower than the same engine elsewhere in the order)
            t_full = [0.0] * args.repeats
            t_this = {label: [0.0] * args.repeats for label in engines}
            outs: dict = {label: [] for label in engines}
            names = [None, *engines]  # None: full depth
            for r in range(args.repeats):
                for i, g in enumerate(groups):
                    for label in rotated(names, r + i):
                        if label is None:
                            t_full[r] += timed(full.generate, g, params)[1]
                            continue
                        out, t = timed(engines[label].generate, g, params)
                        t_this[label][r] += t
                        if r == args.repeats - 1:
                            outs[label] += out
            for label in engines:
                row = _row(kind, batch, label, outs[label], reference, t_full, t_this[label])
                rows.append(row)
                print(f"{kind:9s} batch {batch:2d}  {label:28s} {row['tok_s']:7.1f} tok/s  {row['vs_full']:5.2f}x full"
                      f"  accepted {row['acceptance']:.2f}  {row['tokens_per_round']:.2f} tokens a round"
                      f"  identical {row['identical']}", flush=True)
    path = save_results(args.out_name, dict(cpu=cpu_model(), head=args.head, quantized=args.quantized,
                                            max_tokens=args.max_tokens, requests=args.requests, rows=rows))
    print(f"wrote {path}")


def _row(kind, batch, label, outs, reference, t_full, t_this) -> dict:
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.metrics.get("num_drafted_tokens", 0) for o in outs)
    accepted = sum(o.metrics.get("num_accepted_tokens", 0) for o in outs)
    rounds = sum(o.metrics.get("num_verify_steps", 0) for o in outs)
    return dict(kind=kind, batch=batch, config=label, tok_s=tokens / statistics.median(t_this),
                vs_full=statistics.median(t_full) / statistics.median(t_this),
                acceptance=accepted / max(drafted, 1), tokens_per_round=tokens / max(rounds, 1),
                feature_drafted=sum(o.metrics.get("num_feature_drafted_tokens", 0) for o in outs),
                layer_drafted=sum(o.metrics.get("num_layer_drafted_tokens", 0) for o in outs),
                lookup_drafted=sum(o.metrics.get("num_lookup_drafted_tokens", 0) for o in outs),
                identical=f"{sum(o.token_ids == r for o, r in zip(outs, reference))}/{len(outs)}",
                t_full=t_full, t=t_this)


if __name__ == "__main__":
    main()
