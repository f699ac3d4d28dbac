"""CALM fine-tuning of a T5 (Schuster et al., 2022, "Confident Adaptive Language Modeling"), the
models seed 001 evaluates its early-exit framework on.

Two objectives, trained together on teacher-forced seq2seq batches, with autograd on the HF
modules themselves (eecore's inference ops are not differentiable):
- the model: CALM's weighted average of the per-layer losses, every decoder layer read through the
  shared final norm and LM head,  L = sum_i w_i L_i  with  w_i = i / sum_j j  (i = 1..L), so
  deeper layers weigh more and the last layer's loss keeps the largest share;
- the early-exit classifier (CALM's "independent" objective): at every exit layer E < L, an MLP
  on the final-normed state after layer E-1 learns, by binary cross-entropy and each layer on its
  own, whether that layer's top-1 token equals the last layer's (CALM's consistency oracle). Its
  inputs are detached: the classifier never pulls the model. The result is eecore's classifier
  file (eecore.exits.classifier), which `EarlyExitConfig(measure="classifier")` loads.

    data = Seq2SeqData(pairs, batch_size=16, pad_id=0, seed=0)
    trainer = train(hf_t5, data, CALMConfig(steps=1000), checkpoint_dir="ckpt")
    trainer.classifier().save("exit_classifier.safetensors")

or, from the command line, on a JSONL file of {"input": ..., "target": ...} records:

    python -m eecore.train.calm --model T5_DIR --data pairs.jsonl --out OUT_DIR --steps 1000

Training resumes exactly from `checkpoint_dir` (model, classifier, both optimizers, RNG state;
batches are a function of the step). Each step's record holds every layer's loss and agreement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from eecore.exits.classifier import ExitClassifier

T5_MODEL_TYPES = ("t5", "mt5")


@dataclass(frozen=True)
class CALMConfig:
    """steps: optimizer steps. lr: the model's AdamW learning rate. classifier_lr: the classifier's
    Adam learning rate. classifier_hidden: the classifier MLP's width. train_model: False keeps the
    model frozen and trains only the classifier (CALM's second stage on an already tuned model)."""
    steps: int = 1000
    lr: float = 3e-4
    classifier_lr: float = 1e-3
    classifier_hidden: int = 16
    max_grad_norm: float = 1.0
    train_model: bool = True
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "classifier_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CALMConfig: '{name}' must be a positive int, got {value!r}")
        for name in ("lr", "classifier_lr", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CALMConfig: '{name}' must be > 0, got {getattr(self, name)!r}")


def calm_layer_weights(num_layers: int) -> list[float]:
    """CALM's w_i = i / sum_j j for layers i = 1..L: the weights of the per-layer losses."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    total = num_layers * (num_layers + 1) / 2
    return [i / total for i in range(1, num_layers + 1)]


class Seq2SeqData:
    """Token-id pairs (encoder input, target) served as padded batches; the batch of step t is a
    function of (seed, t) only, so a resumed run sees exactly the batches it would have seen."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int = 0, seed: int = 0):
        if not pairs:
            raise ValueError("Seq2SeqData: 'pairs' is empty")
        for i, (src, tgt) in enumerate(pairs):
            if not src or not tgt:
                raise ValueError(f"Seq2SeqData: pair {i} has an empty input or target")
        if batch_size < 1:
            raise ValueError(f"Seq2SeqData: 'batch_size' must be >= 1, got {batch_size}")
        self.pairs, self.batch_size, self.pad_id, self.seed = pairs, batch_size, pad_id, seed

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        picks = torch.randint(0, len(self.pairs), (self.batch_size,), generator=g).tolist()
        return collate([self.pairs[i] for i in picks], self.pad_id)


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask padded with `pad_id`, labels padded with -100 (ignored)."""
    S = max(len(s) for s, _ in pairs)
    T = max(len(t) for _, t in pairs)
    input_ids = torch.full((len(pairs), S), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(pairs), S, dtype=torch.long)
    labels = torch.full((len(pairs), T), -100, dtype=torch.long)
    for b, (src, tgt) in enumerate(pairs):
        input_ids[b, : len(src)] = torch.tensor(src)
        attention_mask[b, : len(src)] = 1
        labels[b, : len(tgt)] = torch.tensor(tgt)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


class _BlockOutputs:
    """Captures every decoder block's output (the residual stream after it) during a forward."""

    def __init__(self, blocks):
        self.states: list[torch.Tensor] = []
        self._hooks = [b.register_forward_hook(self._keep) for b in blocks]

    def _keep(self, module, args, output):
        self.states.append(output[0] if isinstance(output, tuple) else output)

    def close(self):
        for h in self._hooks:
            h.remove()


class CALMTrainer:
    def __init__(self, model, config: CALMConfig):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in T5_MODEL_TYPES:
            raise TypeError(f"CALMTrainer: 'model' must be an HF T5ForConditionalGeneration ({T5_MODEL_TYPES}), "
                            f"got model_type {model_type!r}")
        if next(model.parameters()).dtype != torch.float32:
            raise ValueError("CALMTrainer: load the model in float32 for training")
        self.model, self.config = model, config
        c = model.config
        self.L = c.num_decoder_layers
        if self.L < 2:
            raise ValueError(f"CALMTrainer: the decoder needs at least 2 layers to exit early, has {self.L}")
        # The original T5 scales the decoder output before its tied head; eecore folds the scale
        # into the final norm, so the classifier's features carry it too.
        scale = getattr(c, "scale_decoder_outputs", None)
        self.scale = c.d_model ** -0.5 if (scale if scale is not None else c.tie_word_embeddings) else 1.0
        self.weights = calm_layer_weights(self.L)
        g = torch.Generator().manual_seed(config.seed)
        d, m = c.d_model, config.classifier_hidden
        self.heads = {E: [(torch.randn(m, d, generator=g) / d ** 0.5).requires_grad_(),
                          torch.zeros(m, requires_grad=True),
                          (torch.randn(m, generator=g) / m ** 0.5).requires_grad_(),
                          torch.zeros(1, requires_grad=True)] for E in range(1, self.L)}
        model.requires_grad_(config.train_model)
        model.train(config.train_model)
        self.model_optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr) if config.train_model else None
        self.classifier_optimizer = torch.optim.Adam([p for h in self.heads.values() for p in h],
                                                     lr=config.classifier_lr)
        self.step = 0
        self.history: list[dict] = []

    # ---- the objectives ----------------------------------------------------------------------
    def _normed_states(self, batch) -> list[torch.Tensor]:
        """The final-normed decoder state after each layer, `L x [B, T, d]` (the head's input)."""
        decoder = self.model.get_decoder()
        capture = _BlockOutputs(decoder.block)
        try:
            self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=self.model.prepare_decoder_input_ids_from_labels(labels=batch["labels"]),
                       use_cache=False)
        finally:
            capture.close()
        if len(capture.states) != self.L:
            raise RuntimeError(f"captured {len(capture.states)} decoder block outputs, expected {self.L}")
        return [decoder.final_layer_norm(h) * self.scale for h in capture.states]

    def losses(self, batch) -> dict:
        """Per layer i = 1..L: the CE of its logits; per exit E < L: its top-1 agreement with the
        last layer and its classifier's BCE on the consistency oracle."""
        valid = batch["labels"] != -100
        targets = batch["labels"][valid]
        normed = [n[valid] for n in self._normed_states(batch)]  # L x [N, d]
        head = self.model.get_output_embeddings()
        logits = [head(n) for n in normed]
        layer_loss = [F.cross_entropy(lg.float(), targets) for lg in logits]
        final_top1 = logits[-1].argmax(-1)
        agreement, classifier_loss = {}, {}
        for E in range(1, self.L):
            oracle = (logits[E - 1].argmax(-1) == final_top1).float()
            agreement[E] = oracle.mean().item()
            w1, b1, w2, b2 = self.heads[E]
            score = torch.relu(normed[E - 1].detach() @ w1.T + b1) @ w2 + b2
            classifier_loss[E] = F.binary_cross_entropy_with_logits(score, oracle)
        model_loss = sum(w * l for w, l in zip(self.weights, layer_loss))
        return dict(model_loss=model_loss, layer_loss=layer_loss, agreement=agreement, classifier_loss=classifier_loss)

    def train_step(self, batch) -> dict:
        if self.model_optimizer is not None:
            self.model_optimizer.zero_grad(set_to_none=True)
        self.classifier_optimizer.zero_grad(set_to_none=True)
        out = self.losses(batch)
        # independent objective: the mean of the exits' BCEs; each head only sees its own layer
        classifier_total = sum(out["classifier_loss"].values()) / (self.L - 1)
        if self.model_optimizer is not None:
            (out["model_loss"] + classifier_total).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            self.model_optimizer.step()
        else:
            classifier_total.backward()
        self.classifier_optimizer.step()
        record = self._record(out)
        record["step"] = self.step
        self.history.append(record)
        self.step += 1
        return record

    @torch.no_grad()
    def evaluate(self, batch) -> dict:
        was_training = self.model.training
        self.model.eval()
        try:
            return self._record(self.losses(batch))
        finally:
            self.model.train(was_training)

    def _record(self, out) -> dict:
        record = {"loss": round(out["model_loss"].item(), 5)}
        record.update({f"loss_{i + 1}": round(l.item(), 5) for i, l in enumerate(out["layer_loss"])})
        record.update({f"agree_{E}": round(a, 4) for E, a in out["agreement"].items()})
        record.update({f"cls_loss_{E}": round(l.item(), 5) for E, l in out["classifier_loss"].items()})
        return record

    def classifier(self) -> ExitClassifier:
        return ExitClassifier(self.model.config.d_model,
                              {E: tuple(p.detach().clone() for p in h) for E, h in self.heads.items()})

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "config": dataclasses.asdict(self.config), "history": self.history,
                "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "heads": {E: [p.detach().clone() for p in h] for E, h in self.heads.items()},
                "model_optimizer": None if self.model_optimizer is None else self.model_optimizer.state_dict(),
                "classifier_optimizer": self.classifier_optimizer.state_dict(),
                "rng": torch.get_rng_state()}  # dropout draws

    def load_state_dict(self, state: dict) -> None:
        if state["config"] != dataclasses.asdict(self.config):
            raise ValueError(f"checkpoint was made with another CALMConfig: {state['config']}")
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            for E, values in state["heads"].items():
                for p, v in zip(self.heads[E], values):
                    p.copy_(v)
        if self.model_optimizer is not None:
            self.model_optimizer.load_state_dict(state["model_optimizer"])
        self.classifier_optimizer.load_state_dict(state["classifier_optimizer"])
        torch.set_rng_state(state["rng"])
        self.step, self.history = state["step"], state["history"]

    def save_checkpoint(self, path: str) -> None:
        tmp = path + ".tmp"
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint


