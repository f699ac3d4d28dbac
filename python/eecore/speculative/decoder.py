"""Self-speculative decoding (LayerSkip §4.3) with layer and prompt-lookup drafts, batched on the
paged engine. A round, for every running sequence at once:

0. plan: the round's budgets per sequence and source (eecore.speculative.policy: the config's caps,
   the draft planner, the acceptance guard);
1. propose: each proposer of eecore.speculative.proposers in turn (prompt lookup first, then layer
   drafts from the model's own layers 0..E-1 or a copy of them, or both sources switched per
   token), within its budgets; layer drafts are picked off the draft head by
   eecore.speculative.draft.DraftPicker;
2. verify: one varlen pass over every sequence's pending token and drafts
   (eecore.speculative.verification), continuing from the exit-query cache for shared layer drafts;
3. accept: the longest agreed prefix plus the model's own token, or rejection sampling
   (eecore.speculative.acceptance);
4. record: the metrics, and the policy's parts' view of the round (the guard, the draft-length
   rule, the planner). What they keep about a sequence is its SequenceState
   (eecore.speculative.state).

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

from eecore import envs
from eecore.engine.decoding import DecodeStrategy, FullDepthDecoder, Token
from eecore.engine.tokens import TokenRun
from eecore.engine.inputs import Row
from eecore.engine.sampler import Sampler
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import DraftHead, ExitAdapters
from eecore.speculative.acceptance import Acceptor
from eecore.speculative.config import BREAK_EVEN, SelfSpeculativeConfig
from eecore.speculative.draft import Draft, DraftPicker
from eecore.speculative.draft_length import DraftLength
from eecore.speculative.draft_stack import DraftStack
from eecore.speculative.exit_decision import agreement_measure
from eecore.speculative.feature_drafts import build_feature_drafts, without_unfit_shipped_head
from eecore.speculative.fused_round import FusedRound
from eecore.speculative.guard import SpeculationGuard, break_even_acceptance
from eecore.speculative.policy import DraftPolicy
from eecore.speculative.proposers import CopyProposer, LookupProposer, Proposer, SharedLayerProposer, TokenSwitchProposer
from eecore.speculative.static_passes import maybe_static_layerskip
from eecore.speculative.state import SequenceStates
from eecore.speculative.token_tree import tree_row
from eecore.speculative.verification import Verifier, VerifyAhead, logit_rows


class SelfSpeculativeDecoder(DecodeStrategy):
    def __init__(self, runner, sampler: Sampler, config: SelfSpeculativeConfig,
                 adapters: Optional[ExitAdapters] = None, draft_model=None):
        """`draft_model`: with a draft copy (`config.layer.copy`), the copy of layers 0..E-1 that
        drafts (eecore.speculative.draft_stack.build_draft_model)."""
        super().__init__(runner, sampler)
        config = without_unfit_shipped_head(config, runner.model)
        self.config = config
        self.num_drafts = config.num_speculations
        self.layer_drafts = config.layer_draft_length
        self.lookahead = config.verify_width  # KV slots a round may write per sequence
        self.top_k = config.top_k
        self._plain = FullDepthDecoder(runner, sampler)
        # its steps alternate with rounds, and a step launched ahead that a round follows is lost:
        # each plain step launches ahead only where the next is likely plain too (DraftPolicy.plain_ahead)
        self._plain.allow_ahead = False
        self.plain_above = config.plain_above
        rows = runner.max_seqs
        self.states = SequenceStates()  # what every part keeps about each sequence
        self.lookup = LookupProposer(config.lookup.min_ngram, config.lookup.max_ngram, self.states) \
            if config.uses_lookup else None
        # lookup-only: no layer drafts, so no exit-query cache, draft head or guard
        self.exit_layer = config.exit_layer
        self.draft_head = self.guard = self._exit_states = self.draft_stack = self.draft_length = None
        self.measure = None
        self._static_drafts = self._static_exit_verify = None  # LayerSkip's passes as CUDA graphs
        self.picker = self.proposer = None
        self.features = None  # feature drafts' proposer (speculative.feature_drafts), which taps every pass
        self._tapped: Optional[torch.Tensor] = None  # the last verify pass's tapped streams (feature drafts)
        if config.uses_layers:
            self._build_layer_drafts(config, runner, sampler, adapters, draft_model, rows)
        if config.uses_feature:  # alone, or beside a copy's layer drafts (the planner picks per sequence)
            head, self.features = build_feature_drafts(config, runner, sampler, self.states)
            if not config.uses_layers:
                self.draft_head, self.proposer, self.picker = head, self.features, self.features.picker
        fuses = envs.flag("EECORE_FUSED_ROUNDS") and self._fuses(config)
        self.policy = DraftPolicy(config, self.states, layers=self.draft_head is not None, guard=self.guard,
                                  draft_length=self.draft_length, shadow_checks=self.draft_stack is None,
                                  fused_rounds=fuses)
        self.planner = self.policy.planner  # config.adaptive: each sequence's draft lengths from the measured pass costs
        if self.planner is not None and runner.model.tp is not None:
            self.planner.clock.shared = runner.model.tp.leader_float
        # the round's proposers, in order: lookup first, then the layers (the token switch is both)
        if config.switches_per_token:
            self.proposers: list[Proposer] = [self.proposer]
        else:
            # lookup first; a head beside a copy before it (the planner gives a sequence one of the two)
            sources = (self.lookup, self.features) + ((self.proposer,) if self.proposer is not self.features else ())
            self.proposers = [p for p in sources if p is not None]
        self._round_captures = 0  # graphs recorded before this round (_clock_round)
        # a draft copy's greedy rounds with one host round trip, where asked (fused_round)
        self.fused = FusedRound(runner, self.draft_stack, self.layer_drafts, capture=bool(runner.graph_capture)) \
            if fuses else None
        self.verifier = Verifier(runner, self.exit_layer, self._exit_states, self._static_exit_verify)
        self.acceptor = Acceptor(runner, sampler, self.num_layers, self.exit_layer, self.draft_stack)

    def _fuses(self, config: SelfSpeculativeConfig) -> bool:
        """Whether the config's rounds can be fused (eecore.speculative.fused_round): a draft copy's
        chains alone, without token trees, exits, an exit measure, the acceptance guard or a feature head."""
        return (self.draft_stack is not None and not config.uses_lookup and not config.switches_per_token
                and not config.uses_feature and config.top_k == 1 and config.layer.exit_threshold is None and self.measure is None
                and self.guard is None and not self.runner.model.is_encoder_decoder)

    def _build_layer_drafts(self, config, runner, sampler, adapters, draft_model, rows: int) -> None:
        model = runner.model
        layer = config.layer
        if layer.long_draft_acceptance is not None:
            self.draft_length = DraftLength(layer.long_draft_acceptance, self.states)
        if config.separate_draft_layers != (draft_model is not None):
            raise ValueError("SelfSpeculativeDecoder: a draft model goes with a draft copy (LayerDrafts.copy), and only there")
        if draft_model is not None:
            self.draft_stack = DraftStack(draft_model, runner, adapters, self.exit_layer, self.states)
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
            SpeculationGuard(model, rows, floor, layer.guard.probe_every, self.draft_head, self.states)
        self.measure = None if layer.exit_measure is None else agreement_measure(
            getattr(adapters, "source", None), self.lookup,
            *(() if layer.exit_measure == "agreement" else (layer.exit_measure,)))
        self.picker = DraftPicker(layer, config.top_k, self.draft_head, sampler, self.draft_length, self.measure)
        if config.switches_per_token:
            self.proposer = TokenSwitchProposer(self.draft_stack, self.picker, self.lookup)
        elif self.draft_stack is not None:
            self.proposer = CopyProposer(self.draft_stack, self.picker, self.layer_drafts)
        else:
            self.proposer = SharedLayerProposer(runner, self.picker, self.exit_layer, self.num_drafts,
                                                self._exit_states, self._static_drafts)

    # ---- one round: plan, propose, verify, accept, record ---------------------------------------
    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        start = time.perf_counter()
        self._round_captures = self._captures()
        behinds = None if self.draft_stack is None or (self.planner is None and self.fused is None) \
            else self.draft_stack.behind_all(seqs)
        if self.fused is not None:  # the batch's round length at once, then the round fused where it can be
            rooms, margin = self.fused.survey(seqs)
            drafts = self.policy.plan_round(seqs, rooms, behinds)
            if not drafts:
                return self._plain_round(seqs, [], start)
            results = self._fused_round(seqs, drafts, behinds, margin, start)
            if results is not None:
                return results
        else:
            rooms = self._rooms(seqs)
        plans = self.policy.plan(seqs, rooms, behinds, new_round=self.fused is None)
        if self.policy.planned_out(plans):
            return self._plain_round(seqs, [], start)  # nobody drafts
        drafts = [Draft() for _ in seqs]
        shadowed, drafting, ahead, ran = [], 0.0, None, None
        for proposer in self.proposers:
            budgets = self.policy.budgets(proposer.kind, seqs, drafts, plans)
            shadowed += budgets.shadowed
            if not budgets and proposer.kind != "hybrid":  # (the token switch records every round it is asked)
                continue
            if proposer.kind == "lookup":  # no pass runs: nothing to time
                proposer.propose(seqs, drafts, budgets)
                continue
            ran = proposer
            if proposer.kind == "layer":
                for draft, n in zip(drafts, budgets.tokens):
                    draft.layer_turn = n > 0
            # (not beside feature drafts: a pass launched ahead would not tap their states)
            ahead = VerifyAhead.for_round(self.runner.static_verify, seqs, drafts) \
                if proposer.verifies_ahead and not shadowed and self.features is None else None
            drafting += self._draft_passes(proposer, lambda: proposer.propose(seqs, drafts, budgets, ahead), ahead)
        if not any(drafts) and (ran is None or not ran.verifies_empty_drafts):
            # no match, the guard, the last tokens, or a token switch that found nothing sure enough
            return self._plain_round(seqs, shadowed, start, None if ran is None else drafts, drafting)
        logits, widths, verified = self._verify(seqs, drafts, shadowed, ran, ahead)
        results, offsets = self._accept(seqs, drafts, widths, logits)
        self._record_shadow(seqs, shadowed, [offsets[b] for b in shadowed], logits)
        self._clock_round(verified, len(seqs), start, drafting)
        return results

    def _fused_round(self, seqs: list[Sequence], drafts: int, behinds: list[int], margin: int, start: float
                     ) -> Optional[list[list[Token]]]:
        """A round of `drafts` drafts as one fused round (eecore.speculative.fused_round) where it
        takes it: the tokens each sequence gains; None: the round runs op by op. `margin`: the
        batch's FusedRound.survey."""
        if not self.fused.takes(seqs, drafts, behinds, margin):
            return None
        ran = self.fused.run(seqs, drafts)
        if ran is None:
            return None
        rows, drafting = ran
        L, W, settle = self.num_layers, drafts + 1, self.draft_stack.after_fused_round
        results, accepted = [], []
        for seq, row in zip(seqs, rows):
            kept = row[W]
            position = seq.num_computed_tokens
            seq.num_computed_tokens = position + kept + 1
            settle(seq, position, drafts, kept)
            accepted.append(kept)
            results.append(TokenRun(row[: kept + 1], L))
        self.policy.record_fused(seqs, drafts, accepted)
        if self.planner is not None and self._captures() == self._round_captures:
            # as a round op by op is timed: its draft passes, and the rest of its wall time
            self.planner.clock.record_copy(drafts, drafting)
        self._clock_round(len(seqs) * W, len(seqs), start, drafting)
        return results

    def _verify(self, seqs: list[Sequence], drafts: list[Draft], shadowed: list[int], ran: Optional[Proposer],
                ahead: Optional[VerifyAhead]) -> tuple[torch.Tensor, list[int], int]:
        """The round's verify pass: (logits, each sequence's verified width, rows verified)."""
        if ahead is not None and ahead.logits is not None:  # launched behind the chain: every row at full width
            return ahead.logits, [ahead.static.width] * len(seqs), ahead.rows_verified
        if ran is not None and ran.verifies_from_exit_states:
            widths = [len(d) + 1 for d in drafts]
            return self.verifier.from_exit_states(seqs, drafts, logit_rows(widths, drafts)), widths, sum(widths)
        # lookup drafts or a copy's: one varlen pass through every layer
        rows = [tree_row(s, d.tokens, d.alternatives) for s, d in zip(seqs, drafts)]
        widths = [len(row.tokens) for row in rows]
        tap = None if self.features is None else self.features.tap(sum(widths))
        logits = self.verifier.full(rows, shadowed, logit_rows(widths, drafts), tap=tap)
        self._tapped = None if tap is None else tap[1]
        return logits, widths, sum(widths)

    def _draft_passes(self, proposer: Proposer, propose, ahead: Optional[VerifyAhead] = None) -> float:
        """Runs `propose` (`proposer`'s draft passes); returns its seconds. The planner's clock
        learns what one pass costs from rounds whose passes ran one token per sequence: a pass that
        catches the copy up on a prompt or on plain rounds' tokens is the price of starting to
        draft, not of a draft. `ahead`: the verify pass the passes launched (VerifyAhead.seconds is
        its share of their time)."""
        if self.planner is None:
            propose()
            return 0.0
        stack, clock = self.draft_stack if proposer is not self.features else None, self.planner.clock
        passes, caught_up, begin = proposer.passes, stack.catch_up_tokens if stack else 0, time.perf_counter()
        propose()
        seconds = time.perf_counter() - begin - (0.0 if ahead is None else ahead.seconds)
        passes, caught_up = proposer.passes - passes, (stack.catch_up_tokens if stack else 0) - caught_up
        if self._captures() != self._round_captures:  # a pass recorded its graph: a one-time cost
            return seconds
        if proposer is self.features:
            clock.record_feature(passes, seconds)
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
        """CUDA graphs recorded so far by the passes a round may run (engine.static_decode, speculative.static_passes)."""
        runner = self.runner
        passes = (runner.static_decode, runner.static_verify, self._static_drafts, self._static_exit_verify,
                  None if self.draft_stack is None else self.draft_stack.static, self.fused,
                  None if self.features is None else self.features.static)
        return sum(p.captures for p in passes if p is not None)

    def _plain_round(self, seqs: list[Sequence], shadowed: list[int], start: float,
                     drafts: Optional[list[Draft]] = None, drafting: float = 0.0) -> list[list[Token]]:
        """A full-depth step for a round that drafted nothing. `drafts`: the round's empty drafts,
        where a proposer ran passes that do not verify empty drafts (the token switch): each is
        recorded (a copy pass at rate 0), and the copy's K/V of the pending token is kept."""
        if drafts is not None:
            starts = [s.num_computed_tokens for s in seqs]
            results = self._plain.decode(seqs)
            for seq, draft, begin in zip(seqs, drafts, starts):
                self.policy.record_undrafted(seq, draft)
                if draft.copy_ran:  # the copy's K/V of the pending token is right
                    self.draft_stack.settle(seq, begin + 1)
        elif self.features is not None and not (self.planner is not None and self.planner.all_quiet):
            # feature drafts read the step's tapped streams next round (where the planner has planned
            # this round quiet, the next drafts nothing: a step without the tap and the keeping)
            self.policy.record_plain(seqs)
            tap = self.features.tap(len(seqs))
            results, _ = self._plain.step(seqs, tap=tap)
            self.features.keep(seqs, list(range(len(seqs))), tap[1])
        elif not shadowed:
            self.policy.record_plain(seqs)
            self._plain.allow_ahead = self.policy.plain_ahead(lookup=self.lookup is not None)
            results = self._plain.decode(seqs)
        else:
            self.policy.record_plain(seqs)
            # the guard's shadow check wants layer-E states: tap them on the way through
            results, logits = self._plain.step(seqs, tap=(self.exit_layer, self._exit_states[: len(seqs), 0]))
            self._record_shadow(seqs, shadowed, shadowed, logits)
        self._clock_round(len(seqs), len(seqs), start, drafting)
        return results

    def _accept(self, seqs, drafts: list[Draft], widths: list[int], logits: torch.Tensor):
        accepted, offsets = self.acceptor.accept_all(seqs, drafts, widths, logits)
        for seq, draft, a in zip(seqs, drafts, accepted):
            self.policy.record(seq, draft, a.drafts_accepted, a.alternative_accepted)
        if self.features is not None:  # each sequence's last accepted position, for its next round's drafts
            self.features.keep(seqs, [o + a.last_row for o, a in zip(offsets, accepted)], self._tapped)
        return [a.tokens for a in accepted], offsets

    # ---- plain steps: more sequences decode than disable_by_batch_size ----------------------
    def decode_plain(self, seqs: list[Sequence]) -> list[list[Token]]:
        """More sequences decode than drafting allows: while they do, every step is plain, so each
        launches the next ahead (a batch that shrinks below the limit loses one)."""
        self.policy.record_plain(seqs)
        self._plain.allow_ahead = True
        return self._plain.decode(seqs)

    def prefill_tap(self, num_tokens: int):
        """Feature drafts: a prompt pass taps the head's layers, so a sequence drafts from its first round."""
        return None if self.features is None else self.features.tap(num_tokens)

    def prefilled(self, seqs: list[Sequence], rows: list[int], tapped) -> None:
        if self.features is not None:
            self.features.keep(seqs, rows, tapped)

    def decode_mixed(self, seqs: list[Sequence], prefill_rows: list[Row]):
        self.policy.record_plain(seqs)
        if self.features is None:
            return self._plain.decode_mixed(seqs, prefill_rows)
        # feature drafts: the decodes' and the finished prompts' states, tapped on the way
        tap = self.features.tap(len(seqs) + sum(len(r.tokens) for r in prefill_rows))
        results, firsts = self._plain.decode_mixed(seqs, prefill_rows, tap=tap)
        kept, rows, end = list(seqs), list(range(len(seqs))), len(seqs)
        for row, first in zip(prefill_rows, firsts):
            end += len(row.tokens)
            if first is not None:
                kept.append(row.seq)
                rows.append(end - 1)
        self.features.keep(kept, rows, tap[1])
        return results, firsts

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
        self.policy.release(seq)  # (the planner's priors read the sequence's odds as it goes)
        for part in (self.lookup, self.draft_stack, self.measure):
            if part is not None:
                part.release(seq)
        self.states.release(seq)

    def _rooms(self, seqs: list[Sequence]) -> list[int]:
        """New tokens each sequence may still get (max_tokens and the context both bound it)."""
        longest = self.runner.max_model_len
        return [min(s.params.max_tokens - s.num_output_tokens, longest - s.num_tokens) for s in seqs]

    def metrics(self, seq: Sequence) -> dict[str, float]:
        return self.policy.metrics(seq)
