"""Train exit adapters (see eecore.models.exit_adapter) on a frozen model, by self-distillation.

The recipe: LayerSkip's early-exit loss, every chosen exit E read through the model's own final
norm and LM head, with the loss of each exit being the KL divergence from the model's own
last-layer distribution (distillation, as the exit-ready issue asks) instead of the data's next
token, since a draft is judged by agreeing with the last layer. The base stays frozen and only the
adapters train, so:

- full depth is the original model bit for bit (no quality to lose, no LoRA to merge);
- a training step never back-propagates through the base: the frozen base runs forward once per
  batch on eecore's own engine (the teacher pass, which also yields every exit's input state), and
  only the small adapter blocks and the draft-vocabulary head see autograd;
- layer dropout, which teaches the base's own layers to cope with missing layers, has nothing to
  act on and is not used. `eecore.train.layerskip` keeps the full recipe for training a whole model.

The draft vocabulary (the K most frequent tokens of the training text) is chosen first; the teacher
distribution is restricted to it, exactly as the draft head at inference sees it.

Resumable: every `checkpoint_every` steps the adapters, the optimizer and the loss history go to
`<checkpoint_dir>/last.pt`; a run started again with the same arguments continues from there and
ends with the same weights as an uninterrupted run (the batch of step t is drawn from a generator
seeded with (seed, t), so no data-loader state needs saving).

    python -m eecore.sources.corpus --out corpus/
    python -m eecore.train.exit_adapter --corpus corpus/ --checkpoint-dir ckpt/ --out adapters.safetensors
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import AdapterBlock, ExitAdapters, adapter_reference, model_fingerprint
from eecore.sampling_params import SamplingParams
from eecore.train.loop import check_student_model, heldout_windows, restore, run


@dataclass(frozen=True)
class AdapterTrainConfig:
    exit_layers: tuple[int, ...] = (6, 10, 14)
    adapter_hidden: int = 1536
    draft_vocab: int = 8192       # K; 0 keeps the full vocabulary
    seq_len: int = 256
    batch_size: int = 4           # windows per step
    steps: int = 2000
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    temperature: float = 1.0      # of the teacher's softmax (the student's logits are divided too)
    seed: int = 0

    def __post_init__(self):
        if not self.exit_layers or any(not isinstance(E, int) or E < 1 for E in self.exit_layers):
            raise ValueError(f"exit_layers must be a non-empty list of ints >= 1, got {self.exit_layers!r}")
        for name in ("adapter_hidden", "seq_len", "batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0, got {self.draft_vocab!r}")
        if not self.lr > 0 or not self.temperature > 0:
            raise ValueError("lr and temperature must be > 0")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm!r}")


# ---- data ------------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what decides a tokenizer's output: its full serialization where it has one
    (eecore's Tokenizer and HF fast tokenizers wrap a `tokenizers.Tokenizer`), else its class and
    the tokens of a probe text."""
    backend = getattr(tokenizer, "backend", None) or getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        spec = backend.to_str()
    else:
        probe = "def f(x):\n    return x * 2  # héllo, 12345 \u65e5\u672c\n\n\tclass A: pass\n"
        spec = type(tokenizer).__qualname__ + repr(list(tokenizer.encode(probe, add_special_tokens=False)))
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def tokenize_file(tokenizer, path: str, cache_dir: Optional[str] = None) -> np.ndarray:
    """The token stream (int32) of a UTF-8 text file, cached in `cache_dir` under the hashes of the
    text and of the tokenizer (the same corpus tokenized for another model is another stream)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    cache = None
    if cache_dir is not None:
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        cache = os.path.join(cache_dir, f"tokens-{digest}-{tokenizer_fingerprint(tokenizer)}.npy")
        if os.path.exists(cache):
            return np.load(cache)
    # in pieces: one encode call over tens of MB holds every offset in memory at once
    pieces, chunk = [], 1 << 20
    start = 0
    while start < len(text):
        end = text.find("\n", start + chunk)
        end = len(text) if end < 0 else end + 1
        pieces.append(np.asarray(tokenizer.encode(text[start:end], add_special_tokens=False), dtype=np.int32))
        start = end
    tokens = np.concatenate(pieces)
    if cache is not None:
        os.makedirs(cache_dir, exist_ok=True)
        np.save(cache, tokens)
    return tokens


def frequent_tokens(tokens: np.ndarray, vocab_size: int, k: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """k token ids, sorted: `always` (the EOS tokens, which a draft must be able to propose; ids
    outside the vocabulary are ignored), then the most frequent other ids of the stream (ties to the
    lower id) up to k in all. More than k only when `always` alone holds more."""
    counts = np.bincount(tokens, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))
    keep = [int(t) for t in always if 0 <= t < vocab_size]
    chosen = set(keep)
    for t in order:
        if len(chosen) >= max(k, len(keep)):
            break
        chosen.add(int(t))
    return torch.tensor(sorted(chosen), dtype=torch.long)


# ---- the teacher pass --------------------------------------------------------------------------


class TeacherPass:
    """Runs the frozen model over token windows with eecore's engine. Returns each exit's input
    states `{E: [N, d]}` (the residual stream after layer E-1) and the last layer's logits over
    the draft vocabulary `[N, K]`, N = every position of every window."""

    def __init__(self, llm, exit_layers: tuple[int, ...], head: torch.Tensor):
        self.llm = llm
        self.exit_layers = sorted(exit_layers)
        self.head = head

    @torch.no_grad()
    def __call__(self, windows: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        engine, model = self.llm.engine, self.llm.model
        ids = [w.tolist() for w in windows]
        seqs = [Sequence(i, SamplingParams(max_tokens=1)) for i in ids]
        for s, i in zip(seqs, ids):  # never scheduled: they only hold blocks for this pass
            engine.blocks.grow(s, len(i))
        try:
            inputs = engine.runner.prepare([Row(s, 0, i) for s, i in zip(seqs, ids)])
            hidden = engine.runner.embed(inputs)
            states, done = {}, 0
            for E in self.exit_layers:
                engine.runner.run_layers(hidden, inputs.attn, done, E)
                states[E] = hidden.float().clone()
                done = E
            engine.runner.run_layers(hidden, inputs.attn, done, model.num_layers)
            normed = model.final_norm_(hidden, torch.empty_like(hidden))
            logits = (normed @ self.head.t()).float()
        finally:
            for s in seqs:
                engine.blocks.free(s)
        return states, logits


# ---- the student -------------------------------------------------------------------------------


def init_block(hidden_size: int, adapter_hidden: int, generator: torch.Generator) -> AdapterBlock:
    """A block that starts as the identity (zero down projection): at step 0 the exit reads exactly
    what the model's own head reads off layer E."""
    return AdapterBlock(norm=torch.ones(hidden_size),
                        gate_up=torch.randn(2 * adapter_hidden, hidden_size, generator=generator) / hidden_size ** 0.5,
                        down=torch.zeros(hidden_size, adapter_hidden))


