"""The embedded SmolLM2-135M decoding with GGUF block weights, against its fp32 (eecore's default)
and bf16 forms, in one process, alternated.

The quantized model keeps the layers' projections in Q4_1 and the LM head in Q8_0 (the shipped
file's types), requantized from the dequantized weights with the `gguf` package, activations fp32.
Greedy, batch 1, prompt + `--max-tokens`; decode tok/s from the time per output token, medians of
`--repeats` alternated runs; the outputs are compared with fp32's.

    python bench/gguf_decode.py [--max-tokens 64] [--repeats 4]
"""
from __future__ import annotations

import argparse
import statistics

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

import eecore
from eecore.models.gguf_weights import GGUFWeight
from common import cpu_model, save_results

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash map is in two sentences."]


def to_gguf(weight: torch.Tensor, qtype: GGMLQuantizationType) -> GGUFWeight:
    return GGUFWeight(torch.from_numpy(quantize(weight.float().numpy(), qtype)), int(qtype), weight.shape[1])


def build(kind: str) -> eecore.LLM:
    llm = eecore.LLM(dtype="bfloat16" if kind == "bf16" else "float32", device="cpu", max_num_seqs=4)
    if kind == "gguf":
        for layer in llm.model.layers:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                object.__setattr__(layer, name, to_gguf(getattr(layer, name), GGMLQuantizationType.Q4_1))
        llm.model.lm_head_proj = to_gguf(llm.model.lm_head, GGMLQuantizationType.Q8_0)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llms = {kind: build(kind) for kind in ("fp32", "bf16", "gguf")}
    runs = {kind: [] for kind in llms}
    texts = {}
    for _ in range(args.repeats):
        for kind, llm in llms.items():
            for prompt in PROMPTS:
                out = llm.generate([prompt], params)[0]
                runs[kind].append(1.0 / out.metrics["time_per_output_token_s"])
                texts.setdefault(kind, []).append(out.token_ids)
    print(f"CPU: {cpu_model()}, {args.threads} threads; batch 1, {args.max_tokens} tokens")
    rows = []
    for kind in llms:
        tok_s = statistics.median(runs[kind])
        same = texts[kind] == texts["fp32"]
        print(f"{kind:>5}: {tok_s:6.1f} tok/s decode ({tok_s / statistics.median(runs['fp32']):.2f}x fp32, "
              f"{tok_s / statistics.median(runs['bf16']):.2f}x bf16); greedy tokens as fp32's: {same}")
        rows.append(dict(weights=kind, decode_tok_s=tok_s, runs=runs[kind], same_tokens_as_fp32=same))
    print(f"results: {save_results('gguf-decode', dict(max_tokens=args.max_tokens, threads=args.threads, rows=rows))}")


if __name__ == "__main__":
    main()
