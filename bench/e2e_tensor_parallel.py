"""The embedded SmolLM2-135M split over tensor-parallel ranks against one process, on held-out prompts:
the same greedy tokens, the same early exits, and the exit-ready presets equal to full depth under
tensor parallelism; the time each takes and the collectives a token makes (docs/distributed.md).

    PYTHONPATH=python python bench/e2e_tensor_parallel.py [--tp 3] [--kinds code chat] [--requests 8]
        [--max-tokens 32] [--quantized]

SmolLM2-135M has 9 query heads and 3 KV heads, so it splits 3 ways (not 2). Over dequantized fp32
weights by default (`--quantized`: the file's own Q4_1 blocks, split on block boundaries). On a
CPU the ranks share its cores: the times say what the collectives and the smaller per-rank
matrices cost there, not what a rank per GPU gains. Writes
bench/results/<machine>/cpu-tensor-parallel[-quantized]-<date>.json.
"""
from __future__ import annotations

import argparse
import dataclasses

import eecore
from common import bench_prompt_ids, cpu_model, save_results, timed


def run(label: str, make, prompts, params) -> tuple[dict, list]:
    llm = make()
    try:
        outs, seconds = timed(llm.generate, prompts, params)
        tokens = sum(len(o.token_ids) for o in outs)
        counts = dict(llm.tp_group.counts) if llm.tp_group is not None else {}
        layers = [e for o in outs for e in o.exit_layers]
        row = {"config": label, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
               "mean_layers_per_token": round(sum(layers) / len(layers), 2),
               "collectives_per_token": {k: round(v / tokens, 2) for k, v in counts.items()}}
        print(f"{label:<40} {row['tokens_per_s']:>8.1f} tok/s  {row['mean_layers_per_token']:>5.2f} layers  "
              f"{row['collectives_per_token']}", flush=True)
        return row, outs
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=["code", "chat"])
    ap.add_argument("--requests", type=int, default=8, help="prompts of each kind")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.5, help="the softmax exit threshold (with the exit adapters)")
    ap.add_argument("--quantized", action="store_true", help="the embedded file's own blocks (default: dequantized)")
    args = ap.parse_args()
    quant = None if args.quantized else "none"
    base = dict(quantization=quant, dtype="float32", device="cpu", max_num_seqs=args.requests)
    tokenizer = eecore.LLM(**base, num_blocks=8).tokenizer
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    ee = dict(exit_adapter=True, early_exit=eecore.EarlyExitConfig(measure="softmax", threshold=args.threshold,
                                                                     batch_rule="compact"))
    preset = dataclasses.replace(eecore.SelfSpeculativeConfig.exit_ready("layer", "cpu"), disable_by_batch_size=None)
    spec = dict(exit_adapter=True, speculative=preset)
    rows, checks = [], {}
    for kind in args.kinds:
        prompts = bench_prompt_ids(tokenizer, kind, args.requests)
        results = {}
        for name, tp, extra in (("full depth", 1, {}), ("full depth", args.tp, {}),
                                ("early exit", 1, ee), ("early exit", args.tp, ee),
                                ("exit-ready layer", args.tp, spec)):
            label = f"{kind}, {name}, tp={tp}"
            row, outs = run(label, lambda: eecore.LLM(**base, tensor_parallel_size=tp, **extra), prompts, params)
            rows.append(dict(row, kind=kind, tp=tp))
            results[(name, tp)] = outs
        tokens = lambda key: [o.token_ids for o in results[key]]  # noqa: E731
        checks[kind] = {
            "full depth: tp tokens equal one process's": tokens(("full depth", 1)) == tokens(("full depth", args.tp)),
            "early exit: tokens equal": tokens(("early exit", 1)) == tokens(("early exit", args.tp)),
            "early exit: exit layers equal": [o.exit_layers for o in results[("early exit", 1)]]
            == [o.exit_layers for o in results[("early exit", args.tp)]],
            "exit-ready layer under tp equals full depth under tp":
                tokens(("exit-ready layer", args.tp)) == tokens(("full depth", args.tp)),
        }
        print(kind, checks[kind], flush=True)
    path = save_results("cpu-tensor-parallel" + ("-quantized" if args.quantized else ""), {
        "cpu": cpu_model(), "tp": args.tp, "weights": "Q4_1 blocks" if args.quantized else "dequantized fp32",
        "requests": args.requests, "max_tokens": args.max_tokens, "rows": rows, "checks": checks})
    print("saved", path)


if __name__ == "__main__":
    main()
