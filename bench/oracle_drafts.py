"""The ceiling of layer drafts on this machine: how fast self-speculation would run if every draft
were right, with the draft passes still paid for.

Greedy output does not depend on the drafts, so full depth's own greedy continuation of each prompt
says, in advance, which draft every round would have had accepted. This bench runs the exit-ready
layer preset (the shipped int8 copy of layers 0-7, d drafts a round, no draft threshold: every
chain is d long) twice beside full depth of the same model:

- `drafts`: as shipped, the copy's own drafts;
- `perfect`: the same passes of the copy run, and then each of its drafts is replaced by the token
  full depth emits there (an oracle), so every draft is accepted while the copy's cost stays.

`perfect` is the most any training of the copy can give at that d and batch on this CPU; the gap
between the two rows is what better drafts could still win, and a `perfect` row below a goal says
that no draft file can reach it here (on a 2-core AVX2 CPU at batch 8: the verify rows' arithmetic).
Each configuration alternates with full depth group by group (bench/self_speculation.py's
`alternate`); ratios are of the medians, `decode` leaves out the prefill both share.

    python bench/oracle_drafts.py [--batch-sizes 1 8] [--drafts 1 2 4] [--prompts code]
                                  [--num-prompts 8] [--max-tokens 64] [--repeats 2] [--out-name NAME]

writes bench/results/<out-name>-<date>.json (default oracle-drafts).
"""
from __future__ import annotations

import argparse
import statistics

import eecore
from common import PROMPT_KINDS, bench_prompt_ids, cpu_model, save_results
from self_speculation import alternate


def install_oracle(llm, continuations: dict[tuple, list[int]]) -> None:
    """Make `llm`'s layer drafts the tokens of `continuations` (prompt ids -> full depth's greedy
    output) after the copy has run: each round's k-th draft of a sequence whose output holds m
    tokens is continuation[m + k]. The copy's passes, the draft head and the proposal's ops all
    still run; only the tokens they chose are replaced."""
    decoder = llm.engine.strategy
    chain: dict[int, int] = {}  # seq_id -> drafts proposed so far this round
    copy_drafts, propose = decoder.proposer.propose, decoder.picker.propose

    def round_drafts(seqs, drafts, budgets):
        chain.clear()
        return copy_drafts(seqs, drafts, budgets)

    def oracle_propose(logits, seqs):
        proposal = propose(logits, seqs)
        for i, seq in enumerate(seqs):
            k = chain.get(seq.seq_id, 0)
            chain[seq.seq_id] = k + 1
            wanted = continuations[tuple(seq.prompt_token_ids)]
            position = len(seq.output_token_ids) + k
            if position < len(wanted):
                proposal.tokens[i] = wanted[position]
        return proposal

    decoder.proposer.propose, decoder.picker.propose = round_drafts, oracle_propose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="code")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out-name", default="oracle-drafts")
    args = ap.parse_args()
    if args.num_prompts < max(args.batch_sizes):
        ap.error(f"--num-prompts must be at least the largest batch size ({max(args.batch_sizes)}), "
                 f"got {args.num_prompts}")

    batch_cap = max(args.batch_sizes)
    full = eecore.LLM(dtype="float32", max_num_seqs=batch_cap)
    prompts = bench_prompt_ids(full.tokenizer, args.prompts, args.num_prompts)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    reference = [o.token_ids for o in full.generate(prompts, params)]
    continuations = {tuple(p): list(r) for p, r in zip(prompts, reference)}
    print(f"CPU: {cpu_model()}; {len(prompts)} {args.prompts} prompts, {args.max_tokens} tokens")
    print(f"{'batch':>5}{'d':>3}{'drafts':>9}{'accept':>8}{'tok/round':>10}{'vs full':>9}{'decode':>8}{'full tok/s':>11}")

    rows = []
    for d in args.drafts:
        for oracle in (False, True):
            config = eecore.SelfSpeculativeConfig.exit_ready(
                "layer", num_speculations=d, draft_threshold=None, long_draft_acceptance=None,
                disable_by_batch_size=None)
            llm = eecore.LLM(dtype="float32", max_num_seqs=batch_cap, exit_adapter=True, speculative=config)
            if oracle:
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
                if oracle and accepted != drafted:  # the decoder no longer drafts where install_oracle hooks in
                    raise SystemExit(f"batch {batch}, d = {d}: perfect drafts accepted {accepted} of {drafted}")
                row = dict(batch=batch, d=d, drafts="perfect" if oracle else "shipped",
                           acceptance=accepted / max(drafted, 1), tokens_per_round=(accepted + rounds) / max(rounds, 1),
                           vs_full=statistics.median(ours) / statistics.median(theirs),
                           decode_vs_full=statistics.median(ours_d) / statistics.median(theirs_d),
                           tok_s=ours, full_tok_s=theirs, decode_tok_s=ours_d, full_decode_tok_s=theirs_d,
                           outputs_identical=identical)
                rows.append(row)
                print(f"{batch:5d}{d:3d}{row['drafts']:>9}{row['acceptance']:8.2f}{row['tokens_per_round']:10.2f}"
                      f"{row['vs_full']:9.2f}{row['decode_vs_full']:8.2f}{statistics.median(theirs):11.1f}")
    path = save_results(args.out_name, dict(model="SmolLM2-135M-Instruct", dtype="float32", draft="exit-ready layer preset, "
                                            "int8 copy, no draft threshold", prompts=args.prompts,
                                            num_prompts=len(prompts), max_tokens=args.max_tokens,
                                            repeats=args.repeats, rows=rows))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
