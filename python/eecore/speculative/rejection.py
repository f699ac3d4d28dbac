"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accepting drafts so that
the tokens emitted follow the full model's law whatever the drafts were.

Draft y_i, drawn from the draft's distribution q_i, is accepted with probability
min(1, p_i(y_i) / q_i(y_i)), where p_i is the full model's distribution at that position; at the
first rejection the token is drawn from normalize(max(p_i - q_i, 0)) and the round ends; after d
acceptances a bonus token is drawn from p_{d+1}. A prompt-lookup draft is a deterministic proposal
(q one-hot at y): it is accepted with probability p(y), and a rejection draws from p with y removed.

With token trees (DraftCopy.top_k > 1) a position also has alternatives, drawn from the same q_i
independently of y_i. They are tried in turn after y_i is rejected, each against the residual left
by the tries before it (SpecInfer's multi-step speculative sampling, Miao et al. 2024): with r the
current residual, alternative a is accepted with probability min(1, r(a) / q_i(a)), and otherwise r
becomes normalize(max(r - q_i, 0)). The emitted token still follows p_i; an accepted alternative's
own verify row gives the bonus token.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from eecore.engine.sampler import Sampler
from eecore.speculative.token_tree import TreeAcceptance


def _residual(p: torch.Tensor, q: Optional[torch.Tensor], y: int) -> torch.Tensor:
    """normalize(max(p - q, 0)) after a draft y from q was rejected (q None: y's mass removed); p
    itself where nothing is left (p equal to q, up to rounding)."""
    if q is None:
        residual = p.clone()
        residual[y] = 0.0
    else:
        residual = (p - q).clamp_(min=0)
    total = float(residual.sum())
    return residual / total if total > 0 else p


def _accepts(u: float, target: torch.Tensor, q: Optional[torch.Tensor], y: int) -> bool:
    """Whether draft y from q is accepted against `target` at the uniform number u."""
    return u * (1.0 if q is None else float(q[y])) < float(target[y])


def rejection_sample(chain: Sequence[int], draft_probs: Sequence[Optional[torch.Tensor]], p: torch.Tensor,
                     generator: Optional[torch.Generator],
                     alternatives: Sequence[Sequence[int]] = (),
                     draw_row: Optional[Callable[[int], int]] = None) -> TreeAcceptance:
    """The tokens a round emits, with the verify rows that predicted them: the accepted drafts, then
    one drawn token (after an accepted alternative, two: it and its own row's draw).
    `draft_probs[i]` is q_i over the vocabulary (None: a lookup draft, which has no alternatives),
    `p` the full model's distributions over the round's verify rows in token_tree.tree_row's layout
    (`[d + 1 + alternatives, V]`), `alternatives[i]` the other draws for chain[i]. `draw_row(r)`:
    the full model's own token at verify row r, after every draft before it was accepted (default:
    a draw from p[r] with one number from `generator`); the engine passes a plain step's draw, so
    that a sequence that drafted nothing gets the token a plain step gives its seed."""
    tokens: list[int] = []
    if draw_row is None:
        def draw_row(row: int) -> int:
            return Sampler.draw(p[row], generator)

    def rand() -> float:
        return float(torch.rand((), generator=generator, device=p.device))

    for i, (y, q) in enumerate(zip(chain, draft_probs)):
        if _accepts(rand(), p[i], q, y):
            tokens.append(y)
            continue
        residual = _residual(p[i], q, y)
        alts = alternatives[i] if i < len(alternatives) else ()
        first_leaf = 1 + len(chain) + sum(len(a) for a in alternatives[:i])  # tree_row's layout
        for j, a in enumerate(alts):
            if _accepts(rand(), residual, q, a):
                row = first_leaf + j
                return TreeAcceptance(tokens + [a, draw_row(row)], list(range(i + 1)) + [row],
                                      leaf_row=row, chain_accepted=i)
            residual = _residual(residual, q, a)
        tokens.append(Sampler.draw(residual, generator))
        return TreeAcceptance(tokens, list(range(i + 1)), chain_accepted=i)
    tokens.append(draw_row(len(chain)))
    return TreeAcceptance(tokens, list(range(len(chain) + 1)), chain_accepted=len(chain))
