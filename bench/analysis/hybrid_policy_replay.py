"""How hybrid drafts should pick their source, decided by exact replay instead of timing noise.

Greedy output does not depend on the drafts, and a separate draft copy's token at a position is a
function of the tokens before it (its KV cache holds its own passes over them). So one full-depth
greedy run per prompt, plus one teacher-forced pass of the exit-ready draft copy over prompt and
output (its top-1 token and top-1 probability at every position), says exactly what any mix of
prompt-lookup and copy drafts would have had accepted, round by round:

- `round`: hybrid_switch="round", a sequence's whole draft from one source per round: lookup
  (n-grams min..max, up to d tokens) when it has a match, else up to `layer` copy tokens;
- `token`: hybrid_switch="token", per drafted position: lookup continuations while the draft so
  far ends in a match, one copy token where it does not (at most `layer` copy passes a round).

Both stop a copy run at a token below the draft threshold (not drafted; its pass is paid). The
lookup is eecore's own (eecore.text.ngram_index.NgramIndex). The speed column models a round's
cost in one-row full-depth steps: a verify pass of r rows costs `--verify-costs`[r-1] and a copy
pass `--copy-pass-cost` (defaults: `bench/cost_round.py verify-rows` on 2 EPYC cores, 2026-11-25:
1-5 and 7 rows 1.00 1.08 1.12 1.17 1.22 and 1.51, 6 rows interpolated as 1.36, a one-row pass of
the int8 copy's 8 layers 0.09; multi-row copy passes cost more); a copy's catch-up on the prompt
is left out (both switches pay it once per sequence). Tokens per round are exact; the speed is
only as good as the costs.

    python bench/analysis/hybrid_policy_replay.py [--num-prompts 24] [--max-tokens 96] [--top 12] [--layer-only]
        [--prompts code|chat|everyday]

writes bench/results/<machine>/hybrid-policy-replay-<date>.json (every policy's figures). `--layer-only`
ranks stopping rules for layer drafts alone instead (the layer preset; layer-policy-replay-<date>.json),
with and without the per-sequence draft length (long_draft_acceptance: the decoder's own
eecore.speculative.draft_length rule, run on the replay).
`--prompts` (default code) replays the benches' chat or everyday requests instead, in the chat
template, each continuation ending at the model's end of turn (code continuations run the full
`--max-tokens`); the results' name then ends in the kind (layer-policy-replay-chat-<date>.json).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Optional

import torch

import eecore
from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.speculative.draft_length import DraftLength

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import PROMPT_KINDS, GreedyReplay, bench_prompt_ids, chat_prompt_ids, cpu_model, save_results  # noqa: E402


@torch.no_grad()
def record(num_prompts: int, max_tokens: int, kind: str = "code", texts: Optional[list[str]] = None,
           features: bool = False, taps: tuple[int, ...] = ()) -> list[dict]:
    """Per prompt of `kind` (common.bench_prompt_ids: held-out code by default; or `texts`, raw
    prompts continued as code, or user messages in the chat template where `kind` is chat or everyday): its tokens, the full model's greedy continuation, and the exit-ready draft copy's
    teacher-forced top-1 token and probability for each continuation position. With `features`,
    also what an exit decision could read there: the second probability, the entropy over the draft
    vocabulary, and the copy's layer-E states (fp16). `taps`: earlier layers of the copy whose states
    are read through the draft head as well (`agree<L>`: its top-1 is the exit's token; `p<L>`: its
    probability of that token)."""
    full = eecore.LLM(device="cpu", max_num_seqs=8)
    spec = eecore.LLM(device="cpu", max_num_seqs=8, exit_adapter=True,
                      speculative=eecore.SelfSpeculativeConfig.exit_ready("layer"))
    stack = spec.engine.strategy.draft_stack
    if texts is None:
        prompts = bench_prompt_ids(full.tokenizer, kind, num_prompts)
    elif kind == "code":
        prompts = [full.tokenizer.encode(t) for t in texts]
    else:
        prompts = [chat_prompt_ids(full.tokenizer, t) for t in texts]
    # a chat answer ends at the end of turn; past it the model would write what no request asks for
    outs = full.generate(prompts, eecore.SamplingParams(max_tokens=max_tokens, ignore_eos=kind == "code"))
    records = []
    for prompt, out in zip(prompts, outs):
        ids = prompt + list(out.token_ids)
        seq = Sequence(ids, eecore.SamplingParams(max_tokens=1))
        spec.engine.blocks.grow(seq, len(ids))  # never scheduled: it only holds blocks for this pass
        try:
            inputs = stack.runner.prepare([Row(seq, 0, ids)])
            hidden = stack.runner.embed(inputs)
            continuation = slice(len(prompt) - 1, len(ids) - 1)  # the states that predict the continuation
            tapped, done = {}, 0
            for layer in sorted(taps):
                stack.runner.run_layers(hidden, inputs.attn, done, layer)
                tapped[layer], done = hidden[continuation].clone(), layer
            stack.runner.run_layers(hidden, inputs.attn, done, stack.exit_layer)
            states = hidden[continuation]
            probs = head_probabilities(stack.head, states)
            top = probs.topk(2, dim=-1)
            columns = top.indices[:, 0]
            rec = dict(prompt=prompt, full=list(out.token_ids), copy=stack.head.token_ids(columns).tolist(),
                       copy_p=top.values[:, 0].tolist())
            for layer, early in tapped.items():
                early_probs = head_probabilities(stack.head, early)
                rec[f"agree{layer}"] = (early_probs.argmax(-1) == columns).float().tolist()
                rec[f"p{layer}"] = early_probs.gather(1, columns[:, None])[:, 0].tolist()
            if features:
                rec.update(copy_p2=top.values[:, 1].tolist(),
                           copy_entropy=(-(probs * probs.clamp_min(1e-12).log()).sum(-1)).tolist(),
                           states=states.to(torch.float16).clone())
        finally:
            spec.engine.blocks.free(seq)
        records.append(rec)
    return records


def head_probabilities(head, states: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """The draft head's probabilities over its vocabulary for each of `states` `[n, d]` -> `[n, K]`
    (its logits are a view of its own buffer, so each chunk is read before the next)."""
    return torch.cat([head.columns(states[i:i + chunk]).softmax(-1) for i in range(0, states.shape[0], chunk)])


class Replay(GreedyReplay):
    """One record replayed round by round, with the draft copy's teacher-forced tokens."""

    def __init__(self, rec: dict, min_n: int, max_n: int):
        super().__init__(rec["prompt"], rec["full"], min_n, max_n)
        self.rec = rec

    def copy_draft(self, drafts: list[int], threshold) -> bool:
        """One copy pass after `drafts`: appends the copy's token there unless its top-1 probability
        is below `threshold`; whether it did. (Past a wrong draft the copy would see other tokens;
        what it drafts there is rejected anyway.)"""
        k = min(self.pos + len(drafts), len(self.rec["copy"]) - 1)
        if threshold is not None and self.rec["copy_p"][k] < threshold:
            return False
        drafts.append(self.rec["copy"][k])
        return True


