"""What a full-depth pass costs by the number of rows it verifies (one sequence, SmolLM2-135M, CPU),
as chains and as token trees, against a one-row decode step, and what a draft-copy pass costs: the
cost model of a self-speculation round at batch 1.

A round that drafts d tokens with top-k alternatives runs d draft passes and one verify pass of
1 + d x k rows, and emits `tokens/round` tokens, so its speed against full depth is

    tokens/round / (verify(1 + d k) + d x draft)          (both in one-row steps)

Speculation pays at batch 1 only while extra rows are nearly free (the pass is bound by reading the
weights); this measures where that stops on the machine at hand. Every configuration is timed in
turn, `--repeats` times, on the same running sequence; medians.

    python bench/verify_row_cost.py [--rows 1 2 3 4 5 7 9 13] [--dtype float32] [--draft-dtype bfloat16]
                                    [--exit-layer 8] [--context 100] [--repeats 15]

writes bench/results/verify-row-cost-<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import eecore
from common import cpu_model, save_results
from eecore.engine.inputs import Row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 7, 9, 13])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default="bfloat16")
    ap.add_argument("--exit-layer", type=int, default=8)
    ap.add_argument("--context", type=int, default=100, help="tokens before the verified rows")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    llm = eecore.LLM(dtype=args.dtype, exit_adapter=True, speculative=eecore.SelfSpeculativeConfig(
        exit_layer=args.exit_layer, num_speculations=1, draft_layers="separate", draft_dtype=args.draft_dtype))
    engine = llm.engine
    seq = engine.add_request(list(range(200, 200 + args.context + max(args.rows))),
                             eecore.SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill: the sequence's blocks now hold every slot the passes below write
    runner, stack = engine.runner, engine.strategy.draft_stack
    start = args.context  # the verified rows rewrite the K/V of positions start.. (slots that exist)

    def verify(n: int, tree: bool) -> None:
        parents = [-1] + [0] * (n - 1) if tree and n > 1 else None  # n - 1 siblings: a d = 1 tree
        inputs = runner.prepare([Row(seq, start, list(range(300, 300 + n)), parents)])
        hidden = runner.embed(inputs)
        runner.run_layers(hidden, inputs.attn, 0, runner.num_layers)
        runner.logits(hidden)

    def draft() -> None:
        stack.head.logits(stack._run([Row(seq, start, [300])]))

    cases = {("verify", n, False): (lambda n=n: verify(n, False)) for n in args.rows}
    cases.update({("verify", n, True): (lambda n=n: verify(n, True)) for n in args.rows if n > 1})
    cases[("draft", 1, False)] = draft
    for fn in cases.values():  # warm up
        fn()
    times = {key: [] for key in cases}
    for _ in range(args.repeats):
        for key, fn in cases.items():
            begin = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - begin)
    one_row = statistics.median(times[("verify", 1, False)])
    print(f"CPU: {cpu_model()}; {args.dtype} model, {args.draft_dtype} draft copy of {args.exit_layer} layers, "
          f"context {args.context}, {torch.get_num_threads()} threads")
    print(f"{'pass':>8}{'rows':>6}{'tree':>6}{'ms':>9}{'x one row':>11}")
    rows = []
    for (kind, n, tree), ts in times.items():
        ms = statistics.median(ts) * 1e3
        rows.append(dict(kind=kind, rows=n, tree=tree, ms=ms, vs_one_row=ms / 1e3 / one_row, runs_ms=[t * 1e3 for t in ts]))
        print(f"{kind:>8}{n:6d}{str(tree):>6}{ms:9.2f}{ms / 1e3 / one_row:11.2f}")
    path = save_results("verify-row-cost", dict(model="SmolLM2-135M-Instruct", dtype=args.dtype,
                                                draft_dtype=args.draft_dtype, exit_layer=args.exit_layer,
                                                context=args.context, repeats=args.repeats, rows=rows))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