def exit_logits(block: AdapterBlock, states: torch.Tensor, final_norm: torch.Tensor, head: torch.Tensor,
                eps: float) -> torch.Tensor:
    adapted = adapter_reference(block, states, eps)
    return F.rms_norm(adapted, (adapted.shape[-1],), final_norm, eps) @ head.t()


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per token, averaged, at temperature T (scaled by T² as usual)."""
    t = temperature
    teacher = F.log_softmax(teacher_logits / t, dim=-1)
    student = F.log_softmax(student_logits / t, dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * t * t


class AdapterTrainer:
    """The adapters of every exit, their optimizer and schedule, and one training step."""

    def __init__(self, llm, config: AdapterTrainConfig, vocab: Optional[torch.Tensor]):
        model = llm.model
        check_student_model(model, config.exit_layers, "AdapterTrainer")
        self.llm, self.config, self.vocab = llm, config, vocab
        self.eps = model.eps
        self.final_norm = model.final_norm.float()
        self.head = model.lm_head if vocab is None else model.lm_head.index_select(0, vocab).contiguous()
        self.teacher = TeacherPass(llm, config.exit_layers, self.head)
        g = torch.Generator().manual_seed(config.seed)
        self.blocks = {E: init_block(model.config.hidden_size, config.adapter_hidden, g)
                       for E in sorted(config.exit_layers)}
        self.params = [t.requires_grad_() for b in self.blocks.values() for t in b.tensors()]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        self.step = 0
        self.history: list[dict] = []

    def lr_at(self, step: int) -> float:
        c = self.config
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        progress = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def losses(self, states: dict[int, torch.Tensor], teacher_logits: torch.Tensor):
        """Per exit: (distillation loss, top-1 agreement with the teacher within the draft vocabulary)."""
        out = {}
        target = teacher_logits.argmax(-1)
        for E, block in self.blocks.items():
            logits = exit_logits(block, states[E], self.final_norm, self.head, self.eps)
            loss = distillation_loss(logits, teacher_logits, self.config.temperature)
            out[E] = (loss, (logits.argmax(-1) == target).float().mean().item())
        return out

    def train_step(self, windows: torch.Tensor) -> dict:
        states, teacher_logits = self.teacher(windows)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        per_exit = self.losses(states, teacher_logits)
        total = sum(loss for loss, _ in per_exit.values())
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        record = {"step": self.step, "lr": self.optimizer.param_groups[0]["lr"],
                  **{f"loss_{E}": round(l.item(), 5) for E, (l, _) in per_exit.items()},
                  **{f"agree_{E}": round(a, 4) for E, (_, a) in per_exit.items()}}
        self.history.append(record)
        self.step += 1
        return record

    @torch.no_grad()
    def evaluate(self, windows: torch.Tensor) -> dict:
        states, teacher_logits = self.teacher(windows)
        return {E: {"loss": round(l.item(), 5), "agreement": round(a, 4)}
                for E, (l, a) in self.losses(states, teacher_logits).items()}

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "config": dataclasses.asdict(self.config), "history": self.history,
                "blocks": {E: [t.detach().clone() for t in b.tensors()] for E, b in self.blocks.items()},
                "optimizer": self.optimizer.state_dict(), "vocab": self.vocab,
                "model": model_fingerprint(self.llm.model)}

    def load_state_dict(self, state: dict) -> None:
        restore(self, state)

    def adapters(self, info: dict, dtype: torch.dtype = torch.float32) -> ExitAdapters:
        blocks = {E: AdapterBlock(*(t.detach().to(dtype) for t in b.tensors())) for E, b in self.blocks.items()}
        return ExitAdapters(blocks, self.vocab, model_fingerprint(self.llm.model), info)


def train(llm, tokens: np.ndarray, config: AdapterTrainConfig, *, vocab: Optional[torch.Tensor] = None,
          checkpoint_dir: Optional[str] = None, checkpoint_every: int = 50, heldout: Optional[np.ndarray] = None,
          eval_every: int = 0, log=None, progress: bool = False, stop_after: Optional[int] = None) -> AdapterTrainer:
    """Trains (or resumes) to `config.steps` (eecore.train.loop.run)."""
    return run(AdapterTrainer(llm, config, vocab), tokens, config, desc="exit adapters", checkpoint_dir=checkpoint_dir,
               checkpoint_every=checkpoint_every, heldout=heldout, eval_every=eval_every, log=log, progress=progress,
               stop_after=stop_after)


def main(argv: Optional[list[str]] = None) -> int:
    import eecore

    ap = argparse.ArgumentParser(prog="python -m eecore.train.exit_adapter", description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="folder from `python -m eecore.sources.corpus`")
    ap.add_argument("--out", required=True, help="the adapter file to write (.safetensors)")
    ap.add_argument("--checkpoint-dir", required=True, help="resumable checkpoints and the token cache")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    d = AdapterTrainConfig()
    ap.add_argument("--exit-layers", type=int, nargs="+", default=list(d.exit_layers))
    for name in ("adapter_hidden", "draft_vocab", "seq_len", "batch_size", "steps", "warmup", "seed"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "temperature", "max_grad_norm", "min_lr_ratio"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = ap.parse_args(argv)
    config = AdapterTrainConfig(tuple(args.exit_layers), args.adapter_hidden, args.draft_vocab, args.seq_len,
                                args.batch_size, args.steps, args.lr, args.warmup, args.min_lr_ratio,
                                args.max_grad_norm, args.temperature, args.seed)
    llm = eecore.LLM(args.model, dtype="float32", device="cpu", quantization="none", max_num_seqs=args.batch_size,
                     max_num_batched_tokens=args.batch_size * args.seq_len, max_model_len=args.seq_len + 1)
    tokens = tokenize_file(llm.tokenizer, os.path.join(args.corpus, "train.txt"), args.checkpoint_dir)
    heldout = tokenize_file(llm.tokenizer, os.path.join(args.corpus, "heldout.txt"), args.checkpoint_dir)
    vocab = None
    if args.draft_vocab:
        vocab = frequent_tokens(tokens, llm.config.vocab_size, args.draft_vocab, tuple(llm.config.eos_token_ids))
    log_path = os.path.join(args.checkpoint_dir, "train_log.jsonl")
    started = time.time()

    def log(record):
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    trainer = train(llm, tokens, config, vocab=vocab, checkpoint_dir=args.checkpoint_dir,
                    checkpoint_every=args.checkpoint_every, heldout=heldout, eval_every=args.eval_every, log=log,
                    progress=True)
    with open(os.path.join(args.corpus, "manifest.json")) as f:
        manifest = json.load(f)
    last = trainer.history[-1] if trainer.history else {}
    info = {"recipe": "frozen base, per-exit SwiGLU adapter, KL to the last layer over the draft vocabulary",
            "config": dataclasses.asdict(config), "trained_tokens": config.steps * config.batch_size * config.seq_len,
            "corpus": {k: manifest[k] for k in ("train", "heldout", "versions")},
            "final_train": {k: v for k, v in last.items() if k.startswith(("loss_", "agree_"))},
            "final_heldout": trainer.evaluate(heldout_windows(heldout, config)),
            "wall_seconds_this_run": round(time.time() - started, 1)}
    dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32
    trainer.adapters(info, dtype).save(args.out)
    print(json.dumps(info["final_heldout"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
