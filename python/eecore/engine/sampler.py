"""Turns logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Greedy rows take an argmax. Sampled rows draw by inverting their distribution's cumulative sum at
one uniform number per row (torch.multinomial's method): each request with a seed owns a generator
that gives its row that number, so its samples do not depend on what else shares the batch. A
step's sampled rows are drawn together in a few tensor operations, and top-k / top-p look only at
the most likely tokens (`torch.topk`), never sorting the vocabulary: on a CPU, sorting SmolLM2's
49,152 logits took 3.6 ms a row and an exponential race over them ~1 ms, several times a decode
step of the model itself.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from eecore import envs, ops
from eecore.engine.sequence import Sequence
from eecore.engine.transfer import device_tensor, read_back
from eecore.sampling_params import SamplingParams

# A top-p row without top-k first looks for its nucleus among this many of its most likely tokens,
# then among this many times more, then in the whole vocabulary sorted: a model's nucleus is
# usually a few tokens, and topk costs little at small k (a row of 49,152 on a Zen 4 core: 94 us at
# 64, 518 at 1,024, 3.6 ms to sort).
FIRST_NUCLEUS_CANDIDATES = 64
NUCLEUS_GROWTH = 16


# Rows on a GPU take eecore's argmax op rather than ATen's max over a dim: on an H200 it took 6-13
# against 12-27 us a call (SmolLM2's and Llama-1B's vocabularies, 1-8 rows; bench/cuda_row_kernels.py)
# with ATen's tokens. EECORE_ARGMAX_KERNEL=aten selects ATen's.
def eecore_argmax_selected() -> bool:
    return envs.value("EECORE_ARGMAX_KERNEL") != "aten"


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first maximal index, NaN counting as maximal, as `argmax`): a share of
    every greedy step and verify pass. fp32 rows on the CPU go through numpy's vectorised argmax:
    one row of SmolLM2's 49,152 logits in 7 against 92 us for torch's `max` over the dim, 8 rows in
    34 against 339 (Zen 4; 2% of a decode step at 200 tok/s). Rows on a GPU take eecore's argmax
    op (above). Elsewhere torch's
    `max` over a dim, which finds it 2-4x faster than `argmax` (16 rows in 183 against 620 us in
    fp32, 318 against 1,403 in bf16, on an Intel Xeon, 2 threads)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))  # a row: a 0-d tensor
    if logits.device.type == "cuda" and logits.dim() == 2 and logits.stride(-1) == 1 and eecore_argmax_selected():
        return ops.argmax(logits)
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self._engine_generator = torch.Generator(device=device)
        self._engine_generator.manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}

    def generator_for(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self._engine_generator
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seq.params.seed)
            self._generators[seq.seq_id] = g
        return g

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[Optional[dict[int, float]]]]:
        """logits fp32 [B, V], one row per sequence -> (token ids, logprobs dicts or None)."""
        tokens = argmax_rows(logits)
        self.draw_sampled(logits, seqs, tokens)
        token_list = tokens.tolist()
        logprobs: list[Optional[dict[int, float]]] = [None] * len(seqs)
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if wanted:
            rows = logits if len(wanted) == len(seqs) else logits[wanted]
            dicts = logprobs_rows(rows, [token_list[i] for i in wanted], [seqs[i].params.logprobs for i in wanted])
            for i, d in zip(wanted, dicts):
                logprobs[i] = d
        return token_list, logprobs

    def draw_sampled(self, logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """Writes the sampled sequences' draws over their rows of `tokens [B]` (the argmax of
        `logits [B, V]`), in place; reads the device only for top-p rows without top-k (how far
        their nucleus search goes)."""
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return
        every = len(sampled) == len(seqs)
        index = None if every else device_tensor(sampled, logits.device)
        picked = draw_rows(logits if every else logits.index_select(0, index), [seqs[i].params for i in sampled],
                           self.uniforms([seqs[i] for i in sampled]))
        if every:
            tokens.copy_(picked)
        else:
            tokens.index_copy_(0, index.to(tokens.device), picked.to(tokens.device))

    def draw_own(self, logits_row: torch.Tensor, seq: Sequence) -> int:
        """seq's token from one row of the full model's logits `[1, V]`, drawn as a decode step draws
        it (draw_rows, at one number from its generator). Speculative rounds draw their last token
        so: the same distribution as a draw from `probabilities`, but top-k and top-p rows map a
        number to their candidates in rank order, not in vocabulary order, so a seeded sequence that
        drafts nothing keeps the tokens its seed gives it in plain steps whatever the round around it."""
        return int(draw_rows(logits_row, [seq.params], self.uniforms([seq]))[0])

    def uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One uniform number in [0, 1) per sequence, `[n]` fp32 on the device: a seeded sequence's from
        its own generator, the others' from the engine's in one draw."""
        unseeded = [j for j, s in enumerate(seqs) if s.params.seed is None]
        if len(unseeded) == len(seqs):
            return torch.rand(len(seqs), generator=self._engine_generator, device=self.device)
        u = torch.empty(len(seqs), device=self.device)
        if unseeded:
            u.index_copy_(0, device_tensor(unseeded, self.device),
                          torch.rand(len(unseeded), generator=self._engine_generator, device=self.device))
        for j, s in enumerate(seqs):
            if s.params.seed is not None:
                u[j] = torch.rand((), generator=self.generator_for(s), device=self.device)
        return u

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each sampled row draws from, `[n, V]`: temperature, then top-k, then top-p
        (the smallest set of most likely tokens whose mass reaches top_p, renormalized)."""
        probs = None
        for rows, weights, ids in _candidate_groups(logits, params):
            if ids is None and len(rows) == logits.shape[0]:
                return weights
            if probs is None:
                probs = torch.zeros(logits.shape, dtype=weights.dtype, device=logits.device)
            index = device_tensor(rows, logits.device)
            if ids is not None:  # the kept tokens' weights, renormalized, in their places
                weights = torch.zeros_like(probs[index]).scatter_(-1, ids, weights / weights.sum(dim=-1, keepdim=True))
            probs[index] = weights
        return probs

    @staticmethod
    def probe(params: SamplingParams, vocab_size: int) -> None:
        """A request's own sampling code (its draw, seed, log-probabilities) run once on dummy logits
        of `vocab_size`, through the functions a step calls, with numbers of its own (the engine's
        generator untouched): what raises here for one request would raise in a step for all
        (LLMEngine.recover_from_failed_step)."""
        logits = torch.zeros(1, vocab_size)
        if not params.greedy:
            generator = torch.Generator()
            draw_rows(logits, [params], torch.rand(1, generator=generator))  # a step's draws
            Sampler.draw(Sampler.probabilities(logits, [params])[0], generator)  # rejection sampling's
        if params.seed is not None:
            torch.Generator().manual_seed(params.seed)
        if params.logprobs is not None:
            logprobs_rows(logits, [0], [params.logprobs])

    @staticmethod
    def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
        """A draw from `probs [V]` (weights: they need not sum to 1) with one number from `generator`."""
        u = torch.rand(1, generator=generator, device=probs.device)
        return int(invert_cdf(probs[None], u)[0])

    @staticmethod
    def logprobs(logits_row: torch.Tensor, token: int, k: int) -> dict[int, float]:
        """Log-probabilities (of the model's distribution) of the top-k tokens and the chosen one."""
        return logprobs_rows(logits_row[None], [token], [k])[0]


def draw_rows(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits [n, V]` under each row's sampling parameters, at the row's
    uniform number `u [n]`; int64 `[n]` on the logits' device."""
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for rows, weights, ids in _candidate_groups(logits, params):
        if len(rows) == logits.shape[0]:
            picked = invert_cdf(weights, u)
            return picked if ids is None else ids.gather(-1, picked[:, None])[:, 0]
        index = device_tensor(rows, logits.device)
        picked = invert_cdf(weights, u[index])
        tokens[index] = picked if ids is None else ids.gather(-1, picked[:, None])[:, 0]
    return tokens


def invert_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative `weights [n, K]`, the index where the cumulative sum first exceeds
    u times the row's total (`u [n]` in [0, 1)): a draw proportional to the weights that never picks
    a zero weight."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u * total may round up to total, where the search would run past the last nonzero weight
    x = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)


def _candidate_groups(logits: torch.Tensor, params: list[SamplingParams]
                      ) -> list[tuple[list[int], torch.Tensor, Optional[torch.Tensor]]]:
    """The rows of `logits [n, V]` in groups `(rows, weights [r, K], ids [r, K] or None)`: each row's
    tokens that can be drawn, with weights proportional to their probability (zero for a token top-k
    or top-p drops); `ids` None means the whole vocabulary in order."""
    n, V = logits.shape
    temps = device_tensor([p.temperature for p in params], logits.device)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    top_k = [min(p.top_k, V) if p.top_k > 0 else V for p in params]
    whole = [i for i, p in enumerate(params) if top_k[i] == V and p.top_p >= 1.0]
    ranked = [i for i in range(n) if top_k[i] < V]  # top-p applies within the top k
    nucleus = [i for i, p in enumerate(params) if top_k[i] == V and p.top_p < 1.0]
    groups = []
    if whole:
        groups.append((whole, probs if len(whole) == n else probs.index_select(0, device_tensor(whole, probs.device)),
                       None))
    if ranked:
        weights, ids, _ = _filter(probs.index_select(0, device_tensor(ranked, probs.device)),
                                  [top_k[i] for i in ranked], [params[i].top_p for i in ranked],
                                  max(top_k[i] for i in ranked))
        groups.append((ranked, weights, ids))
    width = min(FIRST_NUCLEUS_CANDIDATES, V)
    while nucleus:
        top_p = [params[i].top_p for i in nucleus]
        weights, ids, mass = _filter(probs[nucleus], [V] * len(nucleus), top_p, width)
        # the width holds the nucleus when its tokens hold top_p of the mass: the next one is dropped
        covered = [True] * len(nucleus) if width == V else (mass >= mass.new_tensor(top_p)).tolist()
        done = [j for j, c in enumerate(covered) if c]
        if done:
            groups.append(([nucleus[j] for j in done], weights[done], ids[done]))
        nucleus = [nucleus[j] for j, c in enumerate(covered) if not c]
        width = width * NUCLEUS_GROWTH if width * NUCLEUS_GROWTH <= V // 4 else V
    return groups


def _filter(probs: torch.Tensor, top_k: list[int], top_p: list[float], width: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p over each row's `width` most likely tokens: `(weights, ids)` `[r, width]`, and
    the mass `[r]` of those tokens within the top k."""
    V = probs.shape[-1]
    if width <= V // 4:
        values, ids = probs.topk(width, dim=-1)  # most likely first
    else:
        values, ids = (t[:, :width] for t in probs.sort(dim=-1, descending=True))
    k = device_tensor(top_k, probs.device)
    in_k = torch.arange(width, device=probs.device)[None, :] < k[:, None]
    values = values * in_k
    # top-p applies to the top-k distribution renormalized; without top-k, to the model's own
    renormalize = k < V
    mass = values.sum(dim=-1, keepdim=True)
    q = torch.where(renormalize[:, None], values / mass, values)
    before = q.cumsum(dim=-1) - q
    p = device_tensor(top_p, probs.device, probs.dtype)
    keep = in_k & (before < p[:, None])
    keep[:, 0] = True
    return q * keep, ids, mass[:, 0]


def logprobs_rows(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Per row of `logits [n, V]`: the log-probabilities of its top-`ks[i]` tokens and of `tokens[i]`."""
    values, ids, chosen = logprob_tensors(logits, device_tensor(tokens, logits.device), ks)
    return logprob_dicts(*read_back(values, ids, chosen), tokens, ks)


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logprobs_rows`' numbers, left on the device: the top max(ks) log-probabilities of each row and
    their ids `[n, k]`, and the log-probability of `tokens` (int64 `[n]`, on the device) `[n]`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    widest = min(max(ks), lp.shape[-1])
    if widest > 0:
        values, ids = lp.topk(widest, dim=-1)
    else:
        values, ids = lp[:, :0], torch.empty(lp.shape[0], 0, dtype=torch.int64, device=lp.device)
    return values, ids, lp.gather(-1, tokens[:, None])[:, 0]


def logprob_dicts(values: list, ids: list, chosen: list, tokens: list[int], ks: list[int]
                  ) -> list[dict[int, float]]:
    """`logprob_tensors`' results, read back as lists, in one dict a row."""
    out = []
    for ids_row, values_row, value, token, k in zip(ids, values, chosen, tokens, ks):
        d = dict(zip(ids_row[:k], values_row[:k]))
        d[token] = value
        out.append(d)
    return out
