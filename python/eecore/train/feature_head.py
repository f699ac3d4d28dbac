"""Train a feature draft head (eecore.models.feature_head) on the target's own text.

    python -m eecore.train.generated_corpus --out gen/ ...          # the target's continuations
    python -m eecore.train.feature_head --corpus gen/ --checkpoint-dir ckpt/ --out head.safetensors \\
        [--steps 3000] [--drafts 4] [--draft-vocab shipped|none|N] [--stop-after-minutes 110] [--init head.safetensors]
        [--intermediate-size 2048] [--lr-schedule cosine] [--file-dtype int8] [--target-temperature 1.0]

Each step takes `batch_size` windows of `seq_len` tokens of the corpus, runs the target over them
(its Hugging Face twin in fp32, no gradients) for its tapped streams and its next-token
distributions, and unrolls the head from every position t of every window as it drafts: from the
target's state at t and the token at t + 1, then from its own states, `drafts` steps, each scored
against the target's distribution of the token it drafts (cross-entropy with the target's
probabilities over the draft vocabulary; `--target-temperature` below 1 sharpens them toward the
model's own top tokens). The unroll is the drafting procedure itself, so the head
is trained on its own states as it will run (EAGLE-3's "training-time test").

The head drafts over a draft vocabulary (`--draft-vocab`): the shipped draft copy's (chosen on
code, it misses about a quarter of the model's tokens on chat), the whole vocabulary, or the N most
frequent tokens of the corpus, which for a corpus of every kind of text holds nearly all of them.

`--init FILE` starts from a head file's weights (its taps and shapes) instead of a new head: a
trained head goes on learning on another corpus or over another draft vocabulary, with an optimizer
of its own; with a larger
`--intermediate-size` its MLP is widened first, the new neurons silent until trained
(FeatureHead.widened). `--lr-schedule cosine` warms up over 20 steps, then decays the rate to 0 at
`--steps` (the default keeps it constant).

Resumable (the same command again: eecore.train.loop), seeded, and the file records its data,
steps and held-out agreement by depth (the share of windows whose first k drafts all equal the
target's greedy tokens: what greedy acceptance of k drafts would be).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from eecore.models.exit_adapter import model_fingerprint
from eecore.models.feature_head import FeatureHead
from eecore.train.exit_ready_trainer import hf_twin
from eecore.train.loop import heldout_windows, run


LR_SCHEDULES = ("constant", "cosine")
WARMUP = 20  # steps of the cosine schedule's linear warmup


@dataclasses.dataclass
class FeatureHeadConfig:
    steps: int = 3000
    batch_size: int = 8
    seq_len: int = 128
    drafts: int = 4               # the unroll: drafts a window is trained to make
    lr: float = 5e-4
    weight_decay: float = 0.0
    seed: int = 0
    intermediate_size: Optional[int] = None  # the head's MLP (default: the target's; with --init, wider widens it)
    lr_schedule: str = "constant"  # or "cosine": WARMUP steps up to lr, then down to 0 at `steps`
    # the target's distribution is sharpened by this temperature before the head is scored against
    # it (below 1: more weight on the model's own top tokens, which greedy acceptance asks for)
    target_temperature: float = 1.0

    def __post_init__(self):
        for name in ("steps", "batch_size", "drafts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FeatureHeadConfig: '{name}' must be an int >= 1, got {value!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"FeatureHeadConfig: 'lr_schedule' must be one of {', '.join(LR_SCHEDULES)}, "
                             f"got {self.lr_schedule!r}")
        if not isinstance(self.target_temperature, (int, float)) or isinstance(self.target_temperature, bool) \
                or not self.target_temperature > 0:
            raise ValueError(f"FeatureHeadConfig: 'target_temperature' must be a number > 0, "
                             f"got {self.target_temperature!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < self.drafts + 2:
            raise ValueError(f"FeatureHeadConfig: 'seq_len' must be an int >= drafts + 2 ({self.drafts + 2}), "
                             f"got {self.seq_len!r}")


class FeatureHeadTrainer:
    """The head's parameters, the frozen target (its HF twin) and the optimizer (eecore.train.loop's
    trainer interface: step, train_step, evaluate, state_dict, load_state_dict)."""

    def __init__(self, llm, config: FeatureHeadConfig, vocab: Optional[torch.Tensor] = None,
                 head: Optional[FeatureHead] = None, taps: Optional[tuple[int, ...]] = None):
        model = llm.model
        if model.dtype != torch.float32:
            raise ValueError(f"FeatureHeadTrainer: load the target in float32 for training, got {model.dtype}")
        self.llm, self.config, self.vocab = llm, config, vocab
        torch.manual_seed(config.seed)
        self.hf = hf_twin(model).eval().requires_grad_(False)
        self.head = head or FeatureHead.initialized(model, taps, config.intermediate_size, vocab, config.seed)
        self.head.vocab = vocab
        self.params = {name: torch.nn.Parameter(t.float().clone()) for name, t in self.head.weights.items()}
        self.head.weights = self.params
        self.embed = self.hf.model.embed_tokens.weight
        rows = self.hf.lm_head.weight
        self.head_rows = rows if vocab is None else rows.index_select(0, vocab)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=config.lr, weight_decay=config.weight_decay)
        self.step, self.history = 0, []

    # ---- the loss --------------------------------------------------------------------------------
    def _target(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's tapped streams `[B, T, taps * d]` and its next-token probabilities over the
        draft vocabulary `[B, T, K]` (renormalized there), at every position of `windows` `[B, T]`."""
        with torch.no_grad():
            out = self.hf(input_ids=windows, output_hidden_states=True)
            # hidden_states[E] is the stream after E layers (E < L: before the final norm)
            features = torch.cat([out.hidden_states[t] for t in self.head.taps], dim=-1)
            logits = out.logits if self.vocab is None else out.logits.index_select(-1, self.vocab)
            return features, (logits.float() / self.config.target_temperature).softmax(dim=-1)

    def unroll(self, windows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The mean loss over the unroll and, per depth k, whether each window's first k drafts all
        equal the target's greedy tokens `[N]`."""
        features, probs = self._target(windows)
        B, T = windows.shape
        d = self.config.drafts
        starts = T - d - 1  # every position with d tokens after it and a target for the last draft
        state = self.head.start_state(features[:, :starts].reshape(B * starts, -1))
        window, loss, all_right, agreed = None, 0.0, None, []
        for j in range(d):
            token = windows[:, 1 + j: 1 + j + starts].reshape(-1)
            target = probs[:, 1 + j: 1 + j + starts].reshape(B * starts, -1)
            state, logits, window = self.head.step(state, self.embed[token], self.head_rows, window)
            loss = loss + -(target * F.log_softmax(logits, dim=-1)).sum(dim=-1).mean()
            right = logits.argmax(dim=-1) == target.argmax(dim=-1)
            all_right = right if all_right is None else all_right & right
            agreed.append(all_right)
        return loss / d, agreed

    def learning_rate(self) -> float:
        """This step's learning rate: config.lr, or on the cosine schedule a warmup to it and a
        half cosine down to 0 at config.steps (a function of the step, so a resumed run goes on)."""
        c = self.config
        if c.lr_schedule == "constant":
            return c.lr
        if self.step < WARMUP:
            return c.lr * (self.step + 1) / WARMUP
        return c.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (self.step - WARMUP) / max(1, c.steps - WARMUP))))

    def train_step(self, windows: torch.Tensor) -> dict:
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate()
        self.optimizer.zero_grad(set_to_none=True)
        loss, agreed = self.unroll(windows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params.values(), 1.0)
        self.optimizer.step()
        self.step += 1
        record = {"step": self.step, "loss": round(float(loss.detach()), 4)} | {
            f"agree_{k + 1}": round(float(a.float().mean()), 3) for k, a in enumerate(agreed)}
        self.history.append(record)
        return record

    def evaluate(self, windows: torch.Tensor) -> dict:
        with torch.no_grad():
            loss, agreed = self.unroll(windows)
        return {"loss": round(float(loss), 4)} | {f"agree_{k + 1}": round(float(a.float().mean()), 3)
                                                  for k, a in enumerate(agreed)}

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"config": dataclasses.asdict(self.config), "taps": list(self.head.taps),
                "vocab": None if self.vocab is None else self.vocab.tolist(),
                "model": model_fingerprint(self.llm.model), "step": self.step, "history": self.history,
                "weights": {name: p.detach().clone() for name, p in self.params.items()},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        # (a checkpoint from before lr_schedule or target_temperature existed ran without them)
        theirs = ({"lr_schedule": "constant", "target_temperature": 1.0, **state["config"]}, state["taps"],
                  state["vocab"], state["model"])
        ours = (dataclasses.asdict(self.config), list(self.head.taps),
                None if self.vocab is None else self.vocab.tolist(), model_fingerprint(self.llm.model))
        if theirs != ours:
            raise ValueError("checkpoint was made by another run (configuration, taps, draft vocabulary or model)")
        with torch.no_grad():
            for name, value in state["weights"].items():
                self.params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history = state["step"], state["history"]

    def trained_head(self, info: dict) -> FeatureHead:
        """The head as it stands, with `info` (data, steps, figures) for its file."""
        head = dataclasses.replace(self.head, weights={n: p.detach().clone() for n, p in self.params.items()},
                                   info=info)
        return head