def draft_round(r: Replay, d: int, layer: int, threshold) -> tuple[list[int], int]:
    drafts = r.index.propose(d)
    if drafts:
        return drafts, 0
    passes = 0
    while len(drafts) < min(d, layer):
        passes += 1
        if not r.copy_draft(drafts, threshold):
            break
    return drafts, passes


def draft_token(r: Replay, d: int, layer: int, threshold) -> tuple[list[int], int]:
    drafts, passes = [], 0
    while len(drafts) < d:
        more = r.index.propose(d - len(drafts), after=drafts)
        if more:
            drafts += more
            continue
        if passes == layer:
            break
        passes += 1
        if not r.copy_draft(drafts, threshold):
            break
    return drafts, passes


def replay(records, switch: str, d: int, layer: int, min_n: int, max_n: int, threshold, verify_costs, copy_cost) -> dict:
    draft = draft_round if switch == "round" else draft_token
    rounds = tokens = passes = rows = 0
    cost = 0.0
    for rec in records:
        r = Replay(rec, min_n, max_n)
        while not r.done:
            drafts, n = draft(r, d, layer, threshold)
            tokens += r.advance(drafts)
            rounds, passes, rows = rounds + 1, passes + n, rows + len(drafts) + 1
            cost += verify_costs[len(drafts)] + n * copy_cost
    return dict(switch=switch, d=d, layer=layer, min_ngram=min_n, max_ngram=max_n, threshold=threshold,
                tokens_per_round=tokens / rounds, copy_passes_per_round=passes / rounds,
                verify_rows_per_round=rows / rounds, modelled_speedup=tokens / cost)


