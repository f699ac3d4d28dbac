"""A/B runs: two engine configurations, or two builds of eecore, against each other on the same
prompts, alternated in ABBA order so that a noisy machine's phases (this VM's memory bandwidth
swings 30-60 GB/s for minutes at a time) hit both alike.

    python bench/e2e_ab.py configs --a "FLAGS" --b "FLAGS" [--prompts code] [--num-prompts 8]
        [--max-tokens 64] [--repeats 3] [--out-name config-ab]
    python bench/e2e_ab.py builds --a CHECKOUT --b CHECKOUT [--flags "--exit-ready layer"]
        [--base-flags "--dtype bfloat16"] [--pairs 4] [--prompts code] [--num-prompts 8]
        [--max-tokens 64] [--out-name build-ab]

`configs`: two configurations given as `eecore generate` flags, e.g.
`--a "--exit-ready --draft-dtype bfloat16" --b --exit-ready` (write `--b=--exit-ready` where a
value starts with a dash and has no space), in one process, alternated one prompt at a time
(batch 1). Prints each configuration's tok/s per repeat and the per-prompt ratios B / A (A's time
per token over B's, for the same prompt in the same ABBA block), whose median is the figure to
quote.

`builds`: what a code or kernel change is worth end to end, where runs hours apart differ by more
than the change. Each build is a source checkout with its extension built in place, e.g. the
commit before a change in a git worktree:

    git worktree add /tmp/before HEAD~1 && (cd /tmp/before && python setup.py build_ext --inplace)
    python bench/e2e_ab.py builds --a /tmp/before --b . --flags "--exit-ready layer"

One process per build at a time, alternated ABBA pair by pair; each process times full depth
(`--base-flags`), then the configuration (`--base-flags` and `--flags`), over the prompts one at a
time. Prints, per pair, B's time over A's for both, and each build's speed-up over its own full
depth; their medians are the figures to quote.

Both write bench/results/<machine>/<out-name>-<date>.json with every timing. Older docs and
results name this script `bench/ab.py`, and before that its two modes `bench/config_ab.py ARGS`
(now `e2e_ab.py configs ARGS`) and `bench/build_ab.py ARGS` (now `e2e_ab.py builds ARGS`).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

import eecore
from common import PROMPT_KINDS, bench_prompt_ids, cpu_model, save_results, timed

HERE = os.path.dirname(os.path.abspath(__file__))


def llm_from_flags(flags: str):
    """An LLM built as `eecore generate FLAGS` builds it (fp32 unless FLAGS say otherwise)."""
    from eecore.cli import build_llm, parse_args

    return build_llm(parse_args(["generate", "-", "--dtype", "float32"] + shlex.split(flags)))


def abba(i: int) -> tuple[str, str]:
    """The order of A and B in block i: A B, B A, A B, ... so that a drift hits both alike."""
    return ("a", "b") if i % 2 == 0 else ("b", "a")


def sampling_params(args) -> eecore.SamplingParams:
    """Greedy by default; with --temperature, sampled with a fixed seed (the same draws each repeat)."""
    return eecore.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                 seed=0 if args.temperature > 0 else None)


def warm_up(llm, prompts: list[list[int]]) -> None:
    llm.generate(prompts[:1], eecore.SamplingParams(max_tokens=4))


def generate_one(llm, prompt: list[int], params):
    """One prompt alone (batch 1): its output and the seconds it took."""
    (out,), seconds = timed(llm.generate, [prompt], params)
    return out, seconds


# --- configs: two flag sets in one process, alternated prompt by prompt --------------------------

def run_configs(args) -> None:
    llms = {"a": llm_from_flags(args.a), "b": llm_from_flags(args.b)}
    prompts = bench_prompt_ids(llms["a"].tokenizer, args.prompts, args.num_prompts)
    params = sampling_params(args)
    for llm in llms.values():
        warm_up(llm, prompts)
    seconds = {k: [[0.0] * len(prompts) for _ in range(args.repeats)] for k in llms}
    tokens = {k: [0] * len(prompts) for k in llms}
    drafts = {k: {"drafted": 0, "accepted": 0} for k in llms}  # self-speculation's, over every request
    same_output = True
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            outs = {}
            for k in abba(r * len(prompts) + i):
                out, seconds[k][r][i] = generate_one(llms[k], prompt, params)
                outs[k] = out.token_ids
                tokens[k][i] = len(outs[k])
                drafts[k]["drafted"] += int(out.metrics.get("num_drafted_tokens", 0))
                drafts[k]["accepted"] += int(out.metrics.get("num_accepted_tokens", 0))
            same_output &= outs["a"] == outs["b"]
    # per token, so that configurations whose outputs differ in length still compare
    ratios = [seconds["a"][r][i] / seconds["b"][r][i] * tokens["b"][i] / tokens["a"][i]
              for r in range(args.repeats) for i in range(len(prompts))]
    tok_s = {k: [sum(tokens[k]) / sum(seconds[k][r]) for r in range(args.repeats)] for k in llms}
    print(f"CPU: {cpu_model()}; {len(prompts)} {args.prompts} prompts, {args.max_tokens} tokens, batch 1")
    for k in llms:
        print(f"  {k.upper()}: {getattr(args, k)}\n     tok/s per repeat: " + " ".join(f"{x:.1f}" for x in tok_s[k]))
        if drafts[k]["drafted"]:
            print(f"     drafts accepted: {drafts[k]['accepted']} of {drafts[k]['drafted']} "
                  f"({drafts[k]['accepted'] / drafts[k]['drafted']:.2f})")
    per_repeat = [sum(seconds["a"][r]) / sum(seconds["b"][r]) for r in range(args.repeats)]
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"B / A speed: median of {len(ratios)} per-prompt ratios {statistics.median(ratios):.3f} "
          f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}); per repeat "
          + " ".join(f"{x:.3f}" for x in per_repeat) + f"; same outputs: {same_output}")
    path = save_results(args.out_name, dict(a=args.a, b=args.b, prompts=args.prompts, num_prompts=len(prompts),
                                            max_tokens=args.max_tokens, temperature=args.temperature,
                                            top_p=args.top_p, repeats=args.repeats, tok_s=tok_s,
                                            seconds=seconds, tokens=tokens, drafts=drafts,
                                            per_prompt_ratios_b_over_a=ratios,
                                            median_ratio_b_over_a=statistics.median(ratios),
                                            per_repeat_ratio_b_over_a=per_repeat, same_output=same_output))
    print(f"results: {path}")


# --- builds: one process per checkout, alternated pair by pair -----------------------------------

def build_worker(args) -> None:
    """One process of one build (its eecore first on PYTHONPATH): full depth, then `--flags`."""
    params = sampling_params(args)
    seconds, outputs = {}, {}
    for name, flags in (("full", args.base_flags), ("config", f"{args.base_flags} {args.flags}")):
        llm = llm_from_flags(flags)
        prompts = bench_prompt_ids(llm.tokenizer, args.prompts, args.num_prompts)
        warm_up(llm, prompts)
        seconds[name], outputs[name] = 0.0, []
        for prompt in prompts:
            out, t = generate_one(llm, prompt, params)
            seconds[name] += t
            outputs[name].append(out.token_ids)
        del llm  # one engine at a time
    print(json.dumps(dict(eecore=eecore.__file__, full_s=seconds["full"], config_s=seconds["config"],
                          identical=outputs["full"] == outputs["config"])))


def run_build(checkout: str, args) -> dict:
    """Run build_worker in a fresh process on `checkout`'s eecore; its figures."""
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(checkout), "python"))
    cmd = [sys.executable, os.path.abspath(__file__), "builds", "--worker", f"--flags={args.flags}",
           f"--base-flags={args.base_flags}", "--prompts", args.prompts, "--num-prompts", str(args.num_prompts),
           "--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    done = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"e2e_ab.py builds: the run of {checkout} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = os.path.join(os.path.abspath(checkout), "python", "eecore", "__init__.py")
    if os.path.realpath(result["eecore"]) != os.path.realpath(expected):
        raise SystemExit(f"e2e_ab.py builds: {checkout} ran {result['eecore']}, not its own eecore (is it installed "
                         f"non-editable? its extension built in place?)")
    return result


def run_builds(args) -> None:
    pairs = []
    print(f"CPU: {cpu_model()}; {args.base_flags + ' ' if args.base_flags else ''}{args.flags!r}, "
          f"{args.num_prompts} {args.prompts} prompts x {args.max_tokens} tokens")
    for p in range(args.pairs):
        order = abba(p)
        runs = {k: run_build(getattr(args, k), args) for k in order}
        a, b = runs["a"], runs["b"]
        pair = dict(order="".join(order), a=a, b=b, config_b_over_a=b["config_s"] / a["config_s"],
                    full_b_over_a=b["full_s"] / a["full_s"], speedup_a=a["full_s"] / a["config_s"],
                    speedup_b=b["full_s"] / b["config_s"], identical=a["identical"] and b["identical"])
        pairs.append(pair)
        print(f"pair {p + 1} ({pair['order']}): config B/A time {pair['config_b_over_a']:.3f}, full depth B/A "
              f"{pair['full_b_over_a']:.3f}; vs own full depth A {pair['speedup_a']:.2f}x, B {pair['speedup_b']:.2f}x"
              f"{'' if pair['identical'] else ' (OUTPUTS DIFFER from full depth)'}")
    summary = {k: statistics.median(p[k] for p in pairs)
               for k in ("config_b_over_a", "full_b_over_a", "speedup_a", "speedup_b")}
    print("medians: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    path = save_results(args.out_name, dict(a=os.path.abspath(args.a), b=os.path.abspath(args.b), flags=args.flags,
                                            base_flags=args.base_flags, prompts=args.prompts,
                                            num_prompts=args.num_prompts, max_tokens=args.max_tokens, pairs=pairs,
                                            medians=summary))
    print(f"results: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="`python bench/e2e_ab.py MODE --help` lists each mode's options")
    modes = ap.add_subparsers(dest="mode", required=True)
    workload = argparse.ArgumentParser(add_help=False)  # what both modes run
    workload.add_argument("--prompts", choices=PROMPT_KINDS, default="code")
    workload.add_argument("--num-prompts", type=int, default=8)
    workload.add_argument("--max-tokens", type=int, default=64)
    workload.add_argument("--temperature", type=float, default=0.0,
                          help="sample at this temperature (seed 0) instead of greedy: outputs then differ "
                               "between configurations, and the ratios are per token")
    workload.add_argument("--top-p", type=float, default=1.0)

    configs = modes.add_parser("configs", parents=[workload], help="two sets of `eecore generate` flags, one process")
    configs.add_argument("--a", required=True, help="eecore generate flags of configuration A (the baseline)")
    configs.add_argument("--b", required=True, help="eecore generate flags of configuration B")
    configs.add_argument("--repeats", type=int, default=3)
    configs.add_argument("--out-name", default="config-ab")
    configs.set_defaults(run=run_configs)

    builds = modes.add_parser("builds", parents=[workload], help="two checkouts of eecore, one process each")
    builds.add_argument("--a", help="checkout of build A (the baseline)")
    builds.add_argument("--b", help="checkout of build B")
    builds.add_argument("--flags", default="--exit-ready layer", help="eecore generate flags of the configuration")
    builds.add_argument("--base-flags", default="", help="flags of both runs, full depth too (e.g. '--dtype bfloat16')")
    builds.add_argument("--pairs", type=int, default=4)
    builds.add_argument("--out-name", default="build-ab")
    builds.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    builds.set_defaults(run=run_builds)

    args = ap.parse_args()
    if args.mode == "builds":
        if args.worker:
            return build_worker(args)
        if not args.a or not args.b:
            builds.error("--a and --b (two checkouts) are required")
    args.run(args)


if __name__ == "__main__":
    main()
