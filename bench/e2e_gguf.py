"""GGUF files decoded in their own blocks: eecore against llama.cpp (llama-cpp-python) on the same
file, and against eecore's dequantized fp32 and bf16 forms, in one process, alternated.

Files: the shipped SmolLM2-135M-Instruct Q4_1, and Q8_0 and Q4_K_M versions the bench writes from
its dequantized values (the same tokenizer and metadata; requantized, so the measure is speed on
identical weights, not the quality of a quantizer). SmolLM2's 576-wide rows are not whole 256-weight
blocks, so its Q4_K_M falls back as llama.cpp's quantize does: Q5_0 for Q4_K, Q8_0 for Q6_K; only
the down projections (1536 wide) are K blocks.

Batch 1, greedy, each chat prompt + `--max-tokens` (EOS ignored); decode tok/s from the time per
output token after the first, medians over prompts and `--repeats` alternated rounds. Each row also
gives the weight bytes a decode step reads, the GB/s that makes at the measured speed, and that
against this machine's read bandwidth measured in the same run (bench/roofline.py). eecore's greedy
tokens are compared with its own fp32 dequantized model's on the same file. "q8 activations" is
eecore with EECORE_GGUF_ACTIVATIONS=q8 (its Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrices with 8-bit
activations).

    python bench/e2e_gguf.py [--max-tokens 128] [--repeats 3] [--formats Q4_1 Q8_0 Q4_K_M] [--out-name NAME]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time

import numpy as np
import torch

import eecore
from common import PROMPTS, chat_prompt_ids, cpu_model, save_results
from eecore.models.loader import default_model_path
from roofline import decode_weight_bytes, read_bandwidth_gbs


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the Q4_K_M layers whose attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def target_type(name: str, cols: int, layers: int, recipe: str) -> str:
    if recipe == "Q8_0" or name == "token_embd.weight":
        return "Q8_0"
    kind = "Q4_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), layers):
        kind = "Q6_K"
    if cols % 256:
        kind = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind]  # llama.cpp's fallback for rows of partial blocks
    return kind


def write_variant(source: str, target: str, recipe: str) -> str:
    """`source` with every matrix requantized by `recipe` ("Q8_0" or "Q4_K_M"), metadata kept."""
    import gguf
    from gguf.quants import dequantize

    from eecore.models.gguf_quantize import quantize

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(target, arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # rows first
        if len(shape) == 2 and tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)
            kind = target_type(tensor.name, shape[1], layers, recipe)
            writer.add_tensor(tensor.name, quantize(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


class EecoreRunner:
    def __init__(self, path: str, q8_activations: bool = False, **kwargs):
        # EECORE_GGUF_ACTIVATIONS is read as the model is built
        os.environ["EECORE_GGUF_ACTIVATIONS"] = "q8" if q8_activations else "exact"
        self.llm = eecore.LLM(path, device="cpu", max_num_seqs=1, **kwargs)
        os.environ.pop("EECORE_GGUF_ACTIVATIONS")

    def decode(self, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
        params = eecore.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = self.llm.generate([prompt_ids], params)[0]
        return 1.0 / out.metrics["time_per_output_token_s"], out.token_ids

    def weight_bytes(self) -> float:
        return decode_weight_bytes(self.llm.model)


class LlamaCppRunner:
    def __init__(self, path: str, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
        self.file_bytes = os.path.getsize(path)

    def decode(self, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
        self.llm.reset()
        tokens, stamps = [], []
        for token in self.llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]), tokens

    def weight_bytes(self) -> float:
        return float(self.file_bytes)  # every tensor of the file is read once a step (tied head included)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=["Q4_1", "Q8_0", "Q4_K_M"], choices=["Q4_1", "Q8_0", "Q4_K_M"])
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--out-name", default="gguf-decode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with_llama = not args.no_llama_cpp and importlib.util.find_spec("llama_cpp") is not None
    shipped = default_model_path()
    folder = tempfile.mkdtemp(prefix="eecore-gguf-")
    files = {fmt: shipped if fmt == "Q4_1" else write_variant(shipped, os.path.join(folder, f"smollm2-{fmt}.gguf"), fmt)
             for fmt in args.formats}

    runners = {}
    for fmt, path in files.items():
        runners[(fmt, "eecore")] = EecoreRunner(path)
        runners[(fmt, "eecore q8 activations")] = EecoreRunner(path, q8_activations=True)
        runners[(fmt, "eecore fp32 (dequantized)")] = EecoreRunner(path, dtype="float32", quantization="none")
        if fmt == "Q4_1":
            runners[(fmt, "eecore bf16 (dequantized)")] = EecoreRunner(path, dtype="bfloat16", quantization="none")
        if with_llama:
            runners[(fmt, "llama.cpp")] = LlamaCppRunner(path, args.threads)
    tokenizer = runners[(args.formats[0], "eecore")].llm.tokenizer
    prompts = [chat_prompt_ids(tokenizer, p) for p in PROMPTS[:4]]

    speeds = {key: [] for key in runners}
    tokens = {key: [] for key in runners}
    for repeat in range(args.repeats):
        for key, runner in runners.items():
            for prompt in prompts:
                tok_s, ids = runner.decode(prompt, args.max_tokens)
                speeds[key].append(tok_s)
                if repeat == 0:
                    tokens[key].append(ids)
    bandwidth = read_bandwidth_gbs()

    print(f"CPU: {cpu_model()}, {args.threads} threads; batch 1, chat prompt + {args.max_tokens} tokens; "
          f"read bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for (fmt, engine), runner in runners.items():
        tok_s = statistics.median(speeds[(fmt, engine)])
        step_bytes = runner.weight_bytes()
        reference = tokens[(fmt, "eecore fp32 (dequantized)")]
        same = sum(a == b for a, b in zip(tokens[(fmt, engine)], reference))
        prefix = statistics.mean(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                                 for a, b in zip(tokens[(fmt, engine)], reference))
        row = dict(format=fmt, engine=engine, decode_tok_s=tok_s, runs=speeds[(fmt, engine)],
                   weight_bytes_per_step=step_bytes, gb_s=tok_s * step_bytes / 1e9,
                   roofline_fraction=tok_s * step_bytes / 1e9 / bandwidth,
                   prompts_with_fp32_greedy_tokens=f"{same}/{len(reference)}",
                   mean_tokens_before_first_difference=prefix)
        rows.append(row)
    for row in rows:
        base = {r["engine"]: r["decode_tok_s"] for r in rows if r["format"] == row["format"]}
        llama = base.get("llama.cpp")
        row["vs_llama_cpp"] = row["decode_tok_s"] / llama if llama else None
        print(f"{row['format']:>6} {row['engine']:<26} {row['decode_tok_s']:6.1f} tok/s"
              + (f"  {row['vs_llama_cpp']:.2f}x llama.cpp" if llama else "")
              + f"  {row['weight_bytes_per_step'] / 1e6:6.1f} MB/step  {row['gb_s']:5.1f} GB/s"
              f" ({100 * row['roofline_fraction']:.0f}% of read bandwidth)"
              f"  greedy = fp32's on {row['prompts_with_fp32_greedy_tokens']} prompts"
              f" ({row['mean_tokens_before_first_difference']:.0f} tokens before a difference)")
    payload = dict(max_tokens=args.max_tokens, repeats=args.repeats, read_bandwidth_gbs=bandwidth, rows=rows,
                   llama_cpp=None if with_llama else "not installed or --no-llama-cpp")
    print(f"results: {save_results(args.out_name, payload)}")


if __name__ == "__main__":
    main()
