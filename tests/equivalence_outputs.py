"""The outputs of a fixed set of configurations (full depth, each early-exit measure and batch rule,
each kind of self-speculation, both exit-ready presets, greedy and seeded sampling), as JSON: what
tests/test_refactor_equivalence.py compares between this tree's eecore and an earlier one's. Run
as a script with whichever eecore is first on the path:

    python tests/equivalence_outputs.py TINY_MODEL_DIR OUT.json

Only APIs both versions have are used. Timings are left out of the metrics."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

import eecore

PROMPTS = [[5, 9, 14, 3, 5, 9, 14, 3, 5, 9], [20, 4, 17, 8, 31, 2, 11]]  # one repeats itself (lookup drafts)


def _configs(tiny: str) -> dict:
    S, L, C = eecore.SelfSpeculativeConfig, eecore.LayerDrafts, eecore.DraftCopy
    E = eecore.EarlyExitConfig
    return {
        "full depth": dict(model=tiny),
        "early exit softmax, all": dict(model=tiny, early_exit=E(measure="softmax", threshold=0.02)),
        "early exit softmax, compact": dict(model=tiny, early_exit=E(measure="softmax", threshold=0.02,
                                                                     batch_rule="compact")),
        "early exit cosine": dict(model=tiny, early_exit=E(measure="cosine", threshold=0.9)),
        "early exit static": dict(model=tiny, early_exit=E(measure="static", exit_layer=2)),
        "layerskip": dict(model=tiny, speculative=S(num_speculations=3, layer=L(exit_layer=2))),
        "draft copy": dict(model=tiny, speculative=S(num_speculations=3, layer=L(exit_layer=2, copy=C()))),
        "token trees": dict(model=tiny, speculative=S(num_speculations=2, layer=L(exit_layer=2, copy=C(top_k=2)))),
        "lookup": dict(model=tiny, speculative=S(num_speculations=3, lookup=eecore.LookupDrafts(min_ngram=1))),
        "hybrid, per round": dict(model=tiny, speculative=S(num_speculations=3, layer=L(exit_layer=2),
                                                            lookup=eecore.LookupDrafts(min_ngram=1))),
        "hybrid, per token": dict(model=tiny, speculative=S(num_speculations=3, hybrid_switch="token",
                                                            layer=L(exit_layer=2, copy=C()),
                                                            lookup=eecore.LookupDrafts(min_ngram=1))),
        "exits through the copy": dict(model=tiny, speculative=S(num_speculations=3, layer=L(
            exit_layer=2, stop_below=0.0, exit_threshold=0.05, copy=C()))),
        # dequantized: over the file's own blocks a lone row and a row among several round differently,
        # and these adaptive presets' verify widths follow the machine's timings
        "exit-ready layer": dict(model=None, exit_adapter=True, quantization="none",
                                 speculative=_as_at_the_reshaping(S.exit_ready("layer", device="cpu"))),
        "exit-ready hybrid": dict(model=None, exit_adapter=True, quantization="none",
                                  speculative=S.exit_ready("hybrid", device="cpu")),
    }


def _as_at_the_reshaping(preset):
    """The layer preset as it was when the reshaping was made (the copy alone): the draft sources it
    gained since (a feature head, prompt lookup first) change which rows verify together, and so a
    row's rounding, in ways the reshaping has nothing to do with."""
    if not hasattr(preset, "feature"):
        return preset
    return replace(preset, feature=None, lookup=None)


# what an adaptive config (the exit-ready presets) drafts follows the pass costs it measures while
# decoding, that is the machine's timings: of its metrics only these are the same run to run
UNTIMED = ("num_prompt_tokens", "num_output_tokens", "num_preemptions", "mean_layers_per_token", "early_exit_rate")


def _record(out, timed: bool) -> dict:
    metrics = {k: v for k, v in out.metrics.items()
               if not k.endswith("_s") and k != "tokens_per_s" and (not timed or k in UNTIMED)}
    logprobs = [{str(t): round(p, 5) for t, p in step.items()} for step in (out.logprobs or [])]
    return dict(tokens=out.token_ids, exit_layers=list(out.exit_layers or []), logprobs=logprobs, metrics=metrics)


def outputs(tiny: str) -> dict:
    results = {}
    for name, config in _configs(tiny).items():
        model = config.pop("model")
        timed = getattr(config.get("speculative"), "adaptive", False)
        llm = eecore.LLM(model, dtype="float32", device="cpu", block_size=4, num_blocks=96, max_num_seqs=2, **config)
        prompts = PROMPTS if model is not None else ["def fibonacci(n):", "Name three colours."]
        greedy = eecore.SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
        sampled = [eecore.SamplingParams(max_tokens=10, temperature=0.8, seed=7 + i, logprobs=2, ignore_eos=True)
                   for i in range(len(prompts))]
        results[name] = {"greedy": [_record(o, timed) for o in llm.generate(prompts, greedy)],
                         "sampled": [_record(o, timed) for o in llm.generate(prompts, sampled)]}
    return results


if __name__ == "__main__":
    json.dump(outputs(sys.argv[1]), open(sys.argv[2], "w"), indent=1, sort_keys=True)
