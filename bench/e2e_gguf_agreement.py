"""Greedy agreement of GGUF arithmetic with the dequantized fp32 model: eecore's exact and 8-bit
activation modes against llama.cpp (llama-cpp-python) on the same file and prompt token ids. It
decides the CPU default of EECORE_GGUF_ACTIVATIONS (docs/gguf.md, "Which activations by default"):
q8 becomes the default only if it agrees with fp32 at least as well as llama.cpp does (the last line
printed applies that rule to the run's prompts; the decision, over two sets, is in the docs).

The file: the embedded SmolLM2-135M-Instruct Q4_1 (or `--model`). The reference: eecore on the same
file dequantized to fp32 (`LLM(path, quantization="none", dtype="float32")`). The engines: eecore
`gguf_activations="exact"` (fp32 activations against the file's blocks), eecore
`gguf_activations="q8"` (8-bit activations, llama.cpp's arithmetic), and llama.cpp with `--threads`
threads. Every run is batch 1, greedy, `--max-tokens` new tokens with EOS ignored, on the same
prompt token ids (`--code` held-out code starts, raw text, and `--everyday` held-out everyday
requests in the chat template: bench/common.py's bench_prompt_ids); llama.cpp is fed the ids, not
text. Its sampler is temperature 0 (greedy), top_k 1, repeat / frequency / presence penalties off
(1.0 / 0 / 0); each token is also checked to be the argmax of the logits llama.cpp returned.

Per prompt and engine: the common prefix with the fp32 continuation (tokens before the first
difference), whether all tokens are identical, and at the first difference the fp32 reference's
logit gap between its token and the engine's (from its top-`--top-logprobs` log-probabilities; a
gap below 0.1 is a near tie, a larger one a real error; past the top-k it is a lower bound).
Also the same measures between eecore q8 and llama.cpp.

    python bench/e2e_gguf_agreement.py [--code 16] [--everyday 16] [--max-tokens 64] [--threads 2]
    python bench/e2e_gguf_agreement.py --code 32 --everyday 32 --out-name gguf-agreement-64
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics

import numpy as np
import torch

import eecore
from common import bench_prompt_ids, cpu_model, file_sha256, save_results
from eecore.models.loader import default_model_path


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def eecore_tokens(llm, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None):
    """Each prompt alone (batch 1), greedy, EOS ignored: the token ids (and per-token log-probs)."""
    params = eecore.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    outs = [llm.generate([p], params)[0] for p in prompts]
    return [list(o.token_ids) for o in outs], [o.logprobs for o in outs]


def llama_cpp_tokens(path: str, prompts: list[list[int]], max_tokens: int, threads: int):
    """llama.cpp greedy on the prompt ids; also counts tokens that were not the argmax of its logits."""
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    n_vocab = llm.n_vocab()
    out, not_argmax = [], 0
    for prompt in prompts:
        llm.reset()  # no prompt-cache reuse between prompts: each is evaluated from scratch
        tokens = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                                  repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, reset=True):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            not_argmax += int(logits[token] < logits.max())
            tokens.append(int(token))
            if len(tokens) == max_tokens:
                break
        out.append(tokens)
    return out, not_argmax, llama_cpp.__version__


def compare(tokens: list[list[int]], reference: list[list[int]], ref_logprobs=None) -> dict:
    rows = []
    for i, (a, b) in enumerate(zip(tokens, reference)):
        j = common_prefix(a, b)
        row = dict(prompt=i, common_prefix=j, identical=a == b)
        if ref_logprobs is not None and j < min(len(a), len(b)):
            lp = ref_logprobs[i][j]
            if a[j] in lp:
                row["fp32_logit_gap"] = lp[b[j]] - lp[a[j]]
            else:  # past the top-k: at least the gap to the k-th
                row["fp32_logit_gap_at_least"] = lp[b[j]] - min(lp.values())
        rows.append(row)
    gaps = [r["fp32_logit_gap"] for r in rows if "fp32_logit_gap" in r]
    return dict(mean_common_prefix=statistics.mean(r["common_prefix"] for r in rows),
                median_common_prefix=statistics.median(r["common_prefix"] for r in rows),
                identical=sum(r["identical"] for r in rows), prompts=len(rows),
                divergences=sum(not r["identical"] for r in rows),
                near_ties_below_0_1=sum(g < 0.1 for g in gaps),
                median_first_divergence_gap=statistics.median(gaps) if gaps else None,
                gaps_past_top_k=sum("fp32_logit_gap_at_least" in r for r in rows),
                per_prompt=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--code", type=int, default=16)
    ap.add_argument("--everyday", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top-logprobs", type=int, default=20)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--out-name", default="gguf-agreement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    with_llama = not args.no_llama_cpp and importlib.util.find_spec("llama_cpp") is not None

    reference = eecore.LLM(path, device="cpu", max_num_seqs=1, quantization="none", dtype="float32")
    tokenizer = reference.tokenizer
    prompts = bench_prompt_ids(tokenizer, "code", args.code) + bench_prompt_ids(tokenizer, "everyday", args.everyday)
    kinds = ["code"] * args.code + ["everyday"] * args.everyday
    ref_tokens, ref_logprobs = eecore_tokens(reference, prompts, args.max_tokens, logprobs=args.top_logprobs)
    plain, _ = eecore_tokens(reference, prompts, args.max_tokens)
    assert plain == ref_tokens, "asking for log-probs changed the fp32 reference's greedy tokens"
    del reference, plain

    engines, weight_format = {}, {}
    for mode in ("exact", "q8"):
        llm = eecore.LLM(path, device="cpu", max_num_seqs=1, gguf_activations=mode)
        engines[f"eecore {mode}"], _ = eecore_tokens(llm, prompts, args.max_tokens)
        weight_format[f"eecore {mode}"] = llm.weight_format
        del llm
    llama_info = "not installed or --no-llama-cpp"
    if with_llama:
        engines["llama.cpp"], not_argmax, version = llama_cpp_tokens(path, prompts, args.max_tokens, args.threads)
        llama_info = dict(version=version, threads=args.threads, tokens_not_argmax_of_its_logits=not_argmax,
                          sampler="temp 0 (greedy), top_k 1, repeat_penalty 1.0, frequency/presence 0")

    results = {name: compare(toks, ref_tokens, ref_logprobs) for name, toks in engines.items()}
    for name, r in results.items():
        for kind in ("code", "everyday"):
            sel = [row for row, k in zip(r["per_prompt"], kinds) if k == kind]
            if sel:
                r[f"{kind}_mean_common_prefix"] = statistics.mean(x["common_prefix"] for x in sel)
                r[f"{kind}_identical"] = sum(x["identical"] for x in sel)
    pairwise = compare(engines["eecore q8"], engines["llama.cpp"]) if with_llama else None

    print(f"CPU: {cpu_model()}; {path} ({weight_format['eecore exact']}); {len(prompts)} prompts "
          f"({args.code} code + {args.everyday} everyday), {args.max_tokens} greedy tokens each, EOS ignored")
    print(f"{'engine':<14} {'mean prefix':>11} {'identical':>10} {'near ties':>10} {'median gap':>11}")
    for name, r in results.items():
        gap = r["median_first_divergence_gap"]
        print(f"{name:<14} {r['mean_common_prefix']:11.2f} {r['identical']:>5}/{r['prompts']:<4} "
              f"{r['near_ties_below_0_1']:>4}/{r['divergences']:<5} {'' if gap is None else f'{gap:11.3f}'}")
    if pairwise:
        print(f"eecore q8 vs llama.cpp: mean prefix {pairwise['mean_common_prefix']:.2f}, "
              f"identical {pairwise['identical']}/{pairwise['prompts']}")
    if with_llama:
        print(f"llama.cpp {llama_info['version']}: {llama_info['tokens_not_argmax_of_its_logits']} tokens "
              "not its logits' argmax")
    q8, lc = results["eecore q8"], results.get("llama.cpp")
    decision = None
    if lc:
        q8_wins = q8["mean_common_prefix"] >= lc["mean_common_prefix"] and q8["identical"] >= lc["identical"]
        decision = ("on these prompts q8 passes the rule: its agreement with fp32 is at least llama.cpp's" if q8_wins
                    else "on these prompts q8 fails the rule: it agrees with fp32 less than llama.cpp does")
        print(decision)
    payload = dict(model=path, model_sha256=file_sha256(path), weight_format=weight_format,
                   prompts=dict(code=args.code, everyday=args.everyday, ids=prompts), kinds=kinds,
                   max_tokens=args.max_tokens, ignore_eos=True, batch=1, top_logprobs=args.top_logprobs,
                   reference="eecore LLM(path, quantization='none', dtype='float32')",
                   reference_tokens=ref_tokens, tokens=engines, agreement_with_fp32=results,
                   q8_vs_llama_cpp=pairwise, llama_cpp=llama_info,
                   rule="q8 becomes the default if its mean common prefix and its count of identical "
                        "continuations with fp32 are both at least llama.cpp's", decision=decision)
    print(f"results: {save_results(args.out_name, payload)}")


if __name__ == "__main__":
    main()
