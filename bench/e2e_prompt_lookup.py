"""Prompt-lookup drafts: eecore against economize 0.3.2's prompt-lookup drafter, on SmolLM2-135M (fp32,
CPU, batch 1) and held-out code prompts, 64 new tokens, greedy.

Configurations, all on the same weights and measured side by side in one run:
- `hf`: plain HF transformers `generate` (the model transformers itself loads from the default GGUF:
  bench/common.py's hf_model_from_gguf);
- `economize`: economize.apply(that model, LookupConfig(max_ngram, min_ngram), DecodeConfig(cycle_length=d+1))
  and its `generate` (PyPI package `economize`, for HF causal LMs). economize 0.3.2 refuses the
  `cache` model input that transformers 5.24 passes to its generate ("cannot forward the model
  inputs ['cache']"); it runs with transformers 5.23 (e.g. in a venv made with
  --system-site-packages and `pip install transformers==5.23.0`);
- `full`, `lookup`, `hybrid`: eecore at full depth, with prompt-lookup drafts, and with lookup drafts
  falling back to layer-E drafts (`--exit-layer`, `--exit-adapter`); with `--exit-ready` the hybrid
  is `SelfSpeculativeConfig.exit_ready("hybrid")`, the preset `eecore generate --exit-ready hybrid`
  runs (the shipped draft layers as an int8 copy; its own d, n-grams and exit layer).
Every repeat runs all configurations in turn, in an order that rotates between repeats, so drift and
bursts of load on a shared machine hit them alike; the table reports the median seconds of each
configuration over the whole prompt set, its tok/s and its ratios to HF and to economize, and
whether its tokens equal HF's greedy tokens (eecore full depth's without `hf`).

    python bench/e2e_prompt_lookup.py [--num-prompts 8] [--max-tokens 64] [--repeats 3]
        [--num-speculations 4] [--min-ngram 1] [--max-ngram 3] [--exit-layer 12] [--layer-speculations D]
        [--exit-adapter [FILE]] [--exit-ready]
        [--economize-match earliest|latest] [--configs hf economize full lookup hybrid] [--out-name NAME]

writes bench/results/<machine>/cpu-prompt-lookup-<date>.json. `--sweep-ngrams` instead measures, from one
full-depth greedy run per prompt, the tokens per verify round that lookup drafts would give for
each (min_ngram, max_ngram, d) (greedy output does not depend on the drafts, so this is exact and
needs no timing).

Held-out code prompts come from `eecore.evaluation.prompts.heldout_code_prompts(n)`: function starts from
the packages held out of the exit adapters' training corpus (jinja2, tqdm, gguf).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch

import eecore
from common import cpu_model, hf_model_from_gguf, rotated, save_results, timed
from eecore.evaluation.prompts import heldout_code_prompts

def _version(package: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def hf_model():
    from eecore.models.loader import default_model_path

    return hf_model_from_gguf(default_model_path())


def hf_generation_config(model, max_new_tokens: int):
    import copy

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id = model.config.vocab_size + 1000, 0  # never stop early
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    config.temperature = config.top_p = config.top_k = None
    return config


def greedy_runner(generate, config):
    """Each prompt in turn through `generate` (HF's, or economize's wrapper of it) with the
    generation `config`: the new token ids."""
    def run(prompts):
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                out = generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                outs.append(out[0, len(p):].tolist())
        return outs
    return run


def hf_runner(model, max_new_tokens: int):
    return greedy_runner(model.generate, hf_generation_config(model, max_new_tokens))


def economize_runner(model, max_new_tokens: int, min_ngram: int, max_ngram: int, d: int, match: str):
    import economize
    from economize.techniques.lookup import LookupConfig

    eco = economize.apply(model, LookupConfig(max_ngram=max_ngram, min_ngram=min_ngram, match=match),
                          decoding=economize.DecodeConfig(cycle_length=d + 1))
    return greedy_runner(eco.generate, hf_generation_config(model, max_new_tokens))


def eecore_runner(llm, max_new_tokens: int, stats: dict):
    params = eecore.SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)

    def run(prompts):
        outs = []
        for p in prompts:  # batch 1
            o = llm.generate([p], params)[0]
            outs.append(o.token_ids)
            for key in ("acceptance_rate", "mean_accepted_tokens_per_step", "num_lookup_drafted_tokens",
                        "num_lookup_accepted_tokens", "num_layer_drafted_tokens", "num_layer_accepted_tokens"):
                if key in o.metrics:
                    stats.setdefault(key, []).append(o.metrics[key])
        return outs
    return run


def sweep_ngrams(args, prompts_ids):
    """Tokens per verify round of lookup drafts, simulated exactly on full-depth greedy outputs."""
    from eecore.text.ngram_index import lookup_reference

    llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=len(prompts_ids))
    outs = llm.generate(prompts_ids, eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    rows = []
    print(f"{'min':>4}{'max':>4}{'d':>3}{'tok/round':>10}{'drafted/round':>14}{'accept':>8}")
    for lo, hi in [(1, 1), (1, 2), (1, 3), (1, 4), (2, 2), (2, 3), (2, 4), (3, 3), (3, 5)]:
        for d in (2, 4, 6, 8):
            rounds = emitted = drafted = accepted = 0
            for prompt, out in zip(prompts_ids, outs):
                gen = out.token_ids
                pos = 1  # the first token comes from prefill
                while pos < len(gen):
                    budget = min(d, len(gen) - pos - 1)
                    draft = lookup_reference(prompt + gen[:pos], lo, hi, budget)
                    k = 0
                    while k < len(draft) and draft[k] == gen[pos + k]:
                        k += 1
                    rounds += 1
                    drafted += len(draft)
                    accepted += k
                    emitted += k + 1
                    pos += k + 1
            rows.append(dict(min_ngram=lo, max_ngram=hi, num_speculations=d, tokens_per_round=emitted / rounds,
                             drafted_per_round=drafted / rounds, acceptance=accepted / max(drafted, 1)))
            r = rows[-1]
            print(f"{lo:4d}{hi:4d}{d:3d}{r['tokens_per_round']:10.2f}{r['drafted_per_round']:14.2f}"
                  f"{r['acceptance']:8.2f}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-speculations", type=int, default=4, help="d: draft tokens per round (economize: d+1 cycle)")
    ap.add_argument("--min-ngram", type=int, default=None, help="default: LookupDrafts'")
    ap.add_argument("--max-ngram", type=int, default=None, help="default: LookupDrafts'")
    ap.add_argument("--exit-layer", type=int, default=12, help="layer drafts of the hybrid")
    ap.add_argument("--layer-speculations", type=int, default=None,
                    help="the hybrid's longest layer draft (default: --num-speculations)")
    ap.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE",
                    help="exit adapters for the hybrid's layer drafts: the shipped ones (no FILE), or a file")
    ap.add_argument("--exit-ready", action="store_true",
                    help="the hybrid is SelfSpeculativeConfig.exit_ready('hybrid') with the shipped file "
                         "(implies --exit-adapter; --exit-layer/--layer-speculations do not apply)")
    ap.add_argument("--economize-match", choices=["earliest", "latest"], default="earliest",
                    help="which earlier occurrence economize copies (its default: earliest; eecore: latest)")
    ap.add_argument("--configs", nargs="+", default=["hf", "economize", "full", "lookup", "hybrid"],
                    choices=["hf", "economize", "full", "lookup", "hybrid"])
    ap.add_argument("--sweep-ngrams", action="store_true", help="only the simulated n-gram sweep (no timing)")
    ap.add_argument("--out-name", default="cpu-prompt-lookup")
    args = ap.parse_args()
    if args.exit_ready and args.exit_adapter is None:
        args.exit_adapter = True  # the preset drafts with the shipped draft layers
    defaults = eecore.LookupDrafts()
    lo = defaults.min_ngram if args.min_ngram is None else args.min_ngram
    hi = defaults.max_ngram if args.max_ngram is None else args.max_ngram
    d = args.num_speculations

    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    texts, source = heldout_code_prompts(args.num_prompts), "eecore.evaluation.prompts.heldout_code_prompts"
    # every eecore configuration runs the model under test: with an exit-ready file (LoRA pairs) that
    # is the merged model, which HF transformers and economize (the original weights) do not run
    adapter = dict(exit_adapter=args.exit_adapter)
    full = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=max(1, len(texts)), **adapter)
    reshaped = full.exit_adapters is not None and full.exit_adapters.lora is not None
    prompts = [full.tokenizer.encode(t) for t in texts]
    print(f"{len(prompts)} code prompts ({source}), {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} new tokens, batch 1, greedy")
    if args.sweep_ngrams:
        rows = sweep_ngrams(args, prompts)
        path = save_results(args.out_name + "-ngram-sweep", dict(
            model="SmolLM2-135M-Instruct", cpu=cpu_model(), prompts=source, num_prompts=len(prompts),
            max_tokens=args.max_tokens, rows=rows))
        print(f"\nresults: {path}")
        return

    runners, stats = {}, {}
    lookup = eecore.LookupDrafts(min_ngram=lo, max_ngram=hi)
    if "hf" in args.configs or "economize" in args.configs:
        import transformers

        transformers.logging.disable_progress_bar()
        model = hf_model()
        if "hf" in args.configs:
            runners["hf"] = hf_runner(model, args.max_tokens)
        if "economize" in args.configs:
            runners["economize"] = economize_runner(hf_model(), args.max_tokens, lo, hi, d, args.economize_match)
    if "full" in args.configs:
        runners["full"] = eecore_runner(full, args.max_tokens, stats.setdefault("full", {}))
    if "lookup" in args.configs:
        llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=1, **adapter,
                         speculative=eecore.SelfSpeculativeConfig(num_speculations=d, lookup=lookup))
        runners["lookup"] = eecore_runner(llm, args.max_tokens, stats.setdefault("lookup", {}))
    if "hybrid" in args.configs:
        hybrid = (eecore.SelfSpeculativeConfig.exit_ready("hybrid") if args.exit_ready else
                  eecore.SelfSpeculativeConfig(num_speculations=d, lookup=lookup, layer=eecore.LayerDrafts(
                      exit_layer=args.exit_layer, max_length=args.layer_speculations)))
        llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=1, **adapter, speculative=hybrid)
        runners["hybrid"] = eecore_runner(llm, args.max_tokens, stats.setdefault("hybrid", {}))

    names = list(runners)
    for name in names:  # warm-up
        runners[name](prompts[:1])
    times = {name: [] for name in names}
    outputs = {}
    for r in range(args.repeats):
        for name in rotated(names, r):  # who goes first turns from repeat to repeat
            for s in stats.get(name, {}).values():
                s.clear()
            outputs[name], t = timed(runners[name], prompts)
            times[name].append(t)
            print(f"  repeat {r}: {name:10s} {t:7.2f} s", flush=True)
    # greedy tokens of HF (or, without it or for a reshaped model, of eecore at full depth): every
    # configuration of the same weights must match
    reference = outputs.get("full") if reshaped else outputs.get("hf", outputs.get("full"))
    tokens = len(prompts) * args.max_tokens
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = []
    print(f"\n{'config':10s}{'tok/s':>8}{'vs HF':>7}{'vs economize':>13}{'vs full':>8}{'tok/step':>9}"
          f"{'accept':>7}{'same tokens':>12}")
    for name in names:
        row = dict(config=name, seconds=med[name], seconds_runs=times[name], tok_s=tokens / med[name],
                   identical_to_reference=None if reference is None or (reshaped and name in ("hf", "economize"))
                   else outputs[name] == reference)
        for other in ("hf", "economize", "full"):
            if other in med:
                row[f"speedup_vs_{other}"] = med[other] / med[name]
        for key, values in stats.get(name, {}).items():
            row[key] = statistics.mean(values) if values else None
        rows.append(row)

        def fmt(key, spec=".2f"):
            return "-" if row.get(key) is None else format(row[key], spec)
        print(f"{name:10s}{row['tok_s']:8.1f}{fmt('speedup_vs_hf'):>7}{fmt('speedup_vs_economize'):>13}"
              f"{fmt('speedup_vs_full'):>8}{fmt('mean_accepted_tokens_per_step'):>9}{fmt('acceptance_rate'):>7}"
              f"{fmt('identical_to_reference', ''):>12}")
    path = save_results(args.out_name, dict(
        model="SmolLM2-135M-Instruct", dtype="float32", batch=1, cpu=cpu_model(), prompts=source,
        reference="hf" if "hf" in outputs else "full" if "full" in outputs else None, prompt_texts=texts, num_prompts=len(prompts), max_tokens=args.max_tokens, repeats=args.repeats,
        num_speculations=d, layer_speculations=args.layer_speculations, min_ngram=lo, max_ngram=hi,
        economize_match=args.economize_match,
        economize_version=_version("economize"), exit_layer=args.exit_layer,
        hybrid_config=dataclasses.asdict(hybrid) if "hybrid" in args.configs else None,
        exit_adapter=args.exit_adapter, rows=rows))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
