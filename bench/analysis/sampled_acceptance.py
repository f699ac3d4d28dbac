"""Why the exit-ready draft copy pays for greedy requests only, and what a draft temperature buys.

A sampled request accepts a draft y ~ q with probability min(1, p(y) / q(y)), so a draft position's
expected acceptance is sum_v min(p(v), q(v)) = 1 - TV(p, q), p being full depth's distribution at
the request's temperature T and q the copy's. The copy's draft head covers 8,192 tokens of 49,152:
the mass p puts outside them is lost whatever q is, so the mass inside, m, bounds the acceptance of
any q the head can give. This replays that exactly, without timing: full depth samples a
continuation of each held-out prompt at T (seeded), then full depth and the copy are teacher-forced
over prompt and continuation, and at every continuation position the script computes

- `accept`: sum min(p, q) for q at the draft temperature T * tau (tau = 1 is what eecore draws
  from), for each tau of `--taus`;
- `inside`: m, the most any q over the draft vocabulary could be accepted;
- `two drafts`: the acceptance of the first of two drafts drawn from q and tried in turn (the second
  against the residual, as SpecInfer's recursive rejection sampling does), what draft alternatives
  for sampled rows could give;
- `greedy agreement`: whether the copy's top token is full depth's (what a greedy request accepts;
  at T = 0, along full depth's greedy continuations, the only figure).

    python bench/analysis/sampled_acceptance.py [--num-prompts 24] [--max-tokens 96]
        [--temperatures 0 0.7 1.0] [--taus 0.8 0.9 1.0 1.1 1.25 1.5] [--prompts code|chat|everyday]

writes bench/results/<machine>/sampled-acceptance-<kind>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import eecore
from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.models.int8_weights import project

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import PROMPT_KINDS, bench_prompt_ids, cpu_model, save_results  # noqa: E402

CHUNK = 8  # rows a head call takes (the runners' logits buffers hold at least this many)


def normed_draft_state(head, states: torch.Tensor) -> torch.Tensor:
    """The draft head's input to its projection: layer-E `states` through the head's adapter block
    and the model's final norm (what DraftHead.columns projects onto its K columns)."""
    return head.model.final_norm_(head.adapted(states), torch.empty_like(states))


