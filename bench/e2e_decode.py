"""Full-depth decode throughput on SmolLM2-135M (fp32, CPU): eecore against HF transformers'
`generate` on the same weights, in the same run, at batch 1 and 8, 128 new tokens each; the two
alternate and medians are kept. Each row also gives the memory-bandwidth roofline (see roofline.py):
the tokens/s at which the weights could just stream from memory, and how close each engine gets.

    python bench/e2e_decode.py [--max-tokens 128] [--batch-sizes 1 8] [--repeats 3]
"""
from __future__ import annotations

import argparse

import torch

import eecore
from common import (PROMPTS, alternate_with_hf, chat_prompt_ids, hf_generate_greedy, hf_model_from_loaded,
                    save_results)
from roofline import decode_weight_bytes, read_bandwidth_gbs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs; medians are reported")
    args = ap.parse_args()

    from eecore.models.loader import load_model

    loaded = load_model(None, dtype=torch.float32)
    hf = hf_model_from_loaded(loaded)
    llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=max(args.batch_sizes))
    prompts = [chat_prompt_ids(llm.tokenizer, p) for p in PROMPTS]
    params = eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], eecore.SamplingParams(max_tokens=8))  # warm-up
    hf_generate_greedy(hf, prompts[:1], 8)

    # The bandwidth roofline: a step streams every weight once, whatever the batch size.
    bandwidth = read_bandwidth_gbs()
    step_bytes = decode_weight_bytes(llm.model)
    print(f"memory read bandwidth {bandwidth:.1f} GB/s, {step_bytes / 1e6:.0f} MB of weights per decode step")

    rows = []
    for batch in args.batch_sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        t_ee, t_hf, outs, hf_outs = alternate_with_hf(llm, hf, batch_prompts, params, args.max_tokens, args.repeats)
        tokens = batch * args.max_tokens
        same = sum(o.token_ids == h for o, h in zip(outs, hf_outs))
        ceiling = batch * bandwidth * 1e9 / step_bytes
        rows.append(dict(batch=batch, eecore_tok_s=tokens / t_ee, hf_tok_s=tokens / t_hf, speedup=t_hf / t_ee,
                         identical_outputs=f"{same}/{batch}", roofline_tok_s=ceiling,
                         eecore_fraction_of_roofline=tokens / t_ee / ceiling,
                         hf_fraction_of_roofline=tokens / t_hf / ceiling))
        print(f"batch {batch}: eecore {tokens / t_ee:7.1f} tok/s   HF {tokens / t_hf:7.1f} tok/s   "
              f"speed-up {t_hf / t_ee:4.2f}x   identical greedy outputs {same}/{batch}   "
              f"roofline {ceiling:.0f} tok/s (eecore {tokens / t_ee / ceiling:.0%}, HF {tokens / t_hf / ceiling:.0%})")
    path = save_results("cpu-e2e-decode", dict(model="SmolLM2-135M-Instruct Q4_1 (dequantized fp32)",
                                                max_tokens=args.max_tokens, repeats=args.repeats,
                                                read_bandwidth_gbs=bandwidth, weight_bytes_per_step=step_bytes,
                                                rows=rows))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