def replay_layer_only(records, d: int, rule: str, threshold: float, verify_costs, copy_cost,
                      long_acceptance: Optional[float] = None) -> dict:
    """Layer drafts alone (exit_ready("layer")): up to d copy tokens a round, a copy run stopped at
    the first token whose top-1 probability (rule "token") or whose chain's product of top-1
    probabilities (rule "chain", the expected chance that every draft so far is right) falls
    below `threshold`; the stopping token's pass is paid. `long_acceptance`: the decoder's own
    DraftLength (long_draft_acceptance) may end the chain after its first draft."""
    rounds = tokens = passes = 0
    cost = 0.0
    for rec in records:
        r = Replay(rec, 1, 1)
        seq = Sequence(rec["prompt"], eecore.SamplingParams())  # the length rule's key
        length = None if long_acceptance is None else DraftLength(long_acceptance)
        while not r.done:
            drafts, n, chain = [], 0, 1.0
            while len(drafts) < d:
                n += 1
                k = min(r.pos + len(drafts), len(rec["copy"]) - 1)
                p = rec["copy_p"][k]
                if (p if rule == "token" else chain * p) < threshold:
                    break
                chain *= p
                drafts.append(rec["copy"][k])
                if length is not None and len(drafts) == 1 and not length.goes_on(seq, p):
                    break
            if length is not None and n:
                length.record(seq, bool(drafts) and drafts[0] == rec["full"][r.pos])
            tokens += r.advance(drafts)
            rounds, passes = rounds + 1, passes + n
            cost += verify_costs[len(drafts)] + n * copy_cost
    return dict(d=d, rule=rule, threshold=threshold, long_draft_acceptance=long_acceptance,
                tokens_per_round=tokens / rounds, copy_passes_per_round=passes / rounds, modelled_speedup=tokens / cost)


def results_name(name: str, kind: str) -> str:
    return name if kind == "code" else f"{name}-{kind}"


