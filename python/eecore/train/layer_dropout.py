"""LayerSkip's layer dropout (LayerSkip paper, §4.1.1, equations (1)-(4)).

Each training sample skips transformer layer l at iteration t with probability

    p_{l,t} = S(t) D(l) p_max                                     (2)
    D(l)    = exp(l ln2 / (L-1)) - 1                              (3)  0 at layer 0, 1 at layer L-1
    S(t)    = 1                   ("constant": finetuning, continual pretraining)
            = exp(t ln2 / (T-1)) - 1  ("exp": pretraining from scratch)   (4)

and a skipped sample passes through unchanged:

    x_{l+1,t} = x_{l,t} + M(p_{l,t}) f_l(x_{l,t}),   M(p) = 0 with probability p, else 1   (1)

There is no 1/(1-p) rescaling of the kept branch: equation (1) has none, and the model must run
unchanged (all layers, M = 1) at inference.

The efficiency trick of the paper: the dropped samples are taken out of the batch, f_l runs on the
remaining ones only, and the results are scattered back (`drop_layer`). Seeding the generator the
same way on every data-parallel rank makes every rank drop the same number of samples per layer.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

DROPOUT_CURRICULA = ("constant", "exp")


def _exp_ramp(i: int, n: int) -> float:
    """exp(i ln2 / (n-1)) - 1: 0 at i = 0, 1 at i = n-1 (equations (3) and (4) share this shape).
    With n = 1 the single point is the start of the ramp, 0."""
    return math.exp(i * math.log(2.0) / max(n - 1, 1)) - 1.0


def layer_scale(layer: int, num_layers: int) -> float:
    """D(l), equation (3): the per-layer dropout scaling, exponential from 0 (layer 0) to 1 (layer L-1)."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
    return _exp_ramp(layer, num_layers)


def time_scale(step: int, total_steps: int, curriculum: str = "constant") -> float:
    """S(t): 1 for the "constant" curriculum, S_exp(t) of equation (4) for "exp" (0 at t = 0, 1 at T-1)."""
    if not 0 <= step < total_steps:
        raise ValueError(f"step must be in [0, total_steps={total_steps}), got {step}")
    if curriculum == "constant":
        return 1.0
    if curriculum == "exp":
        return _exp_ramp(step, total_steps)
    raise ValueError(f"dropout curriculum must be one of {DROPOUT_CURRICULA}, got {curriculum!r}")


def dropout_rates(step: int, total_steps: int, num_layers: int, p_max: float,
                  curriculum: str = "constant") -> list[float]:
    """p_{l,t} = S(t) D(l) p_max for l = 0..L-1, equation (2)."""
    if not 0.0 <= p_max <= 1.0:
        raise ValueError(f"p_max must be in [0, 1], got {p_max}")
    s = time_scale(step, total_steps, curriculum)
    return [s * layer_scale(layer, num_layers) * p_max for layer in range(num_layers)]


def sample_kept_rows(batch: int, p: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """M(p) of equation (1) for each of `batch` samples: a bool tensor [batch], True where the sample
    runs the layer (probability 1-p). Drawn on the generator's device (CPU without one) so a seeded
    generator gives the same draws whatever device the model is on. p = 0 draws nothing."""
    device = generator.device if generator is not None else torch.device("cpu")
    if p <= 0.0:
        return torch.ones(batch, dtype=torch.bool, device=device)
    return torch.rand(batch, generator=generator, device=device) >= p


def drop_layer(layer_fn: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
               hidden: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Equation (1) applied per sample, running the layer only on the kept samples.

    `layer_fn(x, rows)` must return x_{l+1} = x_l + f_l(x_l) for the samples `x` (the residual
    included, as Hugging Face decoder layers do); `rows` are their indices in the full batch (so the
    caller can select per-sample masks and positions), or None when x is the whole batch.
    `hidden` is [B, ...] and `kept` a bool [B]. Dropped samples come back as they went in."""
    if kept.shape != hidden.shape[:1]:
        raise ValueError(f"kept must be a bool tensor of shape [{hidden.shape[0]}], got {tuple(kept.shape)}")
    if bool(kept.all()):
        return layer_fn(hidden, None)
    if not bool(kept.any()):
        return hidden
    rows = kept.nonzero().squeeze(1).to(hidden.device)
    # index_copy is out of place: autograd sends the kept rows' gradient through f_l and the dropped
    # rows' gradient straight through the identity.
    return hidden.index_copy(0, rows, layer_fn(hidden.index_select(0, rows), rows))
