"""Train CALM's dedicated early-exit classifier for a model, and save it in eecore's file format.

CALM's "independent" objective: at every exit layer E, the classifier learns whether the token
that the LM head reads off layer E equals the one it reads off the last layer (the consistency
oracle), with binary cross-entropy, each layer on its own. The training text is the model's own
greedy continuations of a set of prompts (no data set to download).

    python -m eecore.train.calm_classifier --out exit_classifier.safetensors [--model PATH]
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.exits.classifier import ExitClassifier
from eecore.sampling_params import SamplingParams

DEFAULT_PROMPTS = [
    "Explain how the internet works.", "Write a story about a dragon who learns to cook.",
    "List the planets of the solar system and one fact about each.", "How do I sort a list in Python?",
    "What causes the seasons on Earth?", "Describe a healthy breakfast.", "Why do cats purr?",
    "Give advice to a new programmer.", "What is photosynthesis?", "Translate 'good morning' into French.",
    "Write a haiku about autumn.", "How does a bicycle stay upright?",
]


@torch.no_grad()
def collect(llm, token_sequences: list[list[int]], start_positions: list[int]):
    """Per exit layer E (1..L-1): final-normed hidden states of the positions from each sequence's
    start position on `[N, d]`, and labels `[N]` (1 where layer E's top-1 equals the last layer's)."""
    engine, model = llm.engine, llm.model
    L = model.num_layers
    features: list[list[torch.Tensor]] = [[] for _ in range(L)]
    labels: list[list[torch.Tensor]] = [[] for _ in range(L)]
    for ids, start in zip(token_sequences, start_positions):
        seq = Sequence(ids, SamplingParams(max_tokens=1))  # never scheduled: it only holds blocks
        engine.blocks.grow(seq, len(ids))
        try:
            inputs = engine.runner.prepare([Row(seq, 0, ids)])
            hidden = engine.runner.embed(inputs)
            per_layer = []
            for i in range(L):
                engine.runner.run_layers(hidden, inputs.attn, i, i + 1)
                normed = model.final_norm_(hidden[start:], torch.empty_like(hidden[start:]))
                per_layer.append(normed.float().clone())
            final_top1 = (per_layer[-1].to(model.dtype) @ model.lm_head.t()).argmax(-1)
            for E in range(1, L):
                top1 = (per_layer[E - 1].to(model.dtype) @ model.lm_head.t()).argmax(-1)
                features[E].append(per_layer[E - 1])
                labels[E].append((top1 == final_top1).float())
        finally:
            engine.blocks.free(seq)
    return ({E: torch.cat(features[E]) for E in range(1, L)}, {E: torch.cat(labels[E]) for E in range(1, L)})


def fit(features: torch.Tensor, labels: torch.Tensor, hidden: int, epochs: int, lr: float, seed: int):
    """One layer's MLP with BCE; returns (w1, b1, w2, b2)."""
    g = torch.Generator().manual_seed(seed)
    d = features.shape[1]
    w1 = (torch.randn(hidden, d, generator=g) / d ** 0.5).requires_grad_()
    b1 = torch.zeros(hidden, requires_grad=True)
    w2 = (torch.randn(hidden, generator=g) / hidden ** 0.5).requires_grad_()
    b2 = torch.zeros(1, requires_grad=True)
    params = [w1, b1, w2, b2]
    opt = torch.optim.Adam(params, lr=lr)
    pos = labels.mean().clamp(1e-3, 1 - 1e-3)
    weight = torch.where(labels > 0, 0.5 / pos, 0.5 / (1 - pos))  # balance the classes
    with torch.enable_grad():
        for _ in range(epochs):
            opt.zero_grad()
            logits = torch.relu(features @ w1.T + b1) @ w2 + b2
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, weight=weight)
            loss.backward()
            opt.step()
    return tuple(p.detach() for p in params)


def train(llm, prompts: Optional[list[str]] = None, max_new_tokens: int = 64, hidden: int = 16,
          epochs: int = 300, lr: float = 1e-2, seed: int = 0) -> ExitClassifier:
    prompts = prompts or DEFAULT_PROMPTS
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(max_tokens=max_new_tokens))
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]
    starts = [len(o.prompt_token_ids) - 1 for o in outs]
    features, labels = collect(llm, sequences, starts)
    layers = {E: fit(features[E], labels[E], hidden, epochs, lr, seed + E) for E in features}
    return ExitClassifier(llm.config.hidden_size, layers)


def main(argv=None) -> int:
    import eecore

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=300)
    args = ap.parse_args(argv)
    llm = eecore.LLM(args.model, dtype="float32", device="cpu", quantization="none")
    train(llm, max_new_tokens=args.max_new_tokens, hidden=args.hidden, epochs=args.epochs).save(args.out)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
