"""The learned exit decision's core: "will full depth emit this early token?" as a logistic
regression on five inputs, shared by the two places that read it.

- Self-speculation's layer drafts (`LayerDrafts(exit_measure="agreement")`,
  eecore.speculative.exit_decision): the draft stop rule and unverified exits of the draft copy.
- Algorithm 1's per-layer checks (`EarlyExitConfig(measure="agreement")`, eecore.exits.agreement):
  one regression per checked exit layer, read through both batch rules.

The inputs of a row, in INPUTS' order: the early head's top-1 probability, top-1 minus top-2 and
entropy (over the head's columns: the draft vocabulary where an exit adapter has one), whether
prompt lookup (LOOKUP_NGRAMS, matched over the sequence's prompt and output so far) proposes a
next token, and whether that token is the head's top-1. The distribution alone ranks right and
wrong early tokens only so well; text the sequence already holds is what an early layer rarely gets
wrong where it agrees with it (bench/analysis/exit_decision_ceiling.py has the tables).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

INPUTS = ("top-1 probability", "top-1 minus top-2", "entropy", "lookup has a token", "lookup agrees")
# the n-grams prompt lookup matches for the two lookup inputs (the hybrid preset's)
LOOKUP_NGRAMS = (2, 4)


def distribution_inputs(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first three inputs `[n, 3]`, the top-1 column `[n]`) of the head's probabilities over
    its columns `[n, K]`."""
    top = probs.topk(2, dim=-1)
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
    p1 = top.values[:, 0]
    return torch.stack([p1, p1 - top.values[:, 1], entropy], 1), top.indices[:, 0]


def lookup_inputs(lookup: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The last two inputs `[n, 2]`: `lookup[i]` prompt lookup's next token for row i (-1: none),
    `tokens[i]` the early head's token there."""
    has = lookup >= 0
    return torch.stack([has, has & (lookup == tokens)], 1).float()


@dataclass
class LogisticDecision:
    """sigmoid(((x - mean) / std) . weight + bias) over rows x of INPUTS."""

    mean: list[float]
    std: list[float]
    weight: list[float]
    bias: float

    def __post_init__(self):
        for name in ("mean", "std", "weight"):
            value = getattr(self, name)
            if not isinstance(value, list) or len(value) != len(INPUTS) or \
                    not all(isinstance(v, (int, float)) for v in value):
                raise ValueError(f"{type(self).__name__}: {name!r} must hold {len(INPUTS)} numbers "
                                 f"({', '.join(INPUTS)}), got {value!r}")
        if any(v <= 0 for v in self.std):
            raise ValueError(f"{type(self).__name__}: 'std' must be positive, got {self.std!r}")
        if not isinstance(self.bias, (int, float)) or isinstance(self.bias, bool) or \
                not all(math.isfinite(v) for v in (*self.mean, *self.std, *self.weight, self.bias)):
            raise ValueError(f"{type(self).__name__}: the coefficients must be finite numbers, got bias "
                             f"{self.bias!r}")
        self._tensors: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def probability(self, inputs: torch.Tensor) -> torch.Tensor:
        """P(full depth emits the early token) per row of `inputs` `[n, 5]` (fp32 `[n]`)."""
        tensors = self._tensors.get(inputs.device)
        if tensors is None:
            tensors = self._tensors[inputs.device] = tuple(
                torch.tensor(v, dtype=torch.float32, device=inputs.device) for v in (self.mean, self.std, self.weight))
        mean, std, weight = tensors
        z = (inputs.float() - mean) / std
        return torch.sigmoid(z @ weight + self.bias)

    def coefficients(self) -> dict:
        return dict(mean=list(self.mean), std=list(self.std), weight=list(self.weight), bias=self.bias)


def fit_logistic(x: torch.Tensor, y: torch.Tensor, weight_decay: float = 1e-4) -> LogisticDecision:
    """The regression predicting `y` (1: full depth agreed) from rows `x` of INPUTS: the binary
    cross-entropy of the normalized inputs plus `weight_decay` / 2 times the squared weights,
    minimized over the whole set by L-BFGS (convex: the optimum, whatever the data's size)."""
    if x.ndim != 2 or x.shape[1] != len(INPUTS) or y.shape != (x.shape[0],) or x.shape[0] < 2:
        raise ValueError(f"fit_logistic: expected x [n >= 2, {len(INPUTS)}] and y [n], got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    mean, std, weight, bias = _fit_linear(x.double(), y.double(), weight_decay)
    return LogisticDecision(mean=mean.tolist(), std=std.tolist(), weight=weight.tolist(), bias=bias)


def _normalization(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.mean(0), x.std(0) + 1e-6


def _fit_linear(x: torch.Tensor, y: torch.Tensor, weight_decay: float):
    mean, std = _normalization(x)
    xn = (x - mean) / std
    w = torch.zeros(x.shape[1], dtype=x.dtype, requires_grad=True)
    b = torch.zeros((), dtype=x.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(xn @ w + b, y) + 0.5 * weight_decay * (w * w).sum()
        value.backward()
        return value

    opt.step(loss)
    return mean, std, w.detach(), b.item()


def fit_scorer(x: torch.Tensor, y: torch.Tensor, hidden: int = 0, epochs: int = 40, weight_decay: float = 1e-4,
               seed: int = 0):
    """For analysis over any inputs: a logistic regression fit as fit_logistic does or, with
    `hidden`, a one-hidden-layer MLP of that many units (Adam, `epochs` over mini-batches of 1,024);
    returns a function giving the logit of new rows."""
    if not hidden:
        mean, std, weight, bias = _fit_linear(x.double(), y.double(), weight_decay)
        return lambda z: (((z.double() - mean) / std) @ weight + bias).float()
    torch.manual_seed(seed)
    mean, std = _normalization(x)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=weight_decay)
    xn = (x - mean) / std
    for _ in range(epochs):
        order = torch.randperm(len(xn))
        for i in range(0, len(xn), 1024):
            batch = order[i:i + 1024]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(net(xn[batch]).squeeze(-1), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()

    def score(z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return net((z - mean) / std).squeeze(-1)
    return score


def optional_lookup(proposal: Optional[list[int]]) -> int:
    """Prompt lookup's one-token proposal as an input id (-1: none)."""
    return proposal[0] if proposal else -1
