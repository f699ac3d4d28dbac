"""The CPU layer preset's variants against full depth in one process, each prompt run by every engine
in an order that turns from prompt to prompt (an engine right after full depth ran 3-5% slower than
elsewhere in the order): a comparison that a run of its own per variant, whose ratios move by up
to 0.2 between processes, cannot make.

    PYTHONPATH=python python bench/analysis/preset_ab.py [--kinds chat everyday code] [--repeats 3]
        [--quantized] [--heads OLD.safetensors NEW.safetensors] [--copy-alone] [--no-plans] [--tree DEPTH NODES]

Engines: full depth, the preset as it ships, and with --heads the preset with each head file in
its place; --tree the preset whose head's trees reach DEPTH positions and verify at most NODES
tokens (FeatureDrafts.max_length, tree_nodes); --copy-alone the preset without its head and
lookup; --no-plans the preset whose planner plans as usual but whose rounds all draft nothing
(what a plain round costs it beyond full depth's step). Batch 1, 64 greedy tokens, 8 held-out prompts a kind (bench/common.py). Prints the
median ratio to full depth and each repeat's, and the head's drafted / accepted tokens; writes
nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
import eecore  # noqa: E402
from common import bench_prompt_ids, cpu_model, rotated  # noqa: E402
from eecore.speculative.draft_planner import NO_DRAFTS  # noqa: E402


def without_drafts(llm) -> None:
    """Every round of `llm`'s preset planned (the planner's work as usual), then drafting nothing."""
    policy = llm.engine.strategy.policy
    plan = policy.plan

    def planned_out(seqs, rooms, behinds=None, new_round=True):
        plan(seqs, rooms, behinds, new_round)
        return [NO_DRAFTS] * len(seqs)
    policy.plan = planned_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["chat", "everyday", "code"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantized", action="store_true", help="the embedded file's own blocks (default: dequantized)")
    ap.add_argument("--heads", nargs="*", default=[], help="feature head files, each in the preset in turn")
    ap.add_argument("--copy-alone", action="store_true", help="also the preset without its head and lookup")
    ap.add_argument("--no-plans", action="store_true", help="also the preset with every round drafting nothing")
    ap.add_argument("--tree", nargs=2, type=int, metavar=("DEPTH", "NODES"),
                    help="also the preset with its head's trees DEPTH positions deep, at most NODES tokens")
    args = ap.parse_args()
    torch.set_num_threads(2)
    quant = None if args.quantized else "none"
    preset = eecore.SelfSpeculativeConfig.exit_ready("layer", device="cpu")
    configs = {"preset": preset}
    for path in args.heads:
        configs[f"preset, {os.path.basename(path)}"] = dataclasses.replace(
            preset, feature=dataclasses.replace(preset.feature, head=path))
    if args.tree:
        depth, nodes = args.tree
        configs[f"preset, trees {depth} deep, {nodes} nodes"] = dataclasses.replace(
            preset, feature=dataclasses.replace(preset.feature, max_length=depth, tree_nodes=nodes))
    if args.copy_alone:
        configs["copy alone"] = dataclasses.replace(preset, feature=None, lookup=None)
    if args.no_plans:
        configs["no drafts"] = preset
    engines = {"full": eecore.LLM(quantization=quant)}
    for label, config in configs.items():
        engines[label] = eecore.LLM(quantization=quant, exit_adapter=True, speculative=config)
    if args.no_plans:
        without_drafts(engines["no drafts"])
    params = eecore.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for llm in engines.values():  # (first calls pay one-time costs)
        llm.generate([[1, 2, 3]], eecore.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    print(f"CPU: {cpu_model()}; {'4-bit blocks' if args.quantized else 'dequantized'}, batch 1")
    names = list(engines)
    for kind in args.kinds:
        prompts = bench_prompt_ids(engines["full"].tokenizer, kind, 8)
        seconds = {name: [] for name in names}
        head = {name: [0, 0] for name in names}
        for r in range(args.repeats):
            total = dict.fromkeys(names, 0.0)
            for i, prompt in enumerate(prompts):
                for name in rotated(names, r + i):
                    start = time.perf_counter()
                    out = engines[name].generate([prompt], params)[0]
                    total[name] += time.perf_counter() - start
                    head[name][0] += out.metrics.get("num_feature_drafted_tokens", 0)
                    head[name][1] += out.metrics.get("num_feature_accepted_tokens", 0)
            for name in names:
                seconds[name].append(total[name])
        full = statistics.median(seconds["full"])
        for name in names[1:]:
            each = [round(f / s, 3) for f, s in zip(seconds["full"], seconds[name])]
            print(f"{kind:9s} {name:50s} {full / statistics.median(seconds[name]):.3f}x full depth  "
                  f"repeats {each}  head drafted / accepted {head[name][0]} / {head[name][1]}", flush=True)


if __name__ == "__main__":
    main()