@torch.no_grad()
def teacher_forced(full, spec, ids: list[int], first: int, whole_vocabulary: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full depth's logits `[n, V]` and the copy's vocabulary-wide draft logits `[n, V]` (-inf
    outside its draft vocabulary, unless `whole_vocabulary`: every row of the LM head) predicting
    ids[first:], teacher-forced over `ids`."""
    out = []
    for llm, layers in ((full, None), (spec, spec.engine.strategy.draft_stack)):
        runner = llm.engine.runner if layers is None else layers.runner
        end = runner.num_layers if layers is None else layers.exit_layer
        seq = Sequence(ids, eecore.SamplingParams(max_tokens=1))
        llm.engine.blocks.grow(seq, len(ids))  # never scheduled: it only holds blocks for this pass
        try:
            inputs = runner.prepare([Row(seq, 0, ids)])
            hidden = runner.embed(inputs)
            runner.run_layers(hidden, inputs.attn, 0, end)
            states = hidden[first - 1: len(ids) - 1]
            # each chunk's logits are a view of the runner's or head's buffer: cloned before the next
            if layers is None:
                rows = [runner.logits(states[i:i + CHUNK]).clone() for i in range(0, states.shape[0], CHUNK)]
            elif whole_vocabulary:
                head = layers.head
                rows = [project(torch.empty(min(CHUNK, states.shape[0] - i), head.model.config.vocab_size,
                                            dtype=states.dtype), normed_draft_state(head, states[i:i + CHUNK]),
                                head.model.lm_head)
                        for i in range(0, states.shape[0], CHUNK)]
            else:
                head = layers.head
                rows = [head.widen(head.columns(states[i:i + CHUNK])).clone()
                        for i in range(0, states.shape[0], CHUNK)]
            out.append(torch.cat(rows).float())
        finally:
            llm.engine.blocks.free(seq)
    return out[0], out[1]


def position_figures(full_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float,
                     taus: list[float]) -> dict:
    """Per position: whether the two top tokens agree and, at a temperature above 0, sum min(p, q_tau)
    for each tau and the mass p puts inside the draft vocabulary."""
    figures = {"greedy_agreement": (full_logits.argmax(-1) == draft_logits.argmax(-1)).float()}
    if temperature == 0:
        return figures
    p = torch.softmax(full_logits / temperature, dim=-1)
    figures["inside"] = (p * torch.isfinite(draft_logits)).sum(-1)
    for tau in taus:
        q = torch.softmax(draft_logits / (temperature * tau), dim=-1)
        figures[f"accept_tau_{tau:g}"] = torch.minimum(p, q).sum(-1)
    # Two drafts for the position, drawn from q independently, tried in turn (SpecInfer's recursive
    # rejection sampling: the second against the residual normalize(max(p - q, 0)), still lossless):
    # what a sampled row's draft alternatives could add.
    q = torch.softmax(draft_logits / temperature, dim=-1)
    first = torch.minimum(p, q).sum(-1)
    residual = (p - q).clamp_min(0)
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)
    figures["accept_two_drafts"] = first + (1 - first) * torch.minimum(residual, q).sum(-1)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0],
                    help="full depth's continuations are sampled at each (0: greedy, agreement only)")
    ap.add_argument("--taus", type=float, nargs="+", default=[0.8, 0.9, 1.0, 1.1, 1.25, 1.5])
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="code")
    ap.add_argument("--whole-vocabulary", action="store_true",
                    help="the copy's logits over every token (the LM head's rows), not its draft vocabulary's")
    args = ap.parse_args()

    full = eecore.LLM(device="cpu", max_num_seqs=8)
    spec = eecore.LLM(device="cpu", max_num_seqs=8, exit_adapter=True,
                      speculative=eecore.SelfSpeculativeConfig.exit_ready("layer"))
    prompts = bench_prompt_ids(full.tokenizer, args.prompts, args.num_prompts)
    results = []
    for temperature in args.temperatures:
        params = [eecore.SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i,
                                        ignore_eos=args.prompts == "code") for i in range(len(prompts))]
        outs = full.generate(prompts, params)
        sums: dict[str, float] = {}
        count = 0
        for prompt, out in zip(prompts, outs):
            if not out.token_ids:
                continue
            full_logits, draft_logits = teacher_forced(full, spec, prompt + list(out.token_ids), len(prompt),
                                                       args.whole_vocabulary)
            for name, values in position_figures(full_logits, draft_logits, temperature, args.taus).items():
                sums[name] = sums.get(name, 0.0) + float(values.sum())
            count += full_logits.shape[0]
        means = {name: total / count for name, total in sums.items()}
        results.append(dict(temperature=temperature, positions=count, **means))
        line = f"T = {temperature:g} ({count} positions): greedy agreement {means['greedy_agreement']:.3f}"
        if temperature > 0:
            accepts = "  ".join(f"tau {tau:g}: {means[f'accept_tau_{tau:g}']:.3f}" for tau in args.taus)
            line += (f", inside the draft vocabulary {means['inside']:.3f}; accepted {accepts}; "
                     f"either of two drafts {means['accept_two_drafts']:.3f}")
        print(line, flush=True)
    name = f"sampled-acceptance-{args.prompts}" + ("-whole-vocabulary" if args.whole_vocabulary else "")
    path = save_results(name, dict(
        what="expected acceptance of the exit-ready copy's sampled drafts, teacher-forced along full "
             "depth's sampled continuations (bench/analysis/sampled_acceptance.py)",
        cpu=cpu_model(), num_prompts=args.num_prompts, max_tokens=args.max_tokens, taus=args.taus,
        whole_vocabulary=args.whole_vocabulary,
        results=results))
    print("results:", path)


if __name__ == "__main__":
    main()
