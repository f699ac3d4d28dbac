"""Train an exit-ready model from the command line: LayerSkip's recipe on LoRA pairs of the base,
with exit adapters, all distilled from the original model (the recipe, its defaults and why:
eecore.train.exit_ready_trainer).

    python -m eecore.sources.corpus --out corpus/
    python -m eecore.train.exit_ready --corpus corpus/ --checkpoint-dir ckpt/ --out exit-ready.safetensors \\
        --init-adapters shipped [--device cuda]

Resumable: run the same command again after a stop (`--stop-after-minutes`, or an interruption).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Optional

import numpy as np
import torch

from eecore.extras import require_or_exit
from eecore.models.exit_adapter import SHIPPED_FILE, ExitAdapters
from eecore.train.exit_adapter import frequent_tokens, tokenize_file, tokenizer_fingerprint
from eecore.train.exit_ready_trainer import ExitReadyConfig, ExitReadyTrainer, hf_twin, train
from eecore.train.loop import heldout_windows

__all__ = ["ExitReadyConfig", "ExitReadyTrainer", "hf_twin", "train", "corpus_tokens", "main"]


def corpus_tokens(tokenizer, corpus_dir: str, split: str, cache_dir: Optional[str]) -> np.ndarray:
    """The token stream of a corpus split: `<split>.txt` tokenized (and cached), or `<split>.npy`, a
    stream tokenized elsewhere (tools/gpu_train_exit_ready.sh carries one to a GPU machine, since the
    text and the model file do not fit its upload together), checked against this tokenizer."""
    text = os.path.join(corpus_dir, f"{split}.txt")
    if os.path.exists(text):
        return tokenize_file(tokenizer, text, cache_dir)
    stream = os.path.join(corpus_dir, f"{split}.npy")
    if not os.path.exists(stream):
        raise FileNotFoundError(f"{corpus_dir}: has neither {split}.txt nor {split}.npy")
    with open(os.path.join(corpus_dir, "manifest.json")) as f:
        made_with = json.load(f).get("tokenizer")
    if made_with != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"{stream}: tokenized by tokenizer {made_with!r}, this model's is {tokenizer_fingerprint(tokenizer)!r}")
    return np.load(stream).astype(np.int32)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eecore.train.exit_ready", description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="folder from `python -m eecore.sources.corpus`")
    ap.add_argument("--out", help="the exit-ready adapter file to write (.safetensors)")
    ap.add_argument("--checkpoint-dir", help="resumable checkpoints, the log and the token cache")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--init-adapters", default=None,
                    help="start the exit adapters, and the LoRA pairs if it has any, from this file ('shipped': "
                         "the default model's); its pairs may be of a lower rank than --lora-rank (grown)")
    ap.add_argument("--recount-draft-vocab", action="store_true",
                    help="with --init-adapters: count the draft vocabulary afresh on this corpus instead of keeping "
                         "the file's (for continued training on text of another kind, such as chat answers)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    d = ExitReadyConfig()
    ap.add_argument("--exit-layers", type=int, nargs="+", default=list(d.exit_layers))
    for f in dataclasses.fields(ExitReadyConfig):  # one flag per recipe setting
        if f.name == "exit_layers":
            continue
        kind = type(getattr(d, f.name))
        if kind is bool:
            ap.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                            default=getattr(d, f.name))
        else:
            ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=getattr(d, f.name))
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--save-dtype", choices=("float32", "bfloat16", "int8"), default="bfloat16",
                    help="int8: weight-only int8 projections (format 3), half a bf16 file")
    ap.add_argument("--stop-after-minutes", type=float, default=None,
                    help="stop (with a checkpoint) after this long; run again to resume")
    ap.add_argument("--export-on-stop", action="store_true",
                    help="when stopped early, write --out anyway from the weights reached (its info records "
                         "the steps): for a time-boxed run, such as one on a lent GPU")
    ap.add_argument("--eval-only", action="store_true",
                    help="print the held-out losses and agreements of --init-adapters (on batch-size x seq-len "
                         "held-out tokens, as training evaluates) and exit: no training, no file")
    return ap


def draft_vocab(config: ExitReadyConfig, args, init: Optional[ExitAdapters], model_config,
                train_tokens) -> Optional[torch.Tensor]:
    """The draft vocabulary to train for: the starting file's, or counted on the corpus
    (`train_tokens()` gives its train split)."""
    if not config.draft_vocab:
        return None
    if init is not None and init.vocab is not None and not args.recount_draft_vocab:
        # continued training keeps the draft vocabulary the starting file was trained (and its
        # head rows chosen) for, whatever this corpus's counts would pick, unless asked
        if init.vocab.numel() != config.draft_vocab:
            raise ValueError(f"--draft-vocab {config.draft_vocab}: {args.init_adapters} has a draft vocabulary "
                             f"of {init.vocab.numel()} tokens; pass --draft-vocab {init.vocab.numel()}, or "
                             f"--recount-draft-vocab to count a new one on this corpus")
        return init.vocab
    return frequent_tokens(train_tokens(), model_config.vocab_size, config.draft_vocab,
                           tuple(model_config.eos_token_ids))


def main(argv: Optional[list[str]] = None) -> int:
    require_or_exit(['transformers', 'peft'], "python -m eecore.train.exit_ready")
    import eecore

    ap = parser()
    args = ap.parse_args(argv)
    if args.eval_only and not args.init_adapters:
        ap.error("--eval-only evaluates the file given by --init-adapters")
    if not args.eval_only and not (args.out and args.checkpoint_dir):
        ap.error("training needs --out and --checkpoint-dir")
    config = ExitReadyConfig(exit_layers=tuple(args.exit_layers),
                             **{f.name: getattr(args, f.name) for f in dataclasses.fields(ExitReadyConfig)
                                if f.name != "exit_layers"})
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    # the model is read (and, on the CPU, teaches) on the CPU; the student trains on --device
    llm = eecore.LLM(args.model, dtype="float32", device="cpu", quantization="none", max_num_seqs=config.batch_size,
                     max_num_batched_tokens=config.batch_size * config.seq_len, max_model_len=config.seq_len + 1)
    # --eval-only reads the train split only if it must count a draft vocabulary
    tokens = None if args.eval_only else corpus_tokens(llm.tokenizer, args.corpus, "train", args.checkpoint_dir)
    heldout = corpus_tokens(llm.tokenizer, args.corpus, "heldout", args.checkpoint_dir)
    init = None
    if args.init_adapters:
        init = ExitAdapters.load(SHIPPED_FILE if args.init_adapters == "shipped" else args.init_adapters)
        init.check_model(llm.model)
    vocab = draft_vocab(config, args, init, llm.config, lambda: tokens if tokens is not None else
                        corpus_tokens(llm.tokenizer, args.corpus, "train", args.checkpoint_dir))
    if args.eval_only:
        trainer = ExitReadyTrainer(llm, config, vocab, init, args.device)
        print(json.dumps(trainer.evaluate(heldout_windows(heldout, config))))
        return 0
    return run_training(args, llm, config, tokens, heldout, vocab, init)


def run_training(args, llm, config: ExitReadyConfig, tokens: np.ndarray, heldout: np.ndarray, vocab, init) -> int:
    """Train (or resume) to the end or the time limit, then write the file (exit status 3: stopped early)."""
    log_path = os.path.join(args.checkpoint_dir, "train_log.jsonl")
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    started = time.time()

    def log(record):
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    deadline = None if args.stop_after_minutes is None else started + 60 * args.stop_after_minutes
    trainer = train(llm, tokens, config, vocab=vocab, init_adapters=init, device=args.device,
                    checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, heldout=heldout,
                    eval_every=args.eval_every, log=log, progress=True, deadline=deadline)
    stopped_early = trainer.step < config.steps
    if stopped_early:
        print(f"stopped at step {trainer.step} of {config.steps}; run the same command again to resume")
        if not args.export_on_stop:
            return 3
    with open(os.path.join(args.corpus, "manifest.json")) as f:
        manifest = json.load(f)
    info = {"recipe": ("LoRA pairs of the layers below the exits + per-exit SwiGLU adapters for separate draft "
                       "layers, KL of each exit to the original model's last layer (over the draft vocabulary)")
            if config.draft_only else
            ("LayerSkip on LoRA pairs of every projection + per-exit SwiGLU adapters, "
             "KL to the original model's last layer (exits over the draft vocabulary)"),
            "config": dataclasses.asdict(config), "init_adapters": args.init_adapters,
            "trained_steps": trainer.step, "trained_tokens": trainer.step * config.batch_size * config.seq_len,
            "corpus": {k: manifest[k] for k in ("train", "heldout", "versions")},
            "final_heldout": trainer.evaluate(heldout_windows(heldout, config)),
            "device": args.device, "wall_seconds_this_run": round(time.time() - started, 1)}
    dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32
    trainer.exit_adapters(info, dtype).save(args.out, int8=args.save_dtype == "int8")
    print(json.dumps(info["final_heldout"]))
    return 3 if stopped_early else 0


if __name__ == "__main__":
    raise SystemExit(main())
