"""Self-speculative decoding (LayerSkip) on SmolLM2-135M (fp32, CPU), against eecore at full depth
and HF transformers' own self-speculation `generate(..., assistant_early_exit=E)` (batch 1 only:
HF supports no more), all in the same run, on the same weights.

SmolLM2 was not trained with LayerSkip's recipe, so its early layers make poor drafts and the
acceptance rate at small E is low; the table reports it as measured, next to the acceptance rate
at which a round would break even with full depth when decode is bound by reading weights
(eecore.speculative.guard.break_even_acceptance: every draft pass re-reads layers 0..E-1 and
the LM head).

    python bench/e2e_self_speculation.py [--max-tokens 64] [--exit-layers 6 12 18 24] [--drafts 2 4 6]
                                     [--draft-thresholds none 0.6] [--min-acceptance A] [--repeats 3]
                                     [--draft layer|lookup|hybrid] [--layer-speculations D]
                                     [--hybrid-switch round|token] [--lookup-ngrams MIN MAX]
                                     [--exit-adapter [FILE]]
                                     [--draft-layers shared|separate] [--draft-dtypes float32 bfloat16]
                                     [--draft-top-ks 1 3] [--accept verified|confident]
                                     [--batch-sizes 1 8] [--requests N] [--prompts chat|code] [--no-hf] [--dtype float32|bfloat16] [--out-name NAME]
`--draft lookup` drafts by prompt lookup (no exit layer: the E column is "-"), `--draft hybrid` by
prompt lookup where a sequence has a match and layer E elsewhere (`--hybrid-switch token`: per drafted
position; the exit-ready preset is `--draft hybrid --hybrid-switch token --lookup-ngrams 2 4
--layer-speculations 3 --draft-thresholds 0.15 --drafts 4 --exit-layers 8 --draft-layers separate
--draft-dtypes int8 --exit-adapter`); `--exit-adapter` loads exit
adapters (the shipped ones without FILE) for the layer drafts. `--prompts code` runs held-out
code-completion prompts (eecore.evaluation.prompts) instead of the CLI's chat prompts. `--draft-layers separate`
drafts with a copy of layers 0..E-1 (eecore.speculative.draft_stack) in each of `--draft-dtypes`; an
exit-ready file's LoRA pairs then change only the copy, so full depth is the original model;
`--draft-top-ks` (separate only) verifies each drafted position's top-k tokens as a token tree.
`--exit-measure agreement` makes both thresholds compare with the shipped exit decision's
probability that full depth agrees (eecore.speculative.exit_decision) instead of the top-1 probability.
`--accept confident` runs dynamic early exit with deferred K/V instead (the draft threshold is the
exit confidence): the `exits` column is the share of tokens emitted at layer E, `ROUGE` the ROUGE-L
of the outputs to full depth's.
writes bench/results/<machine>/cpu-self-speculation-<date>.json (-guard- with --min-acceptance, -lookup- or
-hybrid- with --draft, -adapter- with --exit-adapter). Each
configuration alternates with full depth on each group of prompts, `--repeats` times; ratios are of
the medians, and the file keeps every repeat. `vs full` counts the whole request (the prefill both
share included), `decode` only what follows each group's first tokens (TPOT's ratio: what the
strategy changes; a draft copy's catch-up on the prompt stays in).

A group of B prompts that run to their end together (the default) ends with its slowest sequence:
under speculation the sequences advance at their own pace, so the last rounds of a group carry
fewer and fewer of them, while full depth keeps all B to the last step. `--requests N` measures the
other way a batch runs, a server's: N prompts through one engine of `max_num_seqs` B, each finished
sequence's place taken by the next prompt (continuous batching; its prompts' prefills join the
decode steps). `decode` is then left out: requests start all along the run.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch

import eecore
from eecore.cli.args import parse_min_acceptance
from eecore.evaluation.metrics import compare_outputs
from eecore.cli.speculative_flags import from_flat
from eecore.speculative.guard import break_even_acceptance
from common import PROMPT_KINDS, bench_prompt_ids, cpu_model, hf_generate_greedy, hf_model_from_loaded, save_results, timed


def eecore_run(llm, prompts, params, batch):
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    tokens, elapsed, outs = 0, 0.0, []
    for g in groups:
        o, t = timed(llm.generate, g, params)
        outs += o
        tokens += sum(len(x.token_ids) for x in o)
        elapsed += t
    return outs, tokens / elapsed


def alternate(llm, full, prompts, params, batch, repeats):
    """Run `llm` and full depth in turn on each group of `batch` prompts, `repeats` times (a burst
    of load on a shared machine then hits both alike: pairs a second or so apart, not whole prompt
    sets), which one goes first swapping every pair (so drift and any first-or-second effect
    cancel); returns llm's last outputs, each repeat's tok/s of each, and each repeat's decode-only
    tok/s of each: the tokens after a request's first over the time after its group's last first
    token (the prefill, which both share, left out; a draft copy's catch-up on the prompt stays in)."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    ours, theirs, ours_decode, theirs_decode = [], [], [], []

    def run(engine, g):
        o, t = timed(engine.generate, g, params)
        return o, t, t - max(x.metrics["ttft_s"] for x in o)

    for i in range(repeats):
        outs, tokens, ours_s, theirs_s, ours_d, theirs_d = [], 0, 0.0, 0.0, 0.0, 0.0
        for j, g in enumerate(groups):
            if (i + j) % 2:
                _, t, d = run(full, g)
                theirs_s, theirs_d = theirs_s + t, theirs_d + d
            o, t, d = run(llm, g)
            ours_s, ours_d = ours_s + t, ours_d + d
            if not (i + j) % 2:
                _, t, d = run(full, g)
                theirs_s, theirs_d = theirs_s + t, theirs_d + d
            outs += o
            tokens += sum(len(x.token_ids) for x in o)
        decoded = tokens - sum(len(g) for g in groups)
        ours.append(tokens / ours_s)
        theirs.append(tokens / theirs_s)  # ignore_eos: full depth emits as many tokens
        ours_decode.append(decoded / ours_d)
        theirs_decode.append(decoded / theirs_d)
    return outs, ours, theirs, ours_decode, theirs_decode


def speculative_config(args, E, d, threshold, draft_dtype, top_k, exit_threshold):
    """The config of one row, from the flags by their flat names (eecore.cli.speculative_flags)."""
    if args.accept == "confident" and exit_threshold is None:
        exit_threshold = threshold  # drafts at least the draft threshold sure exit unverified
    options = dict(exit_layer=E, num_speculations=d, draft_threshold=threshold, min_acceptance=args.min_acceptance,
                   draft=args.draft, hybrid_switch=args.hybrid_switch,
                   exit_threshold=exit_threshold, exit_measure=args.exit_measure,
                   disable_by_batch_size=args.disable_by_batch_size,
                   layer_disable_by_batch_size=args.layer_disable_by_batch_size,
                   layer_speculations=None if args.layer_speculations is None else min(args.layer_speculations, d))
    if args.draft != "layer":
        options.update(lookup_min_ngram=args.lookup_ngrams[0], lookup_max_ngram=args.lookup_ngrams[1])
    if args.draft_layers == "separate":
        options.update(draft_layers="separate", draft_dtype=draft_dtype, draft_top_k=top_k)
    return from_flat(eecore.SelfSpeculativeConfig, {k: v for k, v in options.items() if v is not None})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--exit-layers", type=int, nargs="+", default=[6, 12, 18, 24])
    ap.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts-batch1", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None,
                    help="continuous batching: this many prompts go through one generate call of an engine with "
                         "max_num_seqs = the batch size, as a server runs them (a finished sequence's place goes to "
                         "the next prompt); by default each group of B prompts runs to its end before the next")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers (only the ratio to full depth)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="float32",
                    help="eecore's model dtype, for both full depth and speculation (HF stays float32)")
    ap.add_argument("--out-name", default=None, help="results file prefix (default: cpu-self-speculation[-guard])")
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternating runs of each configuration and full depth; medians")
    ap.add_argument("--draft-thresholds", nargs="+", default=["none", "0.6"],
                    help="adaptive draft length thresholds to try ('none' drafts all d tokens)")
    ap.add_argument("--draft", choices=["layer", "lookup", "hybrid"], default="layer",
                    help="where drafts come from: layer, lookup or both (SelfSpeculativeConfig.layer / .lookup)")
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="chat",
                    help="the CLI's chat prompts, or held-out code-completion prompts")
    ap.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE",
                    help="exit adapters for layer drafts: the ones shipped for the default model (no FILE), or a file")
    ap.add_argument("--draft-layers", choices=["shared", "separate"], default="shared",
                    help="separate: a draft copy (LayerDrafts.copy)")
    ap.add_argument("--draft-dtypes", nargs="+", default=[None], choices=[None, "float32", "bfloat16", "int8"],
                    help="--draft-layers separate: the draft copy's dtypes to run (default: the model's)")
    ap.add_argument("--layer-speculations", type=int, default=None,
                    help="the longest layer-E draft (LayerDrafts.max_length)")
    ap.add_argument("--hybrid-switch", choices=["round", "token"], default="round",
                    help="--draft hybrid: SelfSpeculativeConfig.hybrid_switch")
    ap.add_argument("--lookup-ngrams", type=int, nargs=2, default=[1, 3], metavar=("MIN", "MAX"),
                    help="LookupDrafts(min_ngram=MIN, max_ngram=MAX)")
    ap.add_argument("--draft-top-ks", type=int, nargs="+", default=[1],
                    help="--draft-layers separate: DraftCopy.top_k values to run")
    ap.add_argument("--accept", choices=["verified", "confident"], default="verified",
                    help="confident: dynamic early exit with deferred K/V (LayerDrafts.exit_threshold); "
                         "the rows then report the early-exit rate and ROUGE-L to full depth")
    ap.add_argument("--exit-measure", default=None,
                    help="LayerDrafts.exit_measure: what the draft and exit thresholds compare with ('agreement': "
                         "the shipped exit decision; default: the draft's top-1 probability)")
    ap.add_argument("--exit-thresholds", type=float, nargs="+", default=[None],
                    help="--accept confident: LayerDrafts.exit_threshold values to run (default: "
                         "the draft threshold)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None, metavar="N",
                    help="SelfSpeculativeConfig.disable_by_batch_size: plain steps above N decoding sequences")
    ap.add_argument("--layer-disable-by-batch-size", type=int, default=None, metavar="N",
                    help="LayerDrafts.disable_by_batch_size: layer drafts stop above N decoding sequences")
    ap.add_argument("--min-acceptance", type=parse_min_acceptance, default=None,
                    help="the speculation guard: stop drafting for sequences below this acceptance rate, "
                         "a number or 'break-even' (results go to cpu-self-speculation-guard-<date>.json)")
    args = ap.parse_args()
    separate = args.draft_layers == "separate"
    if not separate:
        args.draft_dtypes, args.draft_top_ks = [None], [1]
    thresholds = [None if t == "none" else float(t) for t in args.draft_thresholds]
    layers = args.draft != "lookup"
    if not layers:  # no exit layer, draft threshold or guard: one configuration per d
        args.exit_layers, thresholds, args.min_acceptance = [None], [None], None

    from eecore.models.loader import load_model

    hf = None if args.no_hf else hf_model_from_loaded(load_model(None, dtype=torch.float32))
    if args.requests is not None and args.requests < max(args.batch_sizes):
        ap.error(f"--requests must be at least the largest batch size ({max(args.batch_sizes)}), got {args.requests}")

    def engine_batch(batch: int) -> int:  # max_num_seqs: the batch itself when batching continuously
        return batch if args.requests else 8

    # full depth of the same model: an exit-ready file with LoRA pairs changes the base it merges into,
    # unless separate draft layers take them (then full depth is the original)
    full = eecore.LLM(dtype=args.dtype, device="cpu", max_num_seqs=8,
                      exit_adapter=None if separate else args.exit_adapter)
    prompts_all = bench_prompt_ids(full.tokenizer, args.prompts,
                                   max(args.batch_sizes + [args.num_prompts_batch1, args.requests or 0]))
    print(f"CPU: {cpu_model()}; {len(prompts_all)} {args.prompts} prompts")
    params = eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    full.generate(prompts_all[:1], eecore.SamplingParams(max_tokens=4))

    rows = []
    for batch in args.batch_sizes:
        prompts = prompts_all[: max(batch, args.num_prompts_batch1)] if batch > 1 else \
            prompts_all[: args.num_prompts_batch1]
        group = batch  # prompts per generate call
        if args.requests:
            prompts, group = prompts_all[: args.requests], args.requests
            full = eecore.LLM(dtype=args.dtype, device="cpu", max_num_seqs=engine_batch(batch),
                              exit_adapter=None if separate else args.exit_adapter)
        full_outs, full_tok_s = eecore_run(full, prompts, params, group)
        print(f"\nbatch {batch}: eecore full depth {full_tok_s:.1f} tok/s")
        hf_tok_s = {}
        if batch == 1 and not args.no_hf and layers:
            _, t = timed(lambda: [hf_generate_greedy(hf, [p], args.max_tokens) for p in prompts])
            hf_full = len(prompts) * args.max_tokens / t
            print(f"HF full depth {hf_full:.1f} tok/s")
            for E in args.exit_layers:
                _, t = timed(lambda: [hf_generate_greedy(hf, [p], args.max_tokens, assistant_early_exit=E)
                                      for p in prompts])
                hf_tok_s[E] = len(prompts) * args.max_tokens / t
        print(f"{'E':>3}{'d':>3}{'k':>3}{'thr':>9}{'draft':>9}{'tok/s':>9}{'vs full':>9}{'decode':>8}{'accept':>8}{'break-even':>11}{'tok/step':>9}"
              f"{'HF self-spec':>14}{'vs HF':>7}{'exact':>7}{'exits':>8}{'ROUGE':>7}")
        for E, d, threshold, draft_dtype, top_k, exit_threshold in itertools.product(
                args.exit_layers, args.drafts, thresholds, args.draft_dtypes, args.draft_top_ks, args.exit_thresholds):
            llm = eecore.LLM(dtype=args.dtype, device="cpu", max_num_seqs=engine_batch(batch),
                             exit_adapter=args.exit_adapter,
                             speculative=speculative_config(args, E, d, threshold, draft_dtype, top_k, exit_threshold))
            outs, runs, full_runs, decode_runs, full_decode_runs = alternate(llm, full, prompts, params, group,
                                                                             args.repeats)
            tok_s, full_tok_s = statistics.median(runs), statistics.median(full_runs)
            # (continuous batching has no decode-only span: requests start all along)
            decode_ratios = [] if args.requests else [a / b for a, b in zip(decode_runs, full_decode_runs)]
            accept = statistics.mean(o.metrics["acceptance_rate"] for o in outs)
            per_step = statistics.mean(o.metrics["mean_accepted_tokens_per_step"] for o in outs)
            quality = compare_outputs(outs, full_outs, full.model.num_layers)
            exact = quality["exact_match"] == 1.0
            ee_rate, rouge = quality["early_exit_rate"], quality["rouge_l_to_full"]
            # layer drafts' bandwidth-bound break-even (with the draft head's own bytes); lookup
            # drafts read no weights: theirs is 0
            head, stack = llm.engine.strategy.draft_head, llm.engine.strategy.draft_stack
            break_even = break_even_acceptance(full.model, E, d, head.weight_bytes(),
                                               None if stack is None else stack.weight_bytes()) if layers else 0.0
            row = dict(batch=batch, requests=args.requests, disable_by_batch_size=args.disable_by_batch_size,
                       layer_disable_by_batch_size=args.layer_disable_by_batch_size, draft=args.draft, exit_layer=E, num_speculations=d,
                       layer_speculations=llm.engine.strategy.config.layer_draft_length, draft_threshold=threshold,
                       draft_layers=args.draft_layers, draft_dtype=draft_dtype, draft_top_k=top_k,
                       tok_s=tok_s,
                       full_tok_s=full_tok_s, speedup_vs_full=tok_s / full_tok_s, acceptance_rate=accept,
                       break_even_acceptance_bandwidth_bound=break_even, tokens_per_verify_step=per_step,
                       identical_to_full=exact, accept=args.accept, exit_threshold=exit_threshold,
                       early_exit_rate=ee_rate,
                       rouge_l_to_full=rouge, tok_s_runs=runs, full_tok_s_runs=full_runs,
                       paired_ratios=[a / b for a, b in zip(runs, full_runs)],
                       decode_tok_s_runs=decode_runs, full_decode_tok_s_runs=full_decode_runs,
                       paired_decode_ratios=decode_ratios,
                       decode_speedup_vs_full=statistics.median(decode_ratios) if decode_ratios else None)
            for key in ("num_lookup_drafted_tokens", "num_lookup_accepted_tokens", "num_layer_proposals",
                        "num_layer_drafted_tokens", "num_layer_accepted_tokens", "num_tree_alternatives",
                        "num_tree_alternatives_accepted"):
                if key in outs[0].metrics:
                    row[key] = sum(o.metrics[key] for o in outs)
            hf_text = "-"
            if E in hf_tok_s:
                row.update(hf_self_spec_tok_s=hf_tok_s[E], speedup_vs_hf=tok_s / hf_tok_s[E])
                hf_text = f"{hf_tok_s[E]:.1f}"
            rows.append(row)
            vs_hf = f"{row['speedup_vs_hf']:.2f}" if "speedup_vs_hf" in row else "-"
            decode_text = "-" if row["decode_speedup_vs_full"] is None else f"{row['decode_speedup_vs_full']:.2f}"
            thr = ("-" if threshold is None else f"{threshold:g}") + ("" if exit_threshold is None else f"/{exit_threshold:g}")
            print(f"{E if E is not None else '-':>3}{d:3d}{top_k:3d}{thr:>9}{draft_dtype or '-':>9}{tok_s:9.1f}{tok_s / full_tok_s:9.2f}{decode_text:>8}{accept:8.2f}"
                  f"{break_even:11.2f}{per_step:9.2f}{hf_text:>14}{vs_hf:>7}{str(exact):>7}{'-' if ee_rate is None else f'{ee_rate:.2f}':>8}{rouge:7.3f}")
    name = args.out_name or "-".join(["cpu-self-speculation"] + ([args.draft] if args.draft != "layer" else [])
                                     + (["adapter"] if args.exit_adapter else [])
                                     + (["separate"] if separate else [])
                                     + (["code"] if args.prompts == "code" else [])
                                     + (["guard"] if args.min_acceptance is not None else [])
                                     + (["confident"] if args.accept == "confident" else []))
    path = save_results(name, dict(model="SmolLM2-135M-Instruct", dtype=args.dtype, max_tokens=args.max_tokens,
                                   draft=args.draft, hybrid_switch=args.hybrid_switch,
                                   lookup_ngrams=args.lookup_ngrams, prompts=args.prompts, exit_adapter=args.exit_adapter,
                                   draft_layers=args.draft_layers, min_acceptance=args.min_acceptance,
                                   repeats=args.repeats, rows=rows))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
