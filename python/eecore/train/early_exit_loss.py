"""LayerSkip's early-exit loss (LayerSkip paper, §4.1.2, equations (5)-(6) and the curricula).

Every layer l is supervised through the model's own final norm + LM head g (no new heads):

    J(X, Y, t) = sum_l ẽ(t, l) J_CE(g(x_{l+1}), Y)                            (5)
    ẽ(t, l)    = C(t, l) e(l) / sum_i C(t, i) e(i)        (sums to 1)          (6)
    e(l)       = e_scale * sum_{i=0..l} i                  for 0 <= l < L-1
               = L-1 + e_scale * sum_{i=0..L-2} i          for l = L-1

so later layers weigh quadratically more, and e(0) = 0: layer 0's exit never enters the loss.
C(t, l) ∈ {0, 1} is the early-exit curriculum: "none" (every layer, every iteration), rotational
C_rot,R, or gradual C_grad (see their functions for how we read the paper's one-line definitions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EXIT_CURRICULA = ("none", "rotational", "gradual")


def exit_loss_scales(num_layers: int, e_scale: float) -> list[float]:
    """e(l) for l = 0..L-1 (the equation after (6)); sum_{i=0..l} i = l(l+1)/2."""
    if not 0.0 <= e_scale <= 1.0:
        raise ValueError(f"e_scale must be in [0, 1], got {e_scale}")
    L = num_layers
    scales = [e_scale * l * (l + 1) / 2 for l in range(L - 1)]
    scales.append((L - 1) + e_scale * (L - 2) * (L - 1) / 2)
    return scales


def rotational_curriculum(step: int, layer: int, num_layers: int, rotation: int) -> bool:
    """C_rot,R(t, l). The paper: "enable early exit at every R layers, and perform circular rotation
    at each iteration. This way, the early exit at each layer is enabled once every R iterations",
    with ⌈L/R⌉ unembeddings per iteration. Our reading: layer l is on at iteration t iff
    (l - t) mod R == 0 (layers 0, R, 2R, ... at t = 0, the pattern moving up one layer per iteration),
    which enables each layer exactly once every R iterations for any L and R, also when R does not
    divide L (the paper uses R = L-1). The last layer is always on: its loss is the model's ordinary
    language-modelling objective (as in the authors' released code, which rolls the mask over all L
    layers instead; that differs from this rule only when R does not divide L)."""
    if rotation < 1:
        raise ValueError(f"rotation R must be >= 1, got {rotation}")
    return layer == num_layers - 1 or (layer - step) % rotation == 0


def gradual_curriculum(step: int, layer: int, num_layers: int, total_steps: int) -> bool:
    """C_grad(t, l). The paper: "gradually enable early exit loss from layers L-1 to 0, one layer at
    a time every T/2L iterations". Our reading: layer L-1 is on from the start (it is the ordinary
    loss, and without it the first iterations would have no loss at all), layer L-1-k turns on at
    iteration k T/(2L), so layer 0 joins at (L-1) T/(2L), just before T/2. Integer arithmetic keeps
    the switch-on steps exact: 2L t >= (L-1-l) T."""
    return 2 * num_layers * step >= (num_layers - 1 - layer) * total_steps


def exit_curriculum(step: int, total_steps: int, num_layers: int, curriculum: str = "rotational",
                    rotation: int = 1) -> list[bool]:
    """C(t, l) for l = 0..L-1."""
    if not 0 <= step < total_steps:
        raise ValueError(f"step must be in [0, total_steps={total_steps}), got {step}")
    if curriculum == "none":
        return [True] * num_layers
    if curriculum == "rotational":
        return [rotational_curriculum(step, l, num_layers, rotation) for l in range(num_layers)]
    if curriculum == "gradual":
        return [gradual_curriculum(step, l, num_layers, total_steps) for l in range(num_layers)]
    raise ValueError(f"exit curriculum must be one of {EXIT_CURRICULA}, got {curriculum!r}")


def normalised_exit_scales(step: int, total_steps: int, num_layers: int, e_scale: float,
                           curriculum: str = "rotational", rotation: int = 1) -> list[float]:
    """ẽ(t, l) of equation (6): the per-layer weights of the early-exit loss, summing to 1."""
    enabled = exit_curriculum(step, total_steps, num_layers, curriculum, rotation)
    weighted = [e if on else 0.0 for on, e in zip(enabled, exit_loss_scales(num_layers, e_scale))]
    total = sum(weighted)
    if total == 0.0:  # only a 1-layer model: e(0) = L-1 = 0; its one exit is the whole loss
        return [0.0] * (num_layers - 1) + [1.0]
    return [w / total for w in weighted]


def causal_lm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """J_CE the Hugging Face way: position i predicts labels[i+1], labels equal to `ignore_index`
    (and the last position) are skipped, the mean is over the remaining tokens, in fp32.
    logits [B, S, V], labels [B, S]."""
    shifted = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    return F.cross_entropy(logits.float().flatten(0, 1), shifted.flatten().to(logits.device),
                           ignore_index=ignore_index)
