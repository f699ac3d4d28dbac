"""Whether the draft copy's draft vocabulary limits its acceptance: the shipped draft layers with
the vocabulary they were trained over, with another file's (a feature head's, chosen on a corpus of
every kind of text) and with the whole vocabulary, the same weights otherwise.

    PYTHONPATH=python python bench/analysis/copy_vocabulary.py [--kinds chat everyday code] [--drafts 1]
        [--vocab-from HEAD.safetensors]

Each variant's file is the shipped one with its `draft_vocab` tensor replaced (or removed), written
to a temporary folder; the copy then drafts `--drafts` tokens every round (fixed lengths, no stop
rule, no planner) over dequantized weights, batch 1, 64 greedy tokens, 8 held-out prompts a kind
(bench/common.py). Prints each variant's acceptance by kind; writes nothing else.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
import eecore  # noqa: E402
from common import bench_prompt_ids, cpu_model  # noqa: E402
from eecore.models.exit_adapter import SHIPPED_DRAFT_FILE  # noqa: E402
from eecore.models.feature_head import SHIPPED_FILE as SHIPPED_HEAD  # noqa: E402


def with_vocabulary(source: str, vocab, out: str) -> str:
    """`source` (an exit adapter file) with draft vocabulary `vocab` (int ids, or None: the whole
    vocabulary), written to `out`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(source, framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    tensors.pop("draft_vocab", None)
    if vocab is not None:
        tensors["draft_vocab"] = vocab.to(torch.int32).contiguous()
    save_file(tensors, out, metadata=metadata)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["chat", "everyday", "code"])
    ap.add_argument("--drafts", type=int, default=1)
    ap.add_argument("--vocab-from", default=SHIPPED_HEAD, help="a file whose draft_vocab to try (default: the "
                    "shipped feature head's)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from safetensors import safe_open

    with safe_open(args.vocab_from, framework="pt") as f:
        other = f.get_tensor("draft_vocab")
    config = eecore.SelfSpeculativeConfig(num_speculations=args.drafts, layer=eecore.LayerDrafts(
        exit_layer=8, copy=eecore.DraftCopy(dtype="int8")))
    params = eecore.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    print(f"CPU: {cpu_model()}; dequantized, batch 1, d = {args.drafts}")
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"its own (shipped)": SHIPPED_DRAFT_FILE,
                    f"{os.path.basename(args.vocab_from)}'s {other.numel()}":
                        with_vocabulary(SHIPPED_DRAFT_FILE, other, os.path.join(tmp, "other.safetensors")),
                    "the whole vocabulary": with_vocabulary(SHIPPED_DRAFT_FILE, None,
                                                            os.path.join(tmp, "whole.safetensors"))}
        for label, path in variants.items():
            llm = eecore.LLM(quantization="none", exit_adapter=path, speculative=config)
            for kind in args.kinds:
                outs = llm.generate(bench_prompt_ids(llm.tokenizer, kind, 8), params)
                drafted = sum(o.metrics["num_drafted_tokens"] for o in outs)
                accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
                print(f"{label:40s} {kind:9s} acceptance {accepted / max(drafted, 1):.3f} "
                      f"({accepted} / {drafted})", flush=True)


if __name__ == "__main__":
    main()
