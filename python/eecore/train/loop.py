"""The training loop of eecore's exit trainers (eecore.train.exit_adapter, eecore.train.exit_ready):
seeded batches, resumable checkpoints, held-out evaluation, a log and a progress bar.

A trainer has `step`, `train_step(windows) -> record`, `evaluate(windows) -> dict`,
`state_dict()` and `load_state_dict(state)` (which `restore` serves: it also reads the trainer's
`config`, `vocab`, `llm`, `blocks`, `optimizer` and `history`). The batch of step t is drawn from a generator seeded
with (seed, t), so no data-loader state needs saving and a resumed run ends with the weights of an
uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import numpy as np
import torch

from eecore.models.exit_adapter import model_fingerprint

CHECKPOINT = "last.pt"


def check_student_model(model, exit_layers, owner: str) -> None:
    """What both exit trainers need of the eecore model they train on: fp32 weights (the optimizer's
    updates would vanish in bf16) and every exit below the last layer."""
    if model.dtype != torch.float32:
        raise ValueError(f"{owner}: load the model in float32 for training, got {model.dtype}")
    for E in exit_layers:
        if E >= model.num_layers:
            raise ValueError(f"{owner}: exit layer {E} must be below the model's {model.num_layers} layers")


def batch_windows(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """Step `step`'s batch [batch_size, seq_len] of windows of the stream, a function of (seed, step)."""
    if len(tokens) < seq_len:
        raise ValueError(f"the training text has {len(tokens)} tokens, fewer than seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len + 1, (batch_size,), generator=g).tolist()
    return torch.from_numpy(np.stack([tokens[s:s + seq_len] for s in starts]).astype(np.int64))


def heldout_windows(heldout: np.ndarray, config) -> torch.Tensor:
    """The held-out windows every evaluation of a run scores (the periodic ones, the file's final
    figures, `--eval-only`): one fixed draw, so that the figures compare across steps and files."""
    return batch_windows(heldout, 0, config.batch_size, config.seq_len, config.seed + 1)


def check_resumable(state: dict, config, vocab: Optional[torch.Tensor], fingerprint: dict) -> None:
    """Raises unless checkpoint `state` was made by a run of the same configuration, draft
    vocabulary and model (`fingerprint`: eecore.models.exit_adapter.model_fingerprint)."""
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in state["config"].items()}
    if saved != dataclasses.asdict(config) | {"exit_layers": tuple(config.exit_layers)}:
        raise ValueError(f"checkpoint was made with another configuration: {saved}")
    theirs = state.get("vocab")
    if (theirs is None) != (vocab is None) or (theirs is not None and not torch.equal(theirs, vocab)):
        raise ValueError("checkpoint was made with another draft vocabulary "
                         f"({'none' if theirs is None else len(theirs)} ids there, "
                         f"{'none' if vocab is None else len(vocab)} here)")
    model = state.get("model")  # absent from checkpoints written before it was recorded
    if model is not None and model != fingerprint:
        raise ValueError(f"checkpoint was made for another model: {model}, this one is {fingerprint}")


def restore(trainer, state: dict) -> None:
    """Loads what every exit trainer's checkpoint holds (the adapter blocks, the optimizer, the step
    and the history) after check_resumable; a trainer restores its other parts after this."""
    check_resumable(state, trainer.config, trainer.vocab, model_fingerprint(trainer.llm.model))
    with torch.no_grad():
        for E, tensors in state["blocks"].items():
            for param, value in zip(trainer.blocks[E].tensors(), tensors):
                param.copy_(value)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.step, trainer.history = state["step"], state["history"]


def save_checkpoint(trainer, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(trainer.state_dict(), tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint


def run(trainer, tokens: np.ndarray, config, *, desc: str, checkpoint_dir: Optional[str] = None,
        checkpoint_every: int = 50, heldout: Optional[np.ndarray] = None, eval_every: int = 0, log=None,
        progress: bool = False, stop_after: Optional[int] = None, deadline: Optional[float] = None):
    """Trains `trainer` (resumed from `checkpoint_dir` if it holds a checkpoint) to `config.steps`.
    `stop_after` ends early after that many steps of this call (the tests' interruption), `deadline`
    (a time.time()) after the step that passes it, with a checkpoint. Held-out windows are scored
    every `eval_every` steps and at the end; `log(record)` receives each step's record."""
    ckpt = None
    if checkpoint_dir:
        os.makedirs(checkpoint_dir, exist_ok=True)
        ckpt = os.path.join(checkpoint_dir, CHECKPOINT)
        if os.path.exists(ckpt):
            trainer.load_state_dict(torch.load(ckpt, weights_only=False))
    eval_windows = None
    if heldout is not None and eval_every:
        eval_windows = heldout_windows(heldout, config)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.steps, initial=trainer.step, desc=desc, unit="step")
    ran = 0
    while trainer.step < config.steps and (stop_after is None or ran < stop_after):
        record = trainer.train_step(batch_windows(tokens, trainer.step, config.batch_size, config.seq_len,
                                                  config.seed))
        ran += 1
        out_of_time = deadline is not None and time.time() >= deadline
        if eval_windows is not None and (trainer.step % eval_every == 0 or trainer.step == config.steps):
            record["heldout"] = trainer.evaluate(eval_windows)
        if log is not None:
            log(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix({k: v for k, v in record.items() if k.startswith("agree_")})
        if ckpt and (trainer.step % checkpoint_every == 0 or trainer.step == config.steps or out_of_time):
            save_checkpoint(trainer, ckpt)
        if out_of_time:
            break
    if bar is not None:
        bar.close()
    return trainer
