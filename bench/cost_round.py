"""The cost model of a self-speculation round on the machine at hand (CPU), in three parts:

    python bench/cost_round.py round [--exit-adapter [FILE]] [--exit-layer 8] [--num-speculations 2]
        [--prompts 4] [--batch 1] [--draft-layers shared|separate] [--draft-dtype int8]
        [--dtype float32|bfloat16] [--max-tokens 64] [--repeats 2]
    python bench/cost_round.py verify-rows [--batch 1] [--rows 1 2 3 4 5 7 9 13] [--dtype float32] [--dequantized]
        [--draft-dtype bfloat16] [--exit-layer 8] [--context 100] [--repeats 15]
        [--tokens-per-round 1.67 2.15 2.55 2.9] [--out-name NAME]
    python bench/cost_round.py oracle [--batch-sizes 1 8] [--drafts 1 2 4] [--prompts code]
        [--num-prompts 8] [--max-tokens 64] [--repeats 2] [--out-name NAME]

`round`: where a round's time goes. The draft passes, the verify pass and the acceptance are timed
around the decoder's and the draft copy's methods, next to full depth's time per token. At batch 1
the prompts (`--prompts` held-out code prompts) run one at a time; with `--batch B`, B at a time,
the way a server batches them. A round with shared layers costs the first E layers once per draft
plus once more (the last draft's layer-E state feeds the verify pass), then layers E..L-1 over
d + 1 positions; with a separate draft copy it costs the copy's passes (the first of a sequence
also catches the copy up on its prompt) and a full-depth pass over d + 1 positions. At batch 1
each pass is bound by reading weights, so the printout shows whether the round costs what that
model says or more; at larger batches it shows what the extra verify rows and the copy cost. Each
part is printed as its total and its time per call; parts a configuration never calls are left
out. Prints only.

`verify-rows`: what a full-depth pass costs by the number of rows it verifies per sequence (B
sequences), as chains and as token trees, against a one-row decode step of the same B sequences,
and what a draft-copy pass costs. A round that drafts d tokens with top-k alternatives runs d draft
passes and one verify pass of 1 + d x k rows per sequence, and emits `tokens/round` tokens per
sequence, so its speed against full depth is

    tokens/round / (verify(1 + d k) + d x draft)          (both in one-row steps)

Speculation pays only while extra rows are nearly free (the pass is bound by reading the weights);
this measures where that stops. Every configuration is timed in turn, `--repeats` times, on the
same running sequences; medians. The table also gives, per chain length d, the physical bound of
that ratio with free drafts, from this machine's read bandwidth and peak arithmetic (a large BLAS
GEMM in the model's dtype), both measured in the same run: a pass of n rows per sequence cannot
take less than max(weight bytes / bandwidth, B n x 2 x parameters / peak FLOP/s), so no kernel
makes a round of d drafts faster than tokens/round x T_min(B) / T_min(B (d + 1)). With
`--tokens-per-round` (measured ones, per d = 1, 2, ...) it prints both speed-ups: at the measured
pass costs and at that ceiling. Writes <out-name>-<date>.json (default verify-row-cost-b<B>; give
runs of one day names of their own, or the later one replaces the earlier).

`oracle`: the ceiling of layer drafts: how fast self-speculation would run if every draft were
right, with the draft passes still paid for. Greedy output does not depend on the drafts, so full
depth's own greedy continuation of each prompt says which draft every round would have had
accepted. The exit-ready layer preset (the shipped int8 copy of layers 0-7, d drafts a round, no
draft threshold: every chain is d long) runs twice beside full depth: `shipped`, the copy's own
drafts, and `perfect`, the same passes of the copy with each of its drafts then replaced by the
token full depth emits there, so every draft is accepted while the copy's cost stays. `perfect` is
the most any training of the copy can give at that d and batch on this CPU; a `perfect` row below
a goal says that no draft file can reach it here. Each configuration alternates with full depth
group by group (bench/e2e_self_speculation.py's `alternate`); ratios are of the medians, `decode`
leaves out the prefill both share. Writes <out-name>-<date>.json (default oracle-drafts).

Results go to bench/results/<machine>/. Older docs and results name this script
`bench/spec_costs.py`, and before that its three parts `bench/spec_round_cost.py` (now `round`),
`bench/verify_row_cost.py` (`verify-rows`) and `bench/oracle_drafts.py` (`oracle`), with the same
options.
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch

import eecore
from common import PROMPT_KINDS, bench_prompt_ids, call_seconds, cpu_model, save_results

MODEL = "SmolLM2-135M-Instruct"


def print_machine(details: str) -> None:
    """The line every part starts with: what a figure means depends on the CPU."""
    print(f"CPU: {cpu_model()}; {details}")


def add_model_args(parser: argparse.ArgumentParser, *, draft_dtype: str | None) -> None:
    """The model and draft copy a part measures (their defaults differ by part)."""
    parser.add_argument("--exit-layer", type=int, default=8)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="float32",
                        help="the model's dtype (auto: GGUF weights in their own precision)")
    parser.add_argument("--draft-dtype", default=draft_dtype, help="the separate draft copy's dtype")
    parser.add_argument("--dequantized", action="store_true",
                        help="GGUF weights dequantized to --dtype (default: the file's own blocks)")


# --- round: where a round's time goes -----------------------------------------------------------

def instrument(parts) -> tuple[dict, collections.Counter]:
    """Wrap each (owner, method, label) of `parts` to add its seconds and calls under its label."""
    seconds, calls = collections.defaultdict(float), collections.Counter()
    for owner, name, label in parts:
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args, _method=method, _label=label, **kwargs):
            start = time.perf_counter()
            result = _method(*args, **kwargs)
            seconds[_label] += time.perf_counter() - start
            calls[_label] += 1
            return result

        setattr(owner, name, timed)
    return seconds, calls


def round_cost(args) -> None:
    from eecore.evaluation.prompts import heldout_code_prompts
    from eecore.speculative.acceptance import Acceptor
    from eecore.speculative.decoder import SelfSpeculativeDecoder
    from eecore.speculative.draft_stack import DraftStack
    from eecore.speculative.proposers import SharedLayerProposer
    from eecore.speculative.verification import Verifier

    # (owner, method, label): the decoder's steps, and the separate draft copy's passes
    parts = ((SelfSpeculativeDecoder, "decode", "decode"),
             (SharedLayerProposer, "propose", "draft"),
             (Verifier, "from_exit_states", "verify"),
             (Verifier, "full", "verify_all"),
             (Acceptor, "accept_all", "accept_all"),
             (DraftStack, "first_pass", "copy.first_pass"),
             (DraftStack, "next_pass", "copy.next_pass"))
    seconds, calls = instrument(parts)
    prompts = heldout_code_prompts(args.prompts)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    kw = dict(dtype=args.dtype, device="cpu", max_num_seqs=args.batch, exit_adapter=args.exit_adapter,
              quantization="none" if args.dequantized else None)
    llms = {"full": eecore.LLM(**kw),
            "spec": eecore.LLM(**kw, speculative=eecore.SelfSpeculativeConfig(
                num_speculations=args.num_speculations, layer=eecore.LayerDrafts(
                    exit_layer=args.exit_layer,
                    copy=eecore.DraftCopy(args.draft_dtype) if args.draft_layers == "separate" else None)))}
    print_machine(f"E={args.exit_layer}, d={args.num_speculations}, draft layers {args.draft_layers}"
                  f"{'' if args.draft_dtype is None else ' (' + args.draft_dtype + ')'}, {len(prompts)} code prompts, "
                  f"batch {args.batch}")
    for r in range(args.repeats):
        for name, llm in llms.items():
            seconds.clear()
            calls.clear()
            start, tokens = time.perf_counter(), 0
            for i in range(0, len(prompts), args.batch):
                tokens += sum(len(o.token_ids) for o in llm.generate(prompts[i:i + args.batch], params))
            elapsed = time.perf_counter() - start
            print(f"repeat {r} {name}: {elapsed:.2f} s, {1000 * elapsed / tokens:.2f} ms/token")
        rounds = max(calls["decode"], 1)
        timings = ", ".join(f"{label} {seconds[label]:.2f} s ({1000 * seconds[label] / calls[label]:.2f} ms x "
                            f"{calls[label]})" for _, _, label in parts if calls[label])
        print(f"  {rounds} decode steps, {tokens / rounds:.2f} tokens each; {timings}")


# --- verify-rows: a pass's cost by the rows it verifies, and its ceiling ------------------------

def peak_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square BLAS GEMM in `dtype`: this machine's practical arithmetic peak."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / statistics.median(call_seconds(lambda: torch.mm(a, b), repeats))


def verify_rows(args) -> None:
    from eecore.engine.inputs import Row
    from roofline import decode_weight_bytes, read_bandwidth_gbs

    if 1 not in args.rows:
        args.rows = [1] + args.rows
    llm = eecore.LLM(dtype=args.dtype, exit_adapter=True, max_num_seqs=max(8, args.batch),
                     quantization="none" if args.dequantized else None,
                     speculative=eecore.SelfSpeculativeConfig(
                         num_speculations=max(args.rows),
                         layer=eecore.LayerDrafts(exit_layer=args.exit_layer, copy=eecore.DraftCopy(args.draft_dtype))))
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

    def draft() -> None:  # the copy's layers op by op, then its draft head (DraftStack's one-token pass)
        copy = stack.runner
        inputs = copy.prepare([Row(seq, start, [300]) for seq in seqs])
        stack.head.columns(copy.run_layers(copy.embed(inputs), inputs.attn, 0, stack.exit_layer))

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
    print_machine(f"{args.dtype} model, {args.draft_dtype} draft copy of {args.exit_layer} layers, "
                  f"batch {args.batch}, context {args.context}, {torch.get_num_threads()} threads")
    print(f"{'pass':>8}{'rows':>6}{'tree':>6}{'ms':>9}{'x one row':>11}")
    rows = []
    for (kind, n, tree), ts in times.items():
        ms = statistics.median(ts) * 1e3
        rows.append(dict(kind=kind, rows=n, tree=tree, ms=ms, vs_one_row=ms / 1e3 / one_row, runs_ms=[t * 1e3 for t in ts]))
        print(f"{kind:>8}{n:6d}{str(tree):>6}{ms:9.2f}{ms / 1e3 / one_row:11.2f}")

    # the ceiling: no pass is faster than its weight reads or its arithmetic at this machine's peak
    model = llm.model
    bandwidth, peak = read_bandwidth_gbs() * 1e9, peak_flops(model.dtype)
    weight = decode_weight_bytes(model)
    # a multiply-add per weight of the layers and the head (GGUF blocks: rows x features of them)
    matrices = [getattr(model.layers[i], name) for i in range(model.num_layers)
                for name in ("qkv", "o_proj", "gate_up", "down")] + [model.lm_head]
    flops_per_row = 2 * sum(m.shape[0] * m.shape[1] for m in matrices)

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
    path = save_results(args.out_name or f"verify-row-cost-b{args.batch}", dict(
        model=MODEL, dtype=args.dtype, batch=args.batch, draft_dtype=args.draft_dtype, exit_layer=args.exit_layer,
        context=args.context, repeats=args.repeats, rows=rows, read_bandwidth_gbs=bandwidth / 1e9,
        peak_gflops=peak / 1e9, weight_bytes=weight, chains=chain))
    print(f"results: {path}")


# --- oracle: the layer preset with drafts that are always right ---------------------------------

def install_oracle(llm, continuations: dict[tuple, list[int]]) -> None:
    """Make `llm`'s layer drafts the tokens of `continuations` (prompt ids -> full depth's greedy
    output) after the copy has run: each round's k-th draft of a sequence whose output holds m
    tokens is continuation[m + k] (a prompt without one keeps the copy's drafts). The copy's passes,
    the draft head and the proposal's ops all still run; only the tokens they chose are replaced."""
    decoder = llm.engine.strategy
    proposer = decoder.proposer
    chain: dict[int, int] = {}  # seq_id -> drafts proposed so far this round
    copy_drafts, propose = proposer.propose, decoder.picker.propose

    def round_drafts(*args):
        chain.clear()
        return copy_drafts(*args)

    def oracle_propose(logits, seqs, *more, **named):
        proposal = propose(logits, seqs, *more, **named)
        for i, seq in enumerate(seqs):
            k = chain.get(seq.seq_id, 0)
            chain[seq.seq_id] = k + 1
            wanted = continuations.get(tuple(seq.prompt_token_ids), ())  # none: a warm-up's prompt
            position = len(seq.output_token_ids) + k
            if position < len(wanted):
                proposal.tokens[i] = wanted[position]
        return proposal

    proposer.propose, decoder.picker.propose = round_drafts, oracle_propose
    launch = getattr(proposer, "launch_chain", None)
    if launch is not None:  # draft ahead: the chain's drafts stay on the device until its read-back
        def oracle_launch(seqs, drafts, live, passes, *rest):
            launch(seqs, drafts, live, passes, *rest)
            replace_chain(proposer, [seqs[b] for b in live], [len(drafts[b]) for b in live], len(passes),
                          continuations)
        proposer.launch_chain = oracle_launch


def replace_chain(proposer, seqs, drafted: list[int], length: int, continuations: dict[tuple, list[int]]) -> None:
    """A draft-ahead chain's drafts, still on the device, replaced by full depth's tokens: seqs[i]'s
    draft j (it had drafted `drafted[i]` this round before the chain) is at position m + drafted[i] +
    j of its output (where full depth's continuation ends, the copy's stays). Done on the device,
    where both the chain's read-back and a verify pass launched behind it (EECORE_VERIFY_AHEAD=1)
    read them; copied without waiting for the chain."""
    wanted = []
    for seq, before in zip(seqs, drafted):
        text, at = continuations.get(tuple(seq.prompt_token_ids), ()), len(seq.output_token_ids) + before
        wanted.append([text[at + j] if at + j < len(text) else -1 for j in range(length)])
    tokens = proposer.chain_tokens[: len(seqs), :length]
    values = torch.tensor(wanted, dtype=torch.int64)
    if tokens.is_cuda:
        values = values.pin_memory().to(tokens.device, non_blocking=True)
    tokens.copy_(torch.where(values >= 0, values, tokens))


def oracle(args) -> None:
    from e2e_self_speculation import alternate

    if args.num_prompts < max(args.batch_sizes):
        raise SystemExit(f"--num-prompts must be at least the largest batch size ({max(args.batch_sizes)}), "
                         f"got {args.num_prompts}")
    batch_cap = max(args.batch_sizes)
    full = eecore.LLM(dtype="float32", max_num_seqs=batch_cap)
    prompts = bench_prompt_ids(full.tokenizer, args.prompts, args.num_prompts)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    reference = [o.token_ids for o in full.generate(prompts, params)]
    continuations = {tuple(p): list(r) for p, r in zip(prompts, reference)}
    print_machine(f"{len(prompts)} {args.prompts} prompts, {args.max_tokens} tokens")
    print(f"{'batch':>5}{'d':>3}{'drafts':>9}{'accept':>8}{'tok/round':>10}{'vs full':>9}{'decode':>8}{'full tok/s':>11}")

    rows = []
    for d in args.drafts:
        for perfect in (False, True):
            config = eecore.SelfSpeculativeConfig.exit_ready(
                "layer", num_speculations=d, draft_threshold=None, long_draft_acceptance=None,
                disable_by_batch_size=None)
            llm = eecore.LLM(dtype="float32", max_num_seqs=batch_cap, exit_adapter=True, speculative=config)
            if perfect:
                install_oracle(llm, continuations)
            for batch in args.batch_sizes:
                group_prompts = prompts[: (len(prompts) // batch) * batch]
                outs, ours, theirs, ours_d, theirs_d = alternate(llm, full, group_prompts, params, batch, args.repeats)
                expected = [continuations[tuple(p)] for p in group_prompts]
                identical = [o.token_ids for o in outs] == expected
                if not identical:
                    raise SystemExit(f"batch {batch}, d = {d}: outputs differ from full depth's")
                drafted = sum(o.metrics["num_drafted_tokens"] for o in outs)
                accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
                rounds = sum(o.metrics["num_verify_steps"] for o in outs)
                if perfect and accepted != drafted:  # the decoder no longer drafts where install_oracle hooks in
                    raise SystemExit(f"batch {batch}, d = {d}: perfect drafts accepted {accepted} of {drafted}")
                row = dict(batch=batch, d=d, drafts="perfect" if perfect else "shipped",
                           acceptance=accepted / max(drafted, 1), tokens_per_round=(accepted + rounds) / max(rounds, 1),
                           vs_full=statistics.median(ours) / statistics.median(theirs),
                           decode_vs_full=statistics.median(ours_d) / statistics.median(theirs_d),
                           tok_s=ours, full_tok_s=theirs, decode_tok_s=ours_d, full_decode_tok_s=theirs_d,
                           outputs_identical=identical)
                rows.append(row)
                print(f"{batch:5d}{d:3d}{row['drafts']:>9}{row['acceptance']:8.2f}{row['tokens_per_round']:10.2f}"
                      f"{row['vs_full']:9.2f}{row['decode_vs_full']:8.2f}{statistics.median(theirs):11.1f}")
    path = save_results(args.out_name, dict(model=MODEL, dtype="float32", draft="exit-ready layer preset, "
                                            "int8 copy, no draft threshold", prompts=args.prompts,
                                            num_prompts=len(prompts), max_tokens=args.max_tokens,
                                            repeats=args.repeats, rows=rows))
    print(f"results: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="`python bench/cost_round.py PART --help` lists each part's options")
    parts = ap.add_subparsers(dest="part", required=True)

    p = parts.add_parser("round", help="where a round's time goes (prints only)")
    p.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE")
    add_model_args(p, draft_dtype=None)
    p.add_argument("--num-speculations", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="held-out code prompts")
    p.add_argument("--batch", type=int, default=1, help="prompts generated at once")
    p.add_argument("--draft-layers", choices=["shared", "separate"], default="shared")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.set_defaults(run=round_cost)

    p = parts.add_parser("verify-rows", help="a pass's cost by the rows it verifies, and its ceiling")
    add_model_args(p, draft_dtype="bfloat16")
    p.add_argument("--batch", type=int, default=1, help="sequences, each verifying the same number of rows")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 7, 9, 13])
    p.add_argument("--context", type=int, default=100, help="tokens before the verified rows")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--tokens-per-round", type=float, nargs="*", default=[],
                   help="measured tokens per round at d = 1, 2, ...: prints the speed-ups they give")
    p.add_argument("--out-name", default=None, help="results file prefix (default: verify-row-cost-b<B>)")
    p.set_defaults(run=verify_rows)

    p = parts.add_parser("oracle", help="the layer preset with its own drafts and with always-right ones")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--prompts", choices=PROMPT_KINDS, default="code")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out-name", default="oracle-drafts")
    p.set_defaults(run=oracle)

    args = ap.parse_args()
    if getattr(args, "batch", 1) < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    args.run(args)


if __name__ == "__main__":
    main()
