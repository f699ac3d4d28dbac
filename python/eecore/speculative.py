"""Self-speculative decoding (LayerSkip §4.3), batched on the paged engine.

One round per running sequence, all sequences together:
- draft: pass k (k = 0..d) runs the newest token (the pending one, then each draft) through
  layers 0..E-1 only, writing their K/V into the shared paged cache, and stores its layer-E
  hidden state in the exit-query cache; passes k < d also read a draft token off the LM head;
- verify: the d+1 cached layer-E states continue through layers E..L-1 in one varlen pass (query
  length d+1 per sequence); the first E layers never run again for these positions;
- accept: the longest prefix of drafts the full model agrees with, plus the full model's next
  token (greedy), or speculative rejection sampling when sampling, so the output law is the full
  model's. Rejected positions are rolled back by shrinking the sequence (their K/V is simply
  overwritten later).
Sequences may draft different numbers of tokens (tokens left, the adaptive draft threshold):
the verify pass is varlen, so nothing is padded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from eecore.engine.decoding import DecodeStrategy, FullDepthDecoder, Token
from eecore.engine.inputs import Row
from eecore.engine.sampler import Sampler
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import DraftHead, ExitAdapters
from eecore.speculation_guard import SpeculationGuard, break_even_acceptance

BREAK_EVEN = "break-even"  # min_acceptance: the model's bandwidth-bound break-even for E and d


@dataclass
class SelfSpeculativeConfig:
    """Draft `num_speculations` tokens with layers 0..exit_layer-1 and the LM head, then verify
    them with layers exit_layer..L-1 in one pass.

    draft_threshold: adaptive draft length (off by default). A sequence stops drafting early once
    the top-1 probability of its draft falls below this value.

    min_acceptance: the speculation guard (off by default): a sequence whose running acceptance
    rate falls below this value stops drafting, so its rounds cost what a full-depth step costs,
    and drafts again only in probe rounds, at most one per `probe_every` rounds (the wait
    doubling while they fail, up to 128) and only when a near-free check says the probe could
    pass. "break-even" sets it to the acceptance below which drafting loses when decoding is
    bound by reading weights, computed from the model's sizes, E and d. See
    eecore.speculation_guard.
    Drafting pays only above a break-even acceptance that depends on E, d and the hardware (see
    bench/roofline.py for the bandwidth-bound one); below it every draft is a loss.
    """

    exit_layer: int
    num_speculations: int = 4
    draft_threshold: Optional[float] = None
    min_acceptance: Optional[Union[float, str]] = None
    probe_every: int = 8

    def __post_init__(self):
        if not isinstance(self.exit_layer, int) or self.exit_layer < 1:
            raise ValueError(f"SelfSpeculativeConfig: 'exit_layer' must be an int >= 1, got {self.exit_layer!r}")
        if not isinstance(self.num_speculations, int) or self.num_speculations < 1:
            raise ValueError(f"SelfSpeculativeConfig: 'num_speculations' must be an int >= 1, "
                             f"got {self.num_speculations!r}")
        if self.draft_threshold is not None and not 0.0 <= self.draft_threshold <= 1.0:
            raise ValueError(f"SelfSpeculativeConfig: 'draft_threshold' must be in [0, 1], got {self.draft_threshold!r}")
        if self.min_acceptance is not None and self.min_acceptance != BREAK_EVEN and not (
                isinstance(self.min_acceptance, (int, float)) and 0.0 <= self.min_acceptance <= 1.0):
            raise ValueError(f"SelfSpeculativeConfig: 'min_acceptance' must be a number in [0, 1] or "
                             f"{BREAK_EVEN!r}, got {self.min_acceptance!r}")
        if not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"SelfSpeculativeConfig: 'probe_every' must be an int >= 1, got {self.probe_every!r}")

    def validate_for(self, num_layers: int, adapters: Optional[ExitAdapters] = None) -> None:
        if self.exit_layer >= num_layers:
            raise ValueError(f"SelfSpeculativeConfig: 'exit_layer' must be below the model's {num_layers} layers, "
                             f"got {self.exit_layer}")
        if adapters is not None and adapters.blocks and self.exit_layer not in adapters.blocks:
            raise ValueError(f"SelfSpeculativeConfig: 'exit_layer' {self.exit_layer} has no exit adapter; the loaded "
                             f"adapters cover exit layers {adapters.exit_layers()}")




class SelfSpeculativeDecoder(DecodeStrategy):
    def __init__(self, runner, sampler: Sampler, config: SelfSpeculativeConfig,
                 adapters: Optional[ExitAdapters] = None):
        super().__init__(runner, sampler)
        self.config = config
        self.exit_layer = config.exit_layer
        self.num_drafts = config.num_speculations
        self.lookahead = config.num_speculations + 1
        self._plain = FullDepthDecoder(runner, sampler)
        model = runner.model
        rows = runner.builder.max_seqs
        # the exit-query cache: layer-E hidden state of each drafted position, per sequence
        self._exit_states = torch.empty(rows, self.lookahead, model.config.hidden_size, dtype=model.dtype,
                                        device=model.device)
        # reads draft tokens off layer E: the exit adapter and draft vocabulary when there are any
        self.draft_head = DraftHead(model, self.exit_layer, adapters, rows)
        floor = config.min_acceptance
        if floor == BREAK_EVEN:
            floor = break_even_acceptance(model, self.exit_layer, self.num_drafts, self.draft_head.weight_bytes())
        self.guard = None if floor is None else \
            SpeculationGuard(model, rows, floor, config.probe_every, self.draft_head)

    # ---- one round -------------------------------------------------------------------------
    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        allowed = [self.guard is None or self.guard.allows(s) for s in seqs]
        budgets = [max(0, min(self.num_drafts, self._room(s) - 1)) if ok else 0 for s, ok in zip(seqs, allowed)]
        shadowed = [b for b, s in enumerate(seqs) if self.guard is not None and self.guard.wants_shadow(s)]
        if not any(budgets):  # nobody drafts this round (the guard, or last tokens): a plain step
            for seq in seqs:
                self._count(seq, False, 0, 0)
            if not shadowed:
                return self._plain.decode(seqs)
            # the guard's shadow check wants layer-E states: tap them on the way through
            results, logits = self._plain.step(seqs, tap=(self.exit_layer, self._exit_states[: len(seqs), 0]))
            self._record_shadow(seqs, shadowed, shadowed, logits)
            return results
        drafts, draft_probs = self._draft(seqs, budgets)
        logits = self._verify(seqs, drafts)
        results, offsets, offset = [], [], 0
        for seq, seq_drafts, probs, budget in zip(seqs, drafts, draft_probs, budgets):
            n = len(seq_drafts) + 1
            tokens = self._accept(seq, seq_drafts, probs, logits[offset: offset + n])
            offsets.append(offset)
            offset += n
            # positions up to the last accepted draft now hold valid K/V in every layer
            seq.num_computed_tokens += len(tokens)
            self._count(seq, budget > 0, len(seq_drafts), len(tokens) - 1)
            results.append(tokens)
        self._record_shadow(seqs, shadowed, [offsets[b] for b in shadowed], logits)
        return results

    def _record_shadow(self, seqs, rows: list[int], logit_rows: list[int], logits: torch.Tensor) -> None:
        """The shadow check for seqs[b], b in `rows` (sequences that drafted nothing, so slot 0
        of their exit-query cache row is the layer-E state of the position just decoded)."""
        if not rows:
            return
        states = self._exit_states[rows, 0]
        self.guard.record_shadow([seqs[b] for b in rows], states, logits[logit_rows])

    def release(self, seq: Sequence) -> None:
        if self.guard is not None:
            self.guard.release(seq)

    def _room(self, seq: Sequence) -> int:
        """New tokens this sequence may still get (max_tokens and the context both bound it)."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.runner.max_model_len - seq.num_tokens)

    def _draft(self, seqs, budgets):
        E, states = self.exit_layer, self._exit_states
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        newest = [s.last_token_id for s in seqs]
        live = list(range(len(seqs)))  # rows whose newest token still needs its layer-E state
        for k in range(self.num_drafts + 1):
            if not live:
                break
            rows = [Row(seqs[b], seqs[b].num_computed_tokens + k, [newest[b]]) for b in live]
            inputs = self.runner.prepare(rows)
            hidden = self.runner.embed(inputs)
            self.runner.run_layers(hidden, inputs.attn, 0, E)
            if len(live) == len(seqs):
                states[: len(seqs), k].copy_(hidden)
            else:
                states[:, k].index_copy_(0, torch.tensor(live, device=hidden.device), hidden)
            drafting = [j for j, b in enumerate(live) if len(drafts[b]) < budgets[b]]
            if not drafting:
                break
            picked = hidden if len(drafting) == len(live) else \
                hidden.index_select(0, torch.tensor(drafting, device=hidden.device))
            tokens, probs, confident = self._propose(self.draft_head.logits(picked),
                                                     [seqs[live[j]] for j in drafting])
            next_live = []
            for j, token, p, ok in zip(drafting, tokens, probs, confident):
                b = live[j]
                if not ok:  # adaptive draft length: a doubtful draft is dropped, drafting stops
                    continue
                drafts[b].append(token)
                draft_probs[b].append(p)
                newest[b] = token
                next_live.append(b)
            live = next_live
        return drafts, draft_probs

    def _propose(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Draft tokens from layer-E logits: argmax, or a draw from the processed distribution q
        (kept for rejection sampling). `confident` is False where the top-1 probability falls
        below the draft threshold."""
        tokens = logits.argmax(dim=-1)
        probs: list = [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            q = Sampler.probabilities(logits[sampled], [seqs[i].params for i in sampled])
            for j, i in enumerate(sampled):
                tokens[i] = Sampler.draw(q[j], self.sampler.generator_for(seqs[i]))
                probs[i] = q[j]
        threshold = self.config.draft_threshold
        if threshold is None:
            confident = [True] * len(seqs)
        else:
            confident = (torch.softmax(logits, dim=-1).amax(dim=-1) >= threshold).tolist()
        return tokens.tolist(), probs, confident

    def _verify(self, seqs, drafts) -> torch.Tensor:
        """Layers E..L-1 over every drafted position at once, from the exit-query cache."""
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id] + d) for s, d in zip(seqs, drafts)]
        inputs = self.runner.prepare(rows)
        B, width = len(seqs), self.lookahead
        flat = self._exit_states[:B].view(B * width, -1)
        if all(len(d) + 1 == width for d in drafts):
            hidden = flat
        else:
            index = [b * width + k for b, d in enumerate(drafts) for k in range(len(d) + 1)]
            hidden = flat.index_select(0, torch.tensor(index, device=flat.device))
        self.runner.run_layers(hidden, inputs.attn, self.exit_layer, self.num_layers)
        return self.runner.logits(hidden)

    def _accept(self, seq: Sequence, drafts: list[int], draft_probs, logits: torch.Tensor) -> list[Token]:
        """The tokens this round adds: accepted drafts, then the full model's own token."""
        L, k = self.num_layers, seq.params.logprobs
        if seq.params.greedy:
            target = logits.argmax(dim=-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            tokens = drafts[:accepted] + [target[accepted]]
        else:
            tokens = self._rejection_sample(seq, drafts, draft_probs, logits)
        return [Token(t, L, Sampler.logprobs(logits[i], t, k) if k is not None else None)
                for i, t in enumerate(tokens)]

    def _rejection_sample(self, seq, drafts, draft_probs, logits) -> list[int]:
        """Speculative sampling: accept draft y with prob min(1, p(y)/q(y)); on rejection draw
        from normalize(max(p - q, 0)); after d acceptances draw the bonus token from p."""
        generator = self.sampler.generator_for(seq)
        p = Sampler.probabilities(logits, [seq.params] * logits.shape[0])
        tokens = []
        for i, (y, q) in enumerate(zip(drafts, draft_probs)):
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * float(q[y]) < float(p[i, y]):
                tokens.append(y)
                continue
            residual = (p[i] - q).clamp_(min=0)
            total = float(residual.sum())
            tokens.append(Sampler.draw(residual / total if total > 0 else p[i], generator))
            return tokens
        tokens.append(Sampler.draw(p[len(drafts)], generator))
        return tokens

    # ---- metrics ---------------------------------------------------------------------------
    def _count(self, seq: Sequence, attempted: bool, drafted: int, accepted: int) -> None:
        if self.guard is not None and attempted:
            self.guard.record_round(seq, drafted, accepted)
        st = seq.stats
        st["spec_drafted"] = st.get("spec_drafted", 0) + drafted
        st["spec_accepted"] = st.get("spec_accepted", 0) + min(accepted, drafted)
        st["spec_steps"] = st.get("spec_steps", 0) + 1
        st["spec_emitted"] = st.get("spec_emitted", 0) + accepted + 1

    def metrics(self, seq: Sequence) -> dict[str, float]:
        st = seq.stats
        if not st.get("spec_steps"):
            return {}
        return {"acceptance_rate": st["spec_accepted"] / max(st["spec_drafted"], 1),
                "mean_accepted_tokens_per_step": st["spec_emitted"] / st["spec_steps"],
                "num_verify_steps": st["spec_steps"], "num_drafted_tokens": st["spec_drafted"]}
