"""Self-speculative decoding (LayerSkip §4.3) with layer and prompt-lookup drafts, batched on the
paged engine. A round, for every running sequence at once:

1. propose: a prompt-lookup draft where the sequence has an n-gram match (`draft="lookup"` or
   `"hybrid"`; eecore.text.ngram_index), else a layer draft from one of the proposers of
   eecore.speculative.proposers (the model's own layers 0..E-1, a separate copy of them, or both
   sources switched per token), each drafted token picked off the draft head by
   eecore.speculative.draft.DraftPicker;
2. verify: one varlen pass over every sequence's pending token and drafts
   (eecore.speculative.verification), continuing from the exit-query cache for shared layer drafts;
3. accept: the longest agreed prefix plus the model's own token, or rejection sampling
   (eecore.speculative.acceptance);
4. record: the metrics, the guard's and the draft-length rule's view of the round
   (eecore.speculative.stats).

Sequences may draft different numbers of tokens, from different sources: every pass is varlen, so
nothing is padded. A round in which nobody drafts is a plain full-depth step.

With `LayerDrafts.exit_threshold` set, a layer-drafting sequence's leading drafts that are at least
that threshold sure skip the accept step: they are emitted as early exits at layer E, and only
the rows after them are accepted as usual. The verify pass still runs over every drafted position,
which is what writes the exits' exact K/V in the later layers (deferred K/V, where the seed paper's
early exit fills it from the exit's state); only the rows after the exits go through the LM head.

The guard (eecore.speculative.guard) gates layer drafts only. A lookup draft reads no weights: when
decoding is bound by reading weights, verifying d+1 tokens costs what decoding 1 costs, so its
bandwidth-bound break-even acceptance is 0 and a wrong lookup draft costs only the extra compute
of its rows.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from eecore.engine.decoding import DecodeStrategy, FullDepthDecoder, Token
from eecore.engine.inputs import Row
from eecore.engine.sampler import Sampler
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import DraftHead, ExitAdapters
from eecore.speculative.acceptance import Acceptor
from eecore.speculative.config import BREAK_EVEN, SelfSpeculativeConfig
from eecore.speculative.draft import Draft, DraftPicker
from eecore.speculative.draft_length import DraftLength
from eecore.speculative.draft_planner import DraftPlan, DraftPlanner
from eecore.speculative.draft_stack import DraftStack
from eecore.speculative.exit_decision import agreement_measure
from eecore.speculative.guard import SpeculationGuard, break_even_acceptance
from eecore.speculative.proposers import CopyProposer, SharedLayerProposer, TokenSwitchProposer
from eecore.speculative.static_passes import maybe_static_layerskip
from eecore.speculative.stats import RoundRecorder
from eecore.speculative.token_tree import tree_row
from eecore.speculative.verification import Verifier, VerifyAhead, logit_rows
from eecore.text.ngram_index import PromptLookup


class SelfSpeculativeDecoder(DecodeStrategy):
    def __init__(self, runner, sampler: Sampler, config: SelfSpeculativeConfig,
                 adapters: Optional[ExitAdapters] = None, draft_model=None):
        """`draft_model`: with a draft copy (`config.layer.copy`), the copy of layers 0..E-1 that
        drafts (eecore.speculative.draft_stack.build_draft_model)."""
        super().__init__(runner, sampler)
        self.config = config
        self.num_drafts = config.num_speculations
        self.layer_drafts = config.layer_draft_length
        self.lookahead = config.verify_width  # KV slots a round may write per sequence
        self.top_k = config.top_k
        self._plain = FullDepthDecoder(runner, sampler)
        # its steps alternate with rounds, and a step launched ahead that a round follows is lost:
        # each plain step launches ahead only where the next is likely plain too (_plain_ahead)
        self._plain.allow_ahead = False
        self.plain_above = config.plain_above
        self.layers_above = config.layers_above  # more decoding: lookup drafts alone
        rows = runner.max_seqs
        self.lookup = PromptLookup(config.lookup.min_ngram, config.lookup.max_ngram) if config.uses_lookup else None
        # lookup-only: no layer drafts, so no exit-query cache, draft head or guard
        self.exit_layer = config.exit_layer
        self.draft_head = self.guard = self._exit_states = self.draft_stack = self.draft_length = None
        self.measure = None
        self._static_drafts = self._static_exit_verify = None  # LayerSkip's passes as CUDA graphs
        self.picker = self.proposer = None
        if config.uses_layers:
            self._build_layer_drafts(config, runner, sampler, adapters, draft_model, rows)
        # config.adaptive: each sequence's draft lengths from the measured pass costs
        self.planner = DraftPlanner(self.layer_drafts, self.num_drafts if self.lookup is not None else 0) \
            if config.adaptive else None
        self._round_captures = 0  # graphs recorded before this round (_clock_round)
        self.verifier = Verifier(runner, self.exit_layer, self._exit_states, self._static_exit_verify)
        self.acceptor = Acceptor(runner, sampler, self.num_layers, self.exit_layer, self.draft_stack)
        self.recorder = RoundRecorder(self.guard, self.draft_length, lookup=self.lookup is not None,
                                      layers=self.draft_head is not None, trees=self.top_k > 1)

    def _build_layer_drafts(self, config, runner, sampler, adapters, draft_model, rows: int) -> None:
        model = runner.model
        layer = config.layer
        if layer.long_draft_acceptance is not None:
            self.draft_length = DraftLength(layer.long_draft_acceptance)
        if config.separate_draft_layers != (draft_model is not None):
            raise ValueError("SelfSpeculativeDecoder: a draft model goes with a draft copy (LayerDrafts.copy), and only there")
        if draft_model is not None:
            self.draft_stack = DraftStack(draft_model, runner, adapters, self.exit_layer)
            self.draft_head = self.draft_stack.head
        else:
            # the exit-query cache: layer-E hidden state of each drafted position, per sequence (zeros:
            # a static verify pass also runs the positions past a sequence's drafts)
            self._exit_states = torch.zeros(rows, self.lookahead, model.config.hidden_size, dtype=model.dtype,
                                            device=model.device)
            self._static_drafts, self._static_exit_verify = maybe_static_layerskip(
                runner, rows, self.exit_layer, self.lookahead, self._exit_states)
            # reads draft tokens off layer E: the exit adapter and draft vocabulary when there are any
            self.draft_head = DraftHead(model, self.exit_layer, adapters, rows)
        floor = None if layer.guard is None else layer.guard.min_acceptance
        if floor == BREAK_EVEN:
            floor = break_even_acceptance(
                model, self.exit_layer, self.layer_drafts, self.draft_head.weight_bytes(),
                None if self.draft_stack is None else self.draft_stack.weight_bytes())
        self.guard = None if floor is None else \
            SpeculationGuard(model, rows, floor, layer.guard.probe_every, self.draft_head)
        self.measure = None if layer.exit_measure is None else agreement_measure(
            getattr(adapters, "source", None), self.lookup,
            *(() if layer.exit_measure == "agreement" else (layer.exit_measure,)))
        self.picker = DraftPicker(config, self.draft_head, sampler, self.draft_length, self.measure)
        if config.switches_per_token:
            self.proposer = TokenSwitchProposer(self.draft_stack, self.picker, self.lookup)
        elif self.draft_stack is not None:
            self.proposer = CopyProposer(self.draft_stack, self.picker, self.layer_drafts)
        else:
            self.proposer = SharedLayerProposer(runner, self.picker, self.exit_layer, self.num_drafts,
                                                self._exit_states, self._static_drafts)

    # ---- one round: propose, verify, accept, record ------------------------------------------
    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        start = time.perf_counter()
        self._round_captures = self._captures()
        rooms = self._rooms(seqs)
        budgets = [max(0, min(self.num_drafts, room - 1)) for room in rooms]
        layers = self.draft_head is not None and (self.layers_above is None or len(seqs) <= self.layers_above)
        plans = self._plans(seqs, budgets, rooms)
        if self.config.switches_per_token:
            return self._token_switch_round(seqs, budgets, layers, plans, start)
        if self.guard is None and not any(p.lookup or p.layer for p in plans):
            return self._plain_round(seqs, [], start)  # planned out: nobody drafts
        drafts = [Draft() for _ in seqs]
        if self.lookup is not None:
            for seq, draft, plan in zip(seqs, drafts, plans):
                if plan.lookup:
                    draft.add_lookup(self.lookup.propose(seq, plan.lookup))
        layer_budgets, shadowed = self._layer_budgets(seqs, drafts, [p.layer for p in plans], layers)
        if not any(layer_budgets) and not any(drafts):
            return self._plain_round(seqs, shadowed, start)  # no match, the guard, or last tokens
        for draft, n in zip(drafts, layer_budgets):
            draft.layer_turn = n > 0
        ahead = VerifyAhead.for_round(self.runner.static_verify, seqs, drafts) \
            if any(layer_budgets) and self.proposer.verifies_ahead and not shadowed else None
        if ahead is not None:
            drafting = self._draft_passes(lambda: self.proposer.propose(seqs, drafts, layer_budgets, ahead), ahead)
        else:
            drafting = self._draft_passes(lambda: self.proposer.propose(seqs, drafts, layer_budgets)) \
                if any(layer_budgets) else 0.0
        if ahead is not None and ahead.logits is not None:  # launched behind the chain: every row at full width
            widths, logits, verified = [ahead.static.width] * len(seqs), ahead.logits, ahead.rows_verified
        elif any(layer_budgets) and self.proposer.verifies_from_exit_states:
            widths = [len(d) + 1 for d in drafts]
            logits = self.verifier.from_exit_states(seqs, drafts, logit_rows(widths, drafts))
            verified = sum(widths)
        else:  # lookup drafts or a separate copy's: one varlen pass through every layer
            rows = [tree_row(s, d.tokens, d.alternatives) for s, d in zip(seqs, drafts)]
            widths = [len(row.tokens) for row in rows]
            logits = self.verifier.full(rows, shadowed, logit_rows(widths, drafts))
            verified = sum(widths)
        results, offsets = self._accept(seqs, drafts, widths, logits)
        self._record_shadow(seqs, shadowed, [offsets[b] for b in shadowed], logits)
        self._clock_round(verified, len(seqs), start, drafting)
        return results

    def _plans(self, seqs: list[Sequence], budgets: list[int], rooms: list[int]) -> list[DraftPlan]:
        """Each sequence's caps this round: the planner's (config.adaptive), else the config's."""
        if self.planner is None:
            return [DraftPlan(lookup=n, layer=min(n, self.layer_drafts)) for n in budgets]
        self.planner.new_round()
        stack = self.draft_stack
        behinds = [0] * len(seqs) if stack is None else stack.behind_all(seqs)
        return self.planner.plan_all(seqs, len(seqs), budgets, rooms, behinds)

    def _draft_passes(self, propose, ahead: Optional[VerifyAhead] = None) -> float:
        """Runs `propose` (a proposer's draft passes); returns its seconds. The planner's clock
        learns what one pass costs from rounds whose passes ran one token per sequence: a pass that
        catches the copy up on a prompt or on plain rounds' tokens is the price of starting to
        draft, not of a draft. `ahead`: the verify pass the passes launched (VerifyAhead.seconds is
        its share of their time)."""
        if self.planner is None:
            propose()
            return 0.0
        stack, clock = self.draft_stack, self.planner.clock
        passes, caught_up, begin = self.proposer.passes, stack.catch_up_tokens if stack else 0, time.perf_counter()
        propose()
        seconds = time.perf_counter() - begin - (0.0 if ahead is None else ahead.seconds)
        passes, caught_up = self.proposer.passes - passes, (stack.catch_up_tokens if stack else 0) - caught_up
        if self._captures() != self._round_captures:  # a pass recorded its graph: a one-time cost
            return seconds
        if caught_up:
            clock.record_catch_up(passes, caught_up, seconds)
        else:
            clock.record_copy(passes, seconds)
        return seconds

    def _clock_round(self, rows: int, batch: int, start: float, drafting: float) -> None:
        """The round's time less its draft passes: what verifying `rows` rows of `batch` sequences cost
        (not learned from a round in which a pass recorded its CUDA graph: on a GPU the first round
        of each shape)."""
        if self.planner is not None and self._captures() == self._round_captures:
            self.planner.clock.record_verify(rows, time.perf_counter() - start - drafting, batch)

    def _captures(self) -> int:
        """CUDA graphs recorded so far by the passes a round may run (engine.static_decode)."""
        runner = self.runner
        passes = (runner.static_decode, runner.static_verify, self._static_drafts, self._static_exit_verify,
                  None if self.draft_stack is None else self.draft_stack.static)
        return sum(p.captures for p in passes if p is not None)

    def _layer_budgets(self, seqs, drafts: list[Draft], budgets: list[int], layers: bool):
        """Layer drafts for sequences without a lookup draft, as far as the guard allows (the guard
        sees only the rounds in which a sequence could draft with the layers); and the sequences the
        guard wants to shadow-check instead."""
        layer_budgets, shadowed = [0] * len(seqs), []
        if not layers:
            return layer_budgets, shadowed
        for b, seq in enumerate(seqs):
            if drafts[b]:
                continue
            if self.guard is None or self.guard.allows(seq):
                layer_budgets[b] = budgets[b]
            elif self.guard.wants_shadow(seq) and self.draft_stack is None:
                shadowed.append(b)  # (separate draft layers have no layer-E state to check)
        return layer_budgets, shadowed

    def _plain_round(self, seqs: list[Sequence], shadowed: list[int], start: float) -> list[list[Token]]:
        self.recorder.plain(seqs)
        if not shadowed:
            self._plain.allow_ahead = self._plain_ahead()
            results = self._plain.decode(seqs)
        else:
            # the guard's shadow check wants layer-E states: tap them on the way through
            results, logits = self._plain.step(seqs, tap=(self.exit_layer, self._exit_states[: len(seqs), 0]))
            self._record_shadow(seqs, shadowed, shadowed, logits)
        self._clock_round(len(seqs), len(seqs), start, 0.0)
        return results

    def _plain_ahead(self) -> bool:
        """Whether a plain round's step may launch the next one ahead (decode ahead, on a GPU): where
        the planner has turned drafting off (the copy's drafts fail, or rounds cost more than they
        emit, as when the host's share of a round outweighs the GPU's at large batches) and no
        sequence's probe falls due, so that the next round is plain too. Not with prompt lookup,
        whose matches come and go with the text, nor with the guard, which shadow-checks plain
        steps; a step launched ahead that a drafting round follows is work lost (the next plain
        step does not take it: its sequences moved on)."""
        return self.planner is not None and self.lookup is None and self.guard is None and self.planner.all_quiet

    def _token_switch_round(self, seqs: list[Sequence], budgets: list[int], layers: bool, plans: list[DraftPlan],
                            start: float) -> list[list[Token]]:
        """hybrid_switch="token": drafts from TokenSwitchProposer, verified by one full-depth pass."""
        passes = [plan.layer if layers and (self.guard is None or self.guard.allows(s)) else 0
                  for s, plan in zip(seqs, plans)]
        budgets = [min(n, max(plan.lookup, plan.layer)) for n, plan in zip(budgets, plans)]
        drafts = []
        drafting = self._draft_passes(lambda: drafts.extend(self.proposer.propose(seqs, budgets, passes)))
        if not any(drafts):  # no match, and no copy token sure enough: a plain step
            starts = [s.num_computed_tokens for s in seqs]
            results = self._plain.decode(seqs)
            for seq, draft, begin in zip(seqs, drafts, starts):
                self.recorder.record(seq, None, 0, layer_turn=draft.copy_ran)  # a copy pass at rate 0
                if self.planner is not None:
                    self.planner.record(seq, draft, 0)
                if draft.copy_ran:  # the copy's K/V of the pending token is right
                    self.draft_stack.settle(seq, begin + 1)
            self._clock_round(len(seqs), len(seqs), start, drafting)
            return results
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id] + d.tokens) for s, d in zip(seqs, drafts)]
        logits = self.verifier.full(rows)
        results = self._accept(seqs, drafts, [len(r.tokens) for r in rows], logits)[0]
        self._clock_round(sum(len(r.tokens) for r in rows), len(seqs), start, drafting)
        return results

    def _accept(self, seqs, drafts: list[Draft], widths: list[int], logits: torch.Tensor):
        accepted, offsets = self.acceptor.accept_all(seqs, drafts, widths, logits)
        for seq, draft, a in zip(seqs, drafts, accepted):
            self.recorder.record(seq, draft, a.drafts_accepted, a.alternative_accepted)
            if self.planner is not None:
                self.planner.record(seq, draft, a.drafts_accepted)
        return [a.tokens for a in accepted], offsets

    # ---- plain steps: more sequences decode than disable_by_batch_size ----------------------
    def decode_plain(self, seqs: list[Sequence]) -> list[list[Token]]:
        """More sequences decode than drafting allows: while they do, every step is plain, so each
        launches the next ahead (a batch that shrinks below the limit loses one)."""
        self.recorder.plain(seqs)
        self._plain.allow_ahead = True
        return self._plain.decode(seqs)

    def decode_mixed(self, seqs: list[Sequence], prefill_rows: list[Row]):
        self.recorder.plain(seqs)
        return self._plain.decode_mixed(seqs, prefill_rows)

    def _record_shadow(self, seqs, rows: list[int], rows_in_logits: list[int], logits: torch.Tensor) -> None:
        """The shadow check for seqs[b], b in `rows` (sequences that drafted nothing, so slot 0
        of their exit-query cache row is the layer-E state of the position just decoded)."""
        if not rows:
            return
        states = self._exit_states[rows, 0]
        self.guard.record_shadow([seqs[b] for b in rows], states, logits[rows_in_logits])

    def use_blocks(self, blocks) -> None:
        self._plain.use_blocks(blocks)

    def release(self, seq: Sequence) -> None:
        for part in (self.guard, self.draft_length, self.lookup, self.draft_stack, self.planner, self.measure):
            if part is not None:
                part.release(seq)

    def _rooms(self, seqs: list[Sequence]) -> list[int]:
        """New tokens each sequence may still get (max_tokens and the context both bound it)."""
        longest = self.runner.max_model_len
        return [min(s.params.max_tokens - s.num_output_tokens, longest - s.num_tokens) for s in seqs]

    def metrics(self, seq: Sequence) -> dict[str, float]:
        return self.recorder.metrics(seq)