def train(llm, tokens: np.ndarray, config: FeatureHeadConfig, *, vocab: Optional[torch.Tensor] = None,
          taps: Optional[tuple[int, ...]] = None, init: Optional[FeatureHead] = None,
          checkpoint_dir: Optional[str] = None, heldout=None, eval_every: int = 0, log=None, progress: bool = False,
          stop_after: Optional[int] = None, deadline: Optional[float] = None) -> FeatureHeadTrainer:
    """Trains (or resumes) to `config.steps` (eecore.train.loop.run), from `init`'s weights where
    given (a head made for this model). The head drafts over `vocab` whatever vocabulary `init` had:
    its weights do not depend on one (its logits are the target's LM head rows of the vocabulary),
    so a trained head can move to a vocabulary that holds more of the model's tokens."""
    if init is not None:
        init.check_fits(llm.model, "init")
        if taps is not None and tuple(taps) != init.taps:
            raise ValueError(f"init: the head reads layers {init.taps}, not the taps given ({tuple(taps)})")
        width = init.weights["down"].shape[1]
        if config.intermediate_size is not None and config.intermediate_size < width:
            raise ValueError(f"init: the head's MLP is {width} wide, more than intermediate_size="
                             f"{config.intermediate_size}")
        if config.intermediate_size is not None and config.intermediate_size > width:
            init = init.widened(config.intermediate_size, config.seed)  # (new neurons silent at first)
    return run(FeatureHeadTrainer(llm, config, vocab, head=init, taps=taps), tokens, config, desc="feature head",
               checkpoint_dir=checkpoint_dir, checkpoint_every=25, heldout=heldout, eval_every=eval_every,
               log=log, progress=progress, stop_after=stop_after, deadline=deadline)


