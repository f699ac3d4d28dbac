"""Two engine configurations against each other, on the same prompts, alternated one prompt at a
time in ABBA order, so that a noisy machine's phases (this VM's memory bandwidth swings 30-60 GB/s)
hit both alike. Each configuration is given as `eecore generate` flags.

    python bench/config_ab.py --a "--speculate --exit-adapter --exit-layer 8 --num-speculations 3
        --draft-threshold 0.15 --draft-layers separate --draft-dtype bfloat16" --b "... --draft-dtype int8"
        [--prompts code] [--num-prompts 8] [--max-tokens 64] [--repeats 3] [--out-name NAME]

Prints each configuration's tok/s per repeat, and the per-prompt ratios B / A (time of A over time
of B for the same prompt in the same ABBA block), whose median is the figure to quote. Batch 1
(one prompt at a time). Writes bench/results/<out-name>-<date>.json with every timing.
"""
from __future__ import annotations

import argparse
import shlex
import statistics

import eecore
from common import PROMPT_KINDS, bench_prompt_ids, cpu_model, save_results, timed
from eecore.cli import build_llm, parse_args


def llm_from_flags(flags: str):
    return build_llm(parse_args(["generate", "-", "--dtype", "float32"] + shlex.split(flags)))  # as `eecore generate`


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="eecore generate flags of configuration A (the baseline)")
    ap.add_argument("--b", required=True, help="eecore generate flags of configuration B")
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="code")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-name", default="config-ab")
    args = ap.parse_args()

    llms = {"a": llm_from_flags(args.a), "b": llm_from_flags(args.b)}
    prompts = bench_prompt_ids(llms["a"].tokenizer, args.prompts, args.num_prompts)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], eecore.SamplingParams(max_tokens=4))
    seconds = {k: [[0.0] * len(prompts) for _ in range(args.repeats)] for k in llms}
    tokens = {k: [0] * len(prompts) for k in llms}
    same_output = True
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            order = ("a", "b") if (r * len(prompts) + i) % 2 == 0 else ("b", "a")  # ABBA
            outs = {}
            for k in order:
                (out,), t = timed(llms[k].generate, [prompt], params)
                seconds[k][r][i] = t
                tokens[k][i] = len(out.token_ids)
                outs[k] = out.token_ids
            same_output &= outs["a"] == outs["b"]
    ratios = [seconds["a"][r][i] / seconds["b"][r][i] * tokens["b"][i] / tokens["a"][i]
              for r in range(args.repeats) for i in range(len(prompts))]
    tok_s = {k: [sum(tokens[k]) / sum(seconds[k][r]) for r in range(args.repeats)] for k in llms}
    print(f"CPU: {cpu_model()}; {len(prompts)} {args.prompts} prompts, {args.max_tokens} tokens, batch 1")
    for k in llms:
        print(f"  {k.upper()}: {getattr(args, k)}\n     tok/s per repeat: " + " ".join(f"{x:.1f}" for x in tok_s[k]))
    per_repeat = [sum(seconds["a"][r]) / sum(seconds["b"][r]) for r in range(args.repeats)]
    print(f"B / A speed: median of {len(ratios)} per-prompt ratios {statistics.median(ratios):.3f} "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}); "
          f"per repeat " + " ".join(f"{x:.3f}" for x in per_repeat) + f"; same outputs: {same_output}")
    path = save_results(args.out_name, dict(a=args.a, b=args.b, prompts=args.prompts, num_prompts=len(prompts),
                                            max_tokens=args.max_tokens, repeats=args.repeats, tok_s=tok_s,
                                            seconds=seconds, tokens=tokens, per_prompt_ratios_b_over_a=ratios,
                                            median_ratio_b_over_a=statistics.median(ratios),
                                            per_repeat_ratio_b_over_a=per_repeat, same_output=same_output))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
