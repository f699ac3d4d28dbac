"""What a full-depth pass costs by the number of rows it verifies per sequence (B sequences,
SmolLM2-135M, CPU), as chains and as token trees, against a one-row decode step of the same B
sequences, and what a draft-copy pass costs: the cost model of a self-speculation round.

A round that drafts d tokens with top-k alternatives runs d draft passes and one verify pass of
1 + d x k rows per sequence, and emits `tokens/round` tokens per sequence, so its speed against
full depth is

    tokens/round / (verify(1 + d k) + d x draft)          (both in one-row steps)

Speculation pays only while extra rows are nearly free (the pass is bound by reading the weights);
this measures where that stops on the machine at hand. Every configuration is timed in turn,
`--repeats` times, on the same running sequences; medians.

The ceiling: the table also gives, per chain length d, the physical bound of that ratio with free
drafts, from this machine's read bandwidth and peak arithmetic (a large BLAS GEMM in the model's
dtype), both measured in the same run. A pass of n rows per sequence cannot take less than
max(weight bytes / bandwidth, B n x 2 x parameters / peak FLOP/s), so no kernel makes a round of d
drafts faster than

    tokens/round x T_min(B) / T_min(B (d + 1))

With `--tokens-per-round` (measured ones, per d = 1, 2, ...) it prints both speed-ups: at the
measured pass costs and at that ceiling.

    python bench/verify_row_cost.py [--batch 1] [--rows 1 2 3 4 5 7 9 13] [--dtype float32]
                                    [--draft-dtype bfloat16] [--exit-layer 8] [--context 100]
                                    [--repeats 15] [--tokens-per-round 1.67 2.15 2.55 2.9] [--out-name NAME]

writes bench/results/<out-name>-<date>.json (default verify-row-cost-b<B>; give runs of one day names
of their own, or the later one replaces the earlier).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import eecore
from common import cpu_model, save_results
from eecore.engine.inputs import Row


def peak_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square BLAS GEMM in `dtype`: this machine's practical arithmetic peak."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - begin)
    return 2 * n ** 3 / statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1, help="sequences, each verifying the same number of rows")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 7, 9, 13])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default="bfloat16")
    ap.add_argument("--exit-layer", type=int, default=8)
    ap.add_argument("--context", type=int, default=100, help="tokens before the verified rows")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out-name", default=None, help="results file prefix (default: verify-row-cost-b<B>)")
    ap.add_argument("--tokens-per-round", type=float, nargs="*", default=[],
                    help="measured tokens per round at d = 1, 2, ...: prints the speed-ups they give")
    args = ap.parse_args()
    if 1 not in args.rows:
        args.rows = [1] + args.rows

    llm = eecore.LLM(dtype=args.dtype, exit_adapter=True, max_num_seqs=max(8, args.batch),
                     speculative=eecore.SelfSpeculativeConfig(exit_layer=args.exit_layer, num_speculations=max(args.rows),
                                                              draft_layers="separate", draft_dtype=args.draft_dtype))
    engine = llm.engine
    length = args.context + max(args.rows)
    seqs = [engine.add_request([200 + (b + i) % 1000 for i in range(length)],
                               eecore.SamplingParams(max_tokens=1000, ignore_eos=True)) for b in range(args.batch)]
    while any(s.num_computed_tokens < length for s in seqs):
        engine.step()  # the prefills: the blocks now hold every slot the passes below write
    runner, stack = engine.runner, engine.strategy.draft_stack
    start = args.context  # the verified rows rewrite the K/V of positions start.. (slots that exist)

    def verify(n: int, tree: bool) -> None:
        parents = [-1] + [0] * (n - 1) if tree and n > 1 else None  # n - 1 siblings: a d = 1 tree
        inputs = runner.prepare([Row(seq, start, list(range(300, 300 + n)), parents) for seq in seqs])
        hidden = runner.embed(inputs)
        runner.run_layers(hidden, inputs.attn, 0, runner.num_layers)
        runner.logits(hidden)

    def draft() -> None:
        stack.head.columns(stack._run([Row(seq, start, [300]) for seq in seqs]))

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
    draft_s = statistics.median(times[("draft", 1, False)])
    print(f"CPU: {cpu_model()}; {args.dtype} model, {args.draft_dtype} draft copy of {args.exit_layer} layers, "
          f"batch {args.batch}, context {args.context}, {torch.get_num_threads()} threads")
    print(f"{'pass':>8}{'rows':>6}{'tree':>6}{'ms':>9}{'x one row':>11}")
    rows = []
    for (kind, n, tree), ts in times.items():
        ms = statistics.median(ts) * 1e3
        rows.append(dict(kind=kind, rows=n, tree=tree, ms=ms, vs_one_row=ms / 1e3 / one_row, runs_ms=[t * 1e3 for t in ts]))
        print(f"{kind:>8}{n:6d}{str(tree):>6}{ms:9.2f}{ms / 1e3 / one_row:11.2f}")

    # the ceiling: no pass is faster than its weight reads or its arithmetic at this machine's peak
    from roofline import decode_weight_bytes, read_bandwidth_gbs

    model = llm.model
    bandwidth, peak = read_bandwidth_gbs() * 1e9, peak_flops(model.dtype)
    weight = decode_weight_bytes(model)
    flops_per_row = 2 * weight / model.lm_head.element_size()

    def t_min(n: int) -> float:
        return max(weight / bandwidth, args.batch * n * flops_per_row / peak)

    print(f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s, {model.dtype} GEMM peak {peak / 1e9:.0f} GFLOP/s, "
          f"{weight / 1e6:.0f} MB of weights a pass: one pass is bound by memory up to "
          f"{weight / bandwidth * peak / flops_per_row:.1f} rows")
    print(f"{'d':>3}{'break-even tok/round':>22}{'at the ceiling':>16}{'tok/round':>11}{'speed-up':>10}{'ceiling':>9}")
    chain = []
    for n in args.rows:
        if n == 1:
            continue
        d = n - 1
        measured = (statistics.median(times[("verify", n, False)]) + d * draft_s) / one_row
        ceiling = t_min(n) / t_min(1)  # drafts for free
        row = dict(d=d, break_even_tokens_per_round=measured, ceiling_break_even_tokens_per_round=ceiling)
        line = f"{d:3d}{measured:22.2f}{ceiling:16.2f}"
        if d <= len(args.tokens_per_round):
            tpr = args.tokens_per_round[d - 1]
            row.update(tokens_per_round=tpr, speedup=tpr / measured, ceiling_speedup=tpr / ceiling)
            line += f"{tpr:11.2f}{tpr / measured:10.2f}{tpr / ceiling:9.2f}"
        chain.append(row)
        print(line)
    path = save_results(args.out_name or f"verify-row-cost-b{args.batch}", dict(model="SmolLM2-135M-Instruct", dtype=args.dtype, batch=args.batch,
                                   draft_dtype=args.draft_dtype, exit_layer=args.exit_layer,
                                   context=args.context, repeats=args.repeats, rows=rows,
                                   read_bandwidth_gbs=bandwidth / 1e9, peak_gflops=peak / 1e9,
                                   weight_bytes=weight, chains=chain))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
