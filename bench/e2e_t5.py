"""T5 v1.1-small and -base shapes with random weights (fp32, CPU): eecore against HF transformers'
`generate` on the same weights, in the same run, at batch 1 and 8; full depth and a static exit at
half the decoder's depth. The two engines alternate and medians are kept.

HF has no early exit for T5, so a static-exit row is compared twice: with HF at full depth (what a
user of HF would run) and with HF on a copy whose decoder keeps only the first E layers (the same
layer work as the exit, minus eecore's K/V fill of the skipped layers, so the fairest HF figure).

    python bench/e2e_t5.py [--models small base] [--batch-sizes 1 8] [--max-tokens 64]
                             [--prompt-len 48] [--repeats 3] [--out-name NAME]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile

import torch

import eecore
from common import save_results, timed

# The released google/t5-v1_1-{small,base} configurations (gated-GELU, untied head, 32128 vocab).
SHAPES = {
    "small": dict(d_model=512, d_kv=64, d_ff=1024, num_heads=6, num_layers=8, num_decoder_layers=8),
    "base": dict(d_model=768, d_kv=64, d_ff=2048, num_heads=12, num_layers=12, num_decoder_layers=12),
}


def random_t5(shape: str, seed: int = 0):
    import transformers

    config = transformers.T5Config(vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
                                   **SHAPES[shape])
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # v1.1's head of its own (transformers 5 would tie it to the embedding)
        model.lm_head.weight = torch.nn.Parameter(torch.randn(config.vocab_size, config.d_model) * 0.05)
    return model


def truncated_decoder(model, layers: int):
    """A copy of `model` whose decoder keeps only its first `layers` blocks."""
    short = copy.deepcopy(model)
    short.decoder.block = short.decoder.block[:layers]
    short.config.num_decoder_layers = layers
    short.decoder.config.num_layers = layers
    return short


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF greedy generation of exactly max_new_tokens per prompt (encoder inputs right-padded)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = model.config.vocab_size + 1000  # never stop early
    config.do_sample, config.max_new_tokens, config.min_new_tokens = False, max_new_tokens, None
    config.temperature = config.top_p = config.top_k = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    return [row[1:].tolist() for row in out]


def alternate(runs: dict, repeats: int) -> dict:
    """Run each named callable in turn, `repeats` rounds, so load bursts hit all alike; medians."""
    times = {name: [] for name in runs}
    outputs = {}
    for _ in range(repeats):
        for name, fn in runs.items():
            outputs[name], t = timed(fn)
            times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def main():
    from eecore.train.calm import save_t5

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-name", default="cpu-t5-vs-hf", help="results file name (the date is appended)")
    args = ap.parse_args()

    rows = []
    load_before = os.getloadavg()  # the machine is shared: say how loaded it was
    for shape in args.models:
        hf = random_t5(shape)
        L = hf.config.num_decoder_layers
        E = L // 2
        hf_short = truncated_decoder(hf, E)
        with tempfile.TemporaryDirectory() as folder:
            save_t5(hf, folder)
            engines = {
                "full": eecore.LLM(folder, dtype="float32", device="cpu", max_num_seqs=max(args.batch_sizes)),
                "static": eecore.LLM(folder, dtype="float32", device="cpu", max_num_seqs=max(args.batch_sizes),
                                     early_exit=eecore.EarlyExitConfig(measure="static", exit_layer=E)),
            }
        g = torch.Generator().manual_seed(1)
        params = eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for engine in engines.values():  # warm-up
            engine.generate([[5, 6, 7, 1]], eecore.SamplingParams(max_tokens=4))
        hf_generate(hf, [[5, 6, 7, 1]], 4)
        for batch in args.batch_sizes:
            # lengths around --prompt-len so the batch is ragged, as real requests are
            prompts = [torch.randint(2, 32000, (args.prompt_len - 8 + 4 * (i % 5),), generator=g).tolist() + [1]
                       for i in range(batch)]
            tokens = batch * args.max_tokens
            medians, outs = alternate({
                "eecore_full": lambda: engines["full"].generate(prompts, params),
                "hf_full": lambda: hf_generate(hf, prompts, args.max_tokens),
                "eecore_static": lambda: engines["static"].generate(prompts, params),
                "hf_truncated": lambda: hf_generate(hf_short, prompts, args.max_tokens),
            }, args.repeats)
            same = sum(o.token_ids == h for o, h in zip(outs["eecore_full"], outs["hf_full"]))
            row = dict(model=f"t5-v1.1-{shape} shape", batch=batch, decoder_layers=L, exit_layer=E,
                       identical_full_depth_outputs=f"{same}/{batch}",
                       **{f"{k}_tok_s": tokens / v for k, v in medians.items()},
                       speedup_full=medians["hf_full"] / medians["eecore_full"],
                       speedup_static_vs_hf_full=medians["hf_full"] / medians["eecore_static"],
                       speedup_static_vs_hf_truncated=medians["hf_truncated"] / medians["eecore_static"])
            rows.append(row)
            print(f"{shape} batch {batch}: full eecore {row['eecore_full_tok_s']:.1f} / HF {row['hf_full_tok_s']:.1f} "
                  f"tok/s = {row['speedup_full']:.2f}x (identical {same}/{batch}); static E={E} eecore "
                  f"{row['eecore_static_tok_s']:.1f} tok/s = {row['speedup_static_vs_hf_full']:.2f}x HF full, "
                  f"{row['speedup_static_vs_hf_truncated']:.2f}x HF with {E} decoder layers "
                  f"({row['hf_truncated_tok_s']:.1f} tok/s)", flush=True)
    path = save_results(args.out_name, dict(
        weights="random (HF init; v1.1 head N(0, 0.05))", dtype="float32", max_tokens=args.max_tokens,
        prompt_len=args.prompt_len, repeats=args.repeats, rows=rows,
        load_average_1_5_15min=dict(start=[round(x, 2) for x in load_before],
                                    end=[round(x, 2) for x in os.getloadavg()])))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