def layer_only(records, args, agreement: float) -> None:
    rows = [replay_layer_only(records, d, rule, threshold, args.verify_costs, args.copy_pass_cost)
            for d in range(1, len(args.verify_costs))
            for rule, threshold in [("token", t) for t in (0.0, 0.1, 0.15, 0.2, 0.3, 0.4)] +
            [("chain", t) for t in (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)]]
    # the same stopping rules with the per-sequence draft length (long_draft_acceptance)
    rows += [replay_layer_only(records, d, "token", threshold, args.verify_costs, args.copy_pass_cost, long)
             for d in range(2, len(args.verify_costs)) for threshold in (0.1, 0.15, 0.2)
             for long in (0.3, 0.4, 0.5, 0.6)]
    rows.sort(key=lambda row: -row["modelled_speedup"])
    preset = eecore.SelfSpeculativeConfig.exit_ready("layer")
    at = next(i for i, row in enumerate(rows) if (row["d"], row["rule"], row["threshold"], row["long_draft_acceptance"])
              == (preset.num_speculations, "token", preset.layer.stop_below, preset.layer.long_draft_acceptance))
    print(f"{'rank':>4} {'d':>2} {'rule':>6} {'thr':>5} {'long':>5} {'tok/round':>9} {'copy passes':>11} "
          f"{'speed (model)':>13}")
    for i, row in enumerate(rows):
        if i < args.top or i == at:
            long = "-" if row["long_draft_acceptance"] is None else f"{row['long_draft_acceptance']:g}"
            print(f"{i + 1:4d} {row['d']:2d} {row['rule']:>6} {row['threshold']:5g} {long:>5} "
                  f"{row['tokens_per_round']:9.2f} {row['copy_passes_per_round']:11.2f} {row['modelled_speedup']:13.3f}"
                  f"{'  exit-ready layer preset' if i == at else ''}")
    path = save_results(results_name("layer-policy-replay", args.prompts), dict(
        model="SmolLM2-135M-Instruct", prompts=args.prompts, num_prompts=len(records), max_tokens=args.max_tokens,
        copy_agreement=agreement, verify_costs=args.verify_costs, copy_pass_cost=args.copy_pass_cost,
        preset=rows[at], preset_rank=at + 1, rows=rows))
    print(f"results: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--verify-costs", type=float, nargs="+", default=[1.00, 1.08, 1.12, 1.17, 1.22, 1.36, 1.51],
                    help="a verify pass of 1, 2, ... rows, in one-row full-depth steps")
    ap.add_argument("--copy-pass-cost", type=float, default=0.09, help="a draft copy pass, in one-row steps")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--layer-only", action="store_true",
                    help="rank stopping rules for layer drafts alone (the layer preset) instead of hybrid policies")
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="code",
                    help="held-out code completions, or the benches' chat or everyday requests")
    args = ap.parse_args()
    max_d = len(args.verify_costs) - 1
    records = record(args.num_prompts, args.max_tokens, args.prompts)
    tokens = sum(len(rec["full"]) for rec in records)
    agreement = sum(c == f for rec in records for c, f in zip(rec["copy"], rec["full"])) / tokens
    print(f"CPU: {cpu_model()}; {len(records)} {args.prompts} prompts, {tokens} greedy tokens (at most "
          f"{args.max_tokens} each); the copy's teacher-forced top-1 agreement {agreement:.3f}")
    if args.layer_only:
        return layer_only(records, args, agreement)
    rows = []
    for switch, d, layer, min_n, max_n, threshold in itertools.product(
            ["round", "token"], range(2, max_d + 1), [1, 2, 3, 4], [1, 2, 3], [3, 4, 5], [None, 0.15, 0.3]):
        if layer <= d and min_n <= max_n:
            rows.append(replay(records, switch, d, layer, min_n, max_n, threshold, args.verify_costs,
                               args.copy_pass_cost))
    rows.sort(key=lambda row: -row["modelled_speedup"])
    presets = {name: eecore.SelfSpeculativeConfig.exit_ready("hybrid", **over) for name, over in
               [("exit-ready hybrid", {}),
                ("round preset before it", dict(hybrid_switch="round", layer_speculations=1, lookup_min_ngram=1,
                                                lookup_max_ngram=3, draft_threshold=None))]}
    marked = {name: next(i for i, row in enumerate(rows) if
                         (row["switch"], row["d"], row["layer"], row["min_ngram"], row["max_ngram"], row["threshold"]) ==
                         (c.hybrid_switch, c.num_speculations, c.layer_draft_length, c.lookup.min_ngram,
                          c.lookup.max_ngram, c.layer.stop_below)) for name, c in presets.items()}
    print(f"{'rank':>4} {'switch':>6} {'d':>2} {'layer':>5} {'n-grams':>7} {'thr':>5} {'tok/round':>9} "
          f"{'copy passes':>11} {'rows':>5} {'speed (model)':>13}")
    for i, row in enumerate(rows):
        names = [name for name, j in marked.items() if j == i]
        if i < args.top or names:
            thr = "-" if row["threshold"] is None else f"{row['threshold']:g}"
            print(f"{i + 1:4d} {row['switch']:>6} {row['d']:2d} {row['layer']:5d} {row['min_ngram']:>3}-{row['max_ngram']:<3} "
                  f"{thr:>5} {row['tokens_per_round']:9.2f} {row['copy_passes_per_round']:11.2f} "
                  f"{row['verify_rows_per_round']:5.2f} {row['modelled_speedup']:13.2f}  {', '.join(names)}")
    path = save_results(results_name("hybrid-policy-replay", args.prompts), dict(
        model="SmolLM2-135M-Instruct", prompts=args.prompts, num_prompts=len(records), max_tokens=args.max_tokens,
        copy_agreement=agreement, verify_costs=args.verify_costs, copy_pass_cost=args.copy_pass_cost,
        presets={name: rows[i] for name, i in marked.items()}, rows=rows))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
