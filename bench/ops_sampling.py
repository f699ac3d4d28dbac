"""What drawing the tokens costs: `Sampler.sample` per step, by batch size and sampling parameters.

    PYTHONPATH=python python bench/ops_sampling.py [--vocab 49152] [--batch-sizes 1 8 64]
        [--baseline OTHER_SAMPLER.py] [--repeats 20] [--out-name NAME]
    PYTHONPATH=python python bench/ops_sampling.py --model [PATH] [--baseline OTHER_SAMPLER.py]

Every row of a step samples with the same parameters: greedy (the reference point), temperature 1,
temperature 0.8 with top-p 0.95, and with top-k 50. The logits are shaped like a language model's
(probabilities falling as a power of the rank, ~1.2, in a random order of the vocabulary), and once
flat (standard normal logits: top-p then needs most of the vocabulary, the worst case).

`--model` times whole generations instead: the model (default: the embedded SmolLM2 file) answers
the 8 bench chat prompts, 64 tokens each (EOS ignored, so every configuration does the same work),
one request at a time and all 8 together, greedy and sampled; tokens per second.

`--baseline` loads another sampler module (for instance the previous version:
`git show REV:python/eecore/engine/sampler.py > /tmp/old_sampler.py`) and times it alternately with
this one, in the same process, on the same logits. Writes bench/results/<machine>/<name>-<date>.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

import eecore
from common import call_seconds, cpu_model, save_results
from eecore.engine import sampler as current

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "top-k 50": dict(temperature=0.8, top_k=50),
}


class _Seq:
    """What the sampler reads of a sequence."""

    def __init__(self, seq_id: int, params: eecore.SamplingParams):
        self.seq_id, self.params = seq_id, params


def lm_like_logits(batch: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = [(-1.2 * rank.log())[torch.randperm(vocab, generator=generator)] for _ in range(batch)]
    return torch.stack(rows)


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_sample(module, logits: torch.Tensor, params: eecore.SamplingParams, repeats: int) -> float:
    sampler = module.Sampler(torch.device("cpu"))
    seqs = [_Seq(i, params) for i in range(logits.shape[0])]
    return statistics.median(call_seconds(lambda: sampler.sample(logits, seqs), repeats)) * 1e6


def time_generation(llm, baseline, args) -> list[dict]:
    from common import PROMPTS

    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:8]]
    engine = llm.engine
    samplers = {"current": current.Sampler(engine.sampler.device)}
    if baseline is not None:
        samplers["baseline"] = baseline.Sampler(engine.sampler.device)
    rows = []
    for name, kw in CONFIGS.items():
        params = eecore.SamplingParams(max_tokens=64, ignore_eos=True, seed=0, **kw)
        for batch in (1, 8):
            row = {"config": name, "batch": batch}
            for _ in range(args.repeats):  # the samplers alternate
                for which, sampler in samplers.items():
                    engine.sampler = engine.strategy.sampler = sampler
                    start = time.perf_counter()
                    tokens = 0
                    for i in range(0, len(conversations), batch):
                        outs = llm.chat(conversations[i: i + batch], params)
                        tokens += sum(len(o.outputs[0].token_ids) if hasattr(o, "outputs") else len(o.token_ids)
                                      for o in outs)
                    row.setdefault(which, []).append(tokens / (time.perf_counter() - start))
            for which in samplers:
                row[which] = statistics.median(row[which])
            rows.append(row)
            extra = "" if baseline is None else \
                f"  baseline {row['baseline']:7.1f} tok/s  {row['current'] / row['baseline']:5.2f}x"
            print(f"B={batch:<2d} {name:14s} {row['current']:7.1f} tok/s{extra}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--baseline", help="another sampler module to time alongside")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out-name", default="sampling")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", nargs="?", const="", help="time generations of this model (default: the embedded one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    baseline = load_module(args.baseline) if args.baseline else None
    if args.model is not None:
        from eecore.models.loader import default_model_path

        llm = eecore.LLM(args.model or default_model_path())
        rows = time_generation(llm, baseline, args)
        save_results(args.out_name, {"machine": cpu_model(), "threads": args.threads, "model": args.model or
                                     "default", "baseline": args.baseline, "generation": rows})
        return
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in ("lm-like", "flat"):
        for batch in args.batch_sizes:
            logits = (lm_like_logits(batch, args.vocab, g) if shape == "lm-like"
                      else torch.randn(batch, args.vocab, generator=g))
            for name, kw in CONFIGS.items():
                if shape == "flat" and name == "greedy":
                    continue
                params = eecore.SamplingParams(**kw)
                # fewer repeats where a step takes long (the baseline's sort at batch 64)
                repeats = max(3, args.repeats // max(1, batch // 8))
                row = {"logits": shape, "batch": batch, "config": name, "us": None, "baseline_us": None}
                row["us"] = time_sample(current, logits, params, repeats)
                if baseline is not None:
                    row["baseline_us"] = time_sample(baseline, logits, params, repeats)
                    row["us"] = min(row["us"], time_sample(current, logits, params, repeats))
                rows.append(row)
                extra = "" if baseline is None else \
                    f"  baseline {row['baseline_us']:10.0f} us  {row['baseline_us'] / row['us']:6.1f}x"
                print(f"{shape:8s} B={batch:<3d} {name:14s} {row['us']:10.0f} us{extra}", flush=True)
    save_results(args.out_name, {"machine": cpu_model(), "threads": args.threads, "vocab": args.vocab,
                                 "baseline": args.baseline, "rows": rows})


if __name__ == "__main__":
    main()
