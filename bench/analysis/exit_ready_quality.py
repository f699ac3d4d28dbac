"""Does an exit-ready file keep full-depth quality? Its merged model against the original SmolLM2,
on text training never saw (no timing: every figure here is exact arithmetic on fixed inputs).

- perplexity: teacher-forced next-token cross-entropy on `--windows` windows of `--seq-len` tokens,
  evenly spaced over the held-out corpus (the Python source of jinja2, tqdm and gguf); the goal is
  the exit-ready model within 5% of the original;
- ROUGE-L: the greedy continuations (`--max-tokens`) of `--prompts` held-out code prompts, the
  exit-ready model's against the original's (goal >= 0.6), and the share of identical tokens;
- top-1 agreement of the two models' last layers on the held-out windows.

A file without LoRA pairs leaves the base untouched, so every figure is exact (perplexity ratio 1).

    python bench/analysis/exit_ready_quality.py --exit-adapter FILE [--windows 16] [--seq-len 256]
        [--prompts 16] [--max-tokens 64] [--out-name NAME]
writes bench/results/<machine>/<out-name>-<date>.json (default exit-ready-quality) and prints the figures.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

import eecore
from eecore.evaluation.prompts import heldout_code_prompts
from eecore.text.rouge import rouge_l
from eecore.train.exit_adapter import TeacherPass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import file_sha256, save_results, text_windows  # noqa: E402


def last_layer_logits(llm, windows: list[list[int]]) -> torch.Tensor:
    """fp32 logits `[num windows, seq_len, V]` of the last layer, one window at a time."""
    teacher = TeacherPass(llm, (), llm.model.lm_head)
    return torch.stack([teacher(torch.tensor([w]))[1] for w in windows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exit-adapter", required=True, metavar="FILE")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-name", default="exit-ready-quality")
    args = ap.parse_args()

    kw = dict(dtype="float32", device="cpu", max_num_seqs=args.prompts, max_model_len=max(args.seq_len + 1, 512),
              max_num_batched_tokens=max(args.seq_len, 2048))
    models = {"original": eecore.LLM(**kw), "exit_ready": eecore.LLM(exit_adapter=args.exit_adapter, **kw)}
    windows, text_info = text_windows(models["original"].tokenizer, args.windows, args.seq_len)
    targets = torch.tensor([w[1:] for w in windows]).reshape(-1)
    logits, ce = {}, {}
    for name, llm in models.items():
        logits[name] = last_layer_logits(llm, windows)[:, :-1].reshape(-1, llm.config.vocab_size)
        ce[name] = F.cross_entropy(logits[name], targets).item()
    agreement = (logits["original"].argmax(-1) == logits["exit_ready"].argmax(-1)).float().mean().item()

    prompts = heldout_code_prompts(args.prompts)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    outs = {name: llm.generate(prompts, params) for name, llm in models.items()}
    rouge = [rouge_l(e.text, o.text) for e, o in zip(outs["exit_ready"], outs["original"])]
    same = [sum(a == b for a, b in zip(e.token_ids, o.token_ids)) / max(1, len(o.token_ids))
            for e, o in zip(outs["exit_ready"], outs["original"])]

    adapters = models["exit_ready"].exit_adapters
    payload = dict(
        exit_adapter=dict(path=os.path.abspath(args.exit_adapter), sha256=file_sha256(args.exit_adapter),
                          info=adapters.info, lora_rank=None if adapters.lora is None else adapters.lora.rank),
        text=text_info, windows=args.windows, seq_len=args.seq_len, prompts=prompts, max_tokens=args.max_tokens,
        perplexity={name: math.exp(v) for name, v in ce.items()},
        perplexity_ratio=math.exp(ce["exit_ready"] - ce["original"]),
        last_layer_agreement=agreement,
        rouge_l_to_original=dict(mean=sum(rouge) / len(rouge), per_prompt=rouge),
        same_token_share=dict(mean=sum(same) / len(same), per_prompt=same),
        texts={name: [o.text for o in o_list] for name, o_list in outs.items()})
    path = save_results(args.out_name, payload)
    print(f"perplexity: original {payload['perplexity']['original']:.3f}, exit-ready "
          f"{payload['perplexity']['exit_ready']:.3f} (ratio {payload['perplexity_ratio']:.4f}, goal <= 1.05)")
    print(f"last-layer top-1 agreement with the original: {agreement:.4f}")
    print(f"greedy outputs: ROUGE-L to the original {payload['rouge_l_to_original']['mean']:.3f} (goal >= 0.6), "
          f"same tokens {payload['same_token_share']['mean']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
