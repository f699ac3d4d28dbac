"""How well do Algorithm 1's measures tell an exit layer's right tokens from its wrong ones, read
through the shipped exit adapters of SmolLM2-135M-Instruct (layers 8, 12, 16)?

Teacher-forced along full depth's greedy continuation of held-out prompts
(eecore.train.exit_decision.collect), every position has each exit layer's token and what a measure
reads there. Each measure ranks the positions; the table gives the share of positions it can let
exit at a precision (the share of exits equal to full depth's token) and its precision at a
coverage (bench/analysis/exit_decision_ceiling.py's `table`):

- `softmax` (the seed's top-2 gap, Algorithm 1's default measure) and the top-1 probability;
- `agreement`: the shipped decision file (eecore.exits.agreement.SHIPPED), a logistic regression on
  the gap, top-1 probability, entropy and prompt lookup, fit on the training split's prompts;
- `perfect`: a decision that knows where the layer is right (its coverage is the layer's agreement
  with full depth).

An exit at layer E skips (30 - E) / 30 of the layers, so the seed's Table 1 point (54% of the layers
skipped) needs 74% of the tokens exiting at layer 8, 90% at layer 12, and is out of reach at 16.

    python bench/analysis/layer_exit_decision.py [--code 24] [--everyday 24] [--max-tokens 96]

writes bench/results/<machine>/layer-exit-decision-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import eecore
from eecore.exits import agreement
from eecore.train.exit_decision import collect
from exit_decision_ceiling import table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import bench_prompt_ids, cpu_model, save_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--code", type=int, default=24, help="held-out code prompts")
    ap.add_argument("--everyday", type=int, default=24, help="held-out everyday requests")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out-name", default="layer-exit-decision")
    args = ap.parse_args()

    llm = eecore.LLM(device="cpu", max_num_seqs=16, exit_adapter=True)
    layers = llm.exit_adapters.exit_layers()
    decisions = agreement.load(agreement.SHIPPED, llm.model, llm.exit_adapters)
    print(f"CPU: {cpu_model()}; exit layers {layers}")
    results = dict(model="SmolLM2-135M-Instruct", exit_adapters="shipped", max_tokens=args.max_tokens,
                   decision_file=os.path.basename(agreement.SHIPPED), evals={})
    for kind, n in (("code", args.code), ("everyday", args.everyday)):
        if not n:
            continue
        data = collect(llm, bench_prompt_ids(llm.tokenizer, kind, n), args.max_tokens, layers,
                       ignore_eos=kind == "code")
        results["evals"][kind] = {}
        for E, (x, y) in data.items():
            scores = {"softmax (top-2 gap)": x[:, 1], "top-1 probability": x[:, 0],
                      "agreement (shipped file)": decisions[E].probability(x), "perfect": y}
            rows = table(f"\nheld-out {kind}, exit layer {E}: {n} prompts, {len(y)} positions, "
                         f"layer agreement {y.mean():.3f}", scores, y)
            results["evals"][kind][str(E)] = dict(prompts=n, positions=len(y), agreement=y.mean().item(), rows=rows)
    print(f"results: {save_results(args.out_name, results)}")


if __name__ == "__main__":
    main()