def draft_vocabulary(choice: str, llm, tokens: np.ndarray) -> Optional[torch.Tensor]:
    """The token ids a head drafts over, as `--draft-vocab` names them: "shipped", "none" (None: the
    whole vocabulary) or a count N (the N most frequent tokens of `tokens`, the model's end-of-sequence
    tokens always among them)."""
    if choice == "shipped":
        from eecore.models.exit_adapter import SHIPPED_DRAFT_FILE, ExitAdapters

        return ExitAdapters.load(SHIPPED_DRAFT_FILE).vocab
    if choice == "none":
        return None
    vocab_size = llm.model.config.vocab_size
    if not choice.isdigit() or not 1 <= int(choice) <= vocab_size:
        raise ValueError(f"--draft-vocab must be 'shipped', 'none' or a count of tokens in 1..{vocab_size}, "
                         f"got {choice!r}")
    from eecore.train.exit_adapter import frequent_tokens

    return frequent_tokens(np.asarray(tokens, dtype=np.int64), vocab_size, int(choice),
                           tuple(llm.model.config.eos_token_ids))


def main(argv=None) -> int:
    from eecore.train.exit_ready import corpus_tokens

    ap = argparse.ArgumentParser(prog="python -m eecore.train.feature_head", description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="a folder with train.txt and heldout.txt (or .npy streams)")
    ap.add_argument("--out", required=True, help="the head file to write (.safetensors)")
    ap.add_argument("--checkpoint-dir", default=None, help="resumable checkpoints, the log and the token cache")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--draft-vocab", default="shipped",
                    help="'shipped': the shipped exit adapters' draft vocabulary (chosen on code); N: the N most "
                         "frequent tokens of the corpus (its end-of-sequence tokens always in); 'none': the whole "
                         "vocabulary")
    ap.add_argument("--taps", type=int, nargs="+", default=None, help="the target's layers it reads (default: "
                    "a low, a middle and a high one)")
    ap.add_argument("--stop-after-minutes", type=float, default=None)
    ap.add_argument("--init", default=None, help="start from this head file's weights (default: a new head)")
    ap.add_argument("--file-dtype", default="bfloat16", choices=("bfloat16", "int8"),
                    help="how the file stores the head's matrices: bf16, or 8-bit integers with a scale a row "
                         "(half the bytes; FeatureHead.save)")
    for f in dataclasses.fields(FeatureHeadConfig):
        kind = {"float": float, "str": str}.get(f.type, int)
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                        **({"choices": LR_SCHEDULES} if f.name == "lr_schedule" else {}))
    args = ap.parse_args(argv)
    import eecore

    config = FeatureHeadConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FeatureHeadConfig)})
    dense = args.model is None or args.model.endswith(".gguf")  # (training needs dense fp32 weights)
    llm = eecore.LLM(args.model, dtype="float32", device="cpu", quantization="none" if dense else None)
    cache = args.checkpoint_dir
    tokens = corpus_tokens(llm.tokenizer, args.corpus, "train", cache)
    heldout = corpus_tokens(llm.tokenizer, args.corpus, "heldout", cache)
    vocab = draft_vocabulary(args.draft_vocab, llm, tokens)
    log_file = None if cache is None else open(os.path.join(cache, "log.jsonl"), "a")

    def log(record):
        if log_file is not None:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()

    deadline = None if args.stop_after_minutes is None else time.time() + 60 * args.stop_after_minutes
    init = None if args.init is None else FeatureHead.load(args.init, llm.model)
    trainer = train(llm, tokens, config, vocab=vocab, taps=None if args.taps is None else tuple(args.taps),
                    init=init, checkpoint_dir=args.checkpoint_dir, heldout=heldout, eval_every=100, log=log,
                    progress=True, deadline=deadline)
    figures = trainer.evaluate(heldout_windows(heldout, config))
    trainer.trained_head({"corpus": os.path.abspath(args.corpus), "config": dataclasses.asdict(config),
                          "draft_vocab": args.draft_vocab, "steps": trainer.step, "heldout": figures}
                         | ({} if init is None else {"init": init.info})).save(args.out, getattr(torch, args.file_dtype))
    print(json.dumps({"steps": trainer.step, "heldout": figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
