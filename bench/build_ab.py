"""Two builds of eecore against each other: the same configuration and prompts, one process per
build at a time, alternated in ABBA order, so that this VM's memory phases (its bandwidth swings
30-60 GB/s for minutes at a time) hit both builds alike. What a code or kernel change is worth end
to end, where runs hours apart differ by more than the change.

Each build is a source checkout with its extension built in place (`python setup.py build_ext
--inplace`), e.g. the commit before a change in a git worktree:

    git worktree add /tmp/before HEAD~1 && (cd /tmp/before && python setup.py build_ext --inplace)
    python bench/build_ab.py --a /tmp/before --b . --flags "--exit-ready layer" [--pairs 4]
        [--base-flags "--dtype bfloat16"] [--prompts code] [--num-prompts 8] [--max-tokens 64] [--out-name NAME]

Each process times full depth, then the configuration `--flags` (`eecore generate` flags), over
the prompts one at a time. Prints, per pair, B's time over A's for both, and each build's speed-up
over its own full depth; their medians are the figures to quote. Writes
bench/results/<out-name>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args) -> None:
    """One process: this build (eecore on PYTHONPATH) times full depth, then `--flags`."""
    import eecore
    from common import bench_prompt_ids, timed
    from config_ab import llm_from_flags

    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    seconds, outputs = {}, {}
    for name, flags in (("full", args.base_flags), ("config", f"{args.base_flags} {args.flags}")):
        llm = llm_from_flags(flags)
        prompts = bench_prompt_ids(llm.tokenizer, args.prompts, args.num_prompts)
        llm.generate(prompts[:1], eecore.SamplingParams(max_tokens=4))  # warm-up
        seconds[name], outputs[name] = 0.0, []
        for prompt in prompts:
            (out,), t = timed(llm.generate, [prompt], params)
            seconds[name] += t
            outputs[name].append(out.token_ids)
        del llm
    print(json.dumps(dict(eecore=eecore.__file__, full_s=seconds["full"], config_s=seconds["config"],
                          identical=outputs["full"] == outputs["config"])))


def run_build(checkout: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(checkout), "python"))
    cmd = [sys.executable, os.path.join(HERE, "build_ab.py"), "--worker", "--flags", args.flags,
           f"--base-flags={args.base_flags}",
           "--prompts", args.prompts, "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
    done = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"build_ab: the run of {checkout} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = os.path.join(os.path.abspath(checkout), "python", "eecore", "__init__.py")
    if os.path.realpath(result["eecore"]) != os.path.realpath(expected):
        raise SystemExit(f"build_ab: {checkout} ran {result['eecore']}, not its own eecore (is it installed "
                         f"non-editable? its extension built in place?)")
    return result


def main() -> None:
    from common import PROMPT_KINDS, cpu_model, save_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", help="checkout of build A (the baseline)")
    ap.add_argument("--b", help="checkout of build B")
    ap.add_argument("--flags", default="--exit-ready layer", help="eecore generate flags of the configuration")
    ap.add_argument("--base-flags", default="", help="flags of both runs, full depth too (e.g. '--dtype bfloat16')")
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="code")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--out-name", default="build-ab")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not args.a or not args.b:
        ap.error("--a and --b (two checkouts) are required")

    pairs = []
    print(f"CPU: {cpu_model()}; {args.base_flags + ' ' if args.base_flags else ''}{args.flags!r}, {args.num_prompts} {args.prompts} prompts x {args.max_tokens} tokens")
    for p in range(args.pairs):
        order = ("a", "b") if p % 2 == 0 else ("b", "a")  # ABBA
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
                                            base_flags=args.base_flags,
                                            prompts=args.prompts, num_prompts=args.num_prompts,
                                            max_tokens=args.max_tokens, pairs=pairs, medians=summary))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
