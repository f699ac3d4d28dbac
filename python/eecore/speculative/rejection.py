"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accepting drafts so that
the tokens emitted follow the full model's law whatever the drafts were.

Draft y_i, drawn from the draft's distribution q_i, is accepted with probability
min(1, p_i(y_i) / q_i(y_i)), where p_i is the full model's distribution at that position; at the
first rejection the token is drawn from normalize(max(p_i - q_i, 0)) and the round ends; after d
acceptances a bonus token is drawn from p_{d+1}. A prompt-lookup draft is a deterministic proposal
(q one-hot at y): it is accepted with probability p(y), and a rejection draws from p with y removed.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from eecore.engine.sampler import Sampler


def rejection_sample(drafts: Sequence[int], draft_probs: Sequence[Optional[torch.Tensor]], p: torch.Tensor,
                     generator: Optional[torch.Generator]) -> list[int]:
    """The tokens a round emits: the accepted drafts, then one drawn token. `draft_probs[i]` is q_i
    over the vocabulary (None: a lookup draft), `p` the full model's distributions `[d + 1, V]`
    after the pending token and each draft."""
    tokens = []
    for i, (y, q) in enumerate(zip(drafts, draft_probs)):
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * (1.0 if q is None else float(q[y])) < float(p[i, y]):
            tokens.append(y)
            continue
        if q is None:
            residual = p[i].clone()
            residual[y] = 0.0
        else:
            residual = (p[i] - q).clamp_(min=0)
        total = float(residual.sum())
        tokens.append(Sampler.draw(residual / total if total > 0 else p[i], generator))
        return tokens
    tokens.append(Sampler.draw(p[len(drafts)], generator))
    return tokens
