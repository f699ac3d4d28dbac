"""Full-depth decode throughput on SmolLM2-135M (fp32, CPU): eecore against HF transformers'
`generate` on the same weights, in the same run, at batch 1 and 8, 128 new tokens each.

    python bench/e2e_decode.py [--max-tokens 128] [--batch-sizes 1 8]
"""
from __future__ import annotations

import argparse

import torch

import eecore
from common import PROMPTS, chat_prompt_ids, hf_generate_greedy, hf_model_from_loaded, save_results, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()

    from eecore.models.loader import load_model

    loaded = load_model(None, dtype=torch.float32)
    hf = hf_model_from_loaded(loaded)
    llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=max(args.batch_sizes))
    prompts = [chat_prompt_ids(llm.tokenizer, p) for p in PROMPTS]
    params = eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], eecore.SamplingParams(max_tokens=8))  # warm-up
    hf_generate_greedy(hf, prompts[:1], 8)

    rows = []
    for batch in args.batch_sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        outs, t_ee = timed(llm.generate, batch_prompts, params)
        hf_outs, t_hf = timed(hf_generate_greedy, hf, batch_prompts, args.max_tokens)
        tokens = batch * args.max_tokens
        same = sum(o.token_ids == h for o, h in zip(outs, hf_outs))
        rows.append(dict(batch=batch, eecore_tok_s=tokens / t_ee, hf_tok_s=tokens / t_hf, speedup=t_hf / t_ee,
                         identical_outputs=f"{same}/{batch}"))
        print(f"batch {batch}: eecore {tokens / t_ee:7.1f} tok/s   HF {tokens / t_hf:7.1f} tok/s   "
              f"speed-up {t_hf / t_ee:4.2f}x   identical greedy outputs {same}/{batch}")
    path = save_results("cpu-e2e-decode", dict(model="SmolLM2-135M-Instruct Q4_1 (dequantized fp32)",
                                                max_tokens=args.max_tokens, rows=rows))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