def train(model, data: Seq2SeqData, config: CALMConfig, *, checkpoint_dir: Optional[str] = None,
          checkpoint_every: int = 50, log: Optional[Callable[[dict], None]] = None,
          stop_after: Optional[int] = None) -> CALMTrainer:
    """Trains (or resumes from `checkpoint_dir`) to `config.steps`; `stop_after` ends this call
    after that many steps (the tests' interruption). `log(record)` receives each step's record."""
    trainer = CALMTrainer(model, config)
    ckpt = None
    if checkpoint_dir:
        os.makedirs(checkpoint_dir, exist_ok=True)
        ckpt = os.path.join(checkpoint_dir, "last.pt")
        if os.path.exists(ckpt):
            trainer.load_state_dict(torch.load(ckpt, weights_only=False))
    ran = 0
    while trainer.step < config.steps and (stop_after is None or ran < stop_after):
        record = trainer.train_step(data.batch(trainer.step))
        ran += 1
        if log is not None:
            log(record)
        if ckpt and (trainer.step % checkpoint_every == 0 or trainer.step == config.steps):
            trainer.save_checkpoint(ckpt)
    return trainer


def save_t5(model, out_dir: str, tokenizer_dir: Optional[str] = None) -> None:
    """Write the model as an HF directory eecore (and transformers) load: config.json,
    model.safetensors with every tensor (a v1.1 head of its own included: transformers 5 would
    drop it as 'tied') and its index, and the tokenizer files of `tokenizer_dir`."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    untied = model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
    config = model.config.to_dict()
    config["tie_word_embeddings"] = not untied
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
               and (untied or k != "lm_head.weight")}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    # An index naming the one shard: loaders then read only it, not other .safetensors files kept
    # beside it (the CLI puts the exit classifier there).
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {name: "model.safetensors" for name in tensors}}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))


# ---- command line -----------------------------------------------------------------------------


def read_pairs(path: str, tokenizer) -> list[tuple[list[int], list[int]]]:
    """JSONL records {"input": str, "target": str}, tokenized (the tokenizer appends </s>)."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                src, tgt = record["input"], record["target"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with 'input' and 'target' strings ({e})") from e
            pairs.append((tokenizer.encode(src), tokenizer.encode(tgt)))
    if not pairs:
        raise ValueError(f"{path}: no records")
    return pairs


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eecore.train.calm", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF T5 directory (safetensors + tokenizer.json)")
    ap.add_argument("--data", required=True, help='JSONL of {"input": ..., "target": ...}')
    ap.add_argument("--out", required=True, help="directory for the tuned model and exit_classifier.safetensors")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--classifier-lr", type=float, default=1e-3)
    ap.add_argument("--classifier-hidden", type=int, default=16)
    ap.add_argument("--classifier-only", action="store_true", help="keep the model frozen")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=None, help="resume from / save to this directory")
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)

    from transformers import T5ForConditionalGeneration

    from eecore.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_hf_dir(args.model)
    if tokenizer is None:
        raise SystemExit(f"{args.model}: no tokenizer.json")
    model = T5ForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    data = Seq2SeqData(read_pairs(args.data, tokenizer), args.batch_size, pad, args.seed)
    config = CALMConfig(steps=args.steps, lr=args.lr, classifier_lr=args.classifier_lr,
                        classifier_hidden=args.classifier_hidden, train_model=not args.classifier_only,
                        seed=args.seed)

    def log(record):
        if record["step"] % args.log_every == 0 or record["step"] == args.steps - 1:
            layers = " ".join(f"{k[5:]}:{v:.3f}" for k, v in record.items() if k.startswith("loss_"))
            agree = " ".join(f"{k[6:]}:{v:.2f}" for k, v in record.items() if k.startswith("agree_"))
            print(f"step {record['step']} loss {record['loss']:.4f} | layer losses {layers} | agreement {agree}",
                  flush=True)

    trainer = train(model, data, config, checkpoint_dir=args.checkpoint_dir, log=log)
    save_t5(model, args.out, args.model)
    trainer.classifier().save(os.path.join(args.out, "exit_classifier.safetensors"))
    print(f"saved {args.out} (model and exit_classifier.safetensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
