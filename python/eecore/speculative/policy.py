"""How much each sequence drafts in a round, from which source, and what a round teaches: the one
object a self-speculative decoder asks before its proposers run and tells after each round.

It owns the parts that decide draft lengths:
- the config's caps: `num_speculations`, the layer drafts' `max_length`, what a sequence may still
  emit (max_tokens, the context), and the batch above which layer drafts stop (`layers_above`);
- the draft planner (`adaptive`: eecore.speculative.draft_planner), which prices each sequence's
  lengths per round from the measured pass costs and its acceptance, and its clock;
- the acceptance guard (eecore.speculative.guard), which keeps layer drafts off for sequences whose
  drafts are rejected too often, and shadow-checks them meanwhile;
- the draft-length rule (eecore.speculative.draft_length), which the draft picker asks as a chain
  grows, and the stop rules the picker applies with it (`LayerDrafts.stop_below`,
  `exit_threshold`).
The chain-stopping itself happens draft by draft in eecore.speculative.draft.DraftPicker; the
policy decides each round's budgets and records each round's outcome.
"""
from __future__ import annotations

from typing import Optional

from eecore.engine.sequence import Sequence
from eecore.speculative.draft import Budgets, Draft
from eecore.speculative.draft_length import DraftLength
from eecore.speculative.draft_planner import DraftPlan, DraftPlanner
from eecore.speculative.guard import SpeculationGuard
from eecore.speculative.state import SequenceStates
from eecore.speculative.stats import RoundRecorder


class DraftPolicy:
    def __init__(self, config, states: SequenceStates, *, layers: bool, guard: Optional[SpeculationGuard],
                 draft_length: Optional[DraftLength], shadow_checks: bool, fused_rounds: bool = False):
        """`layers`: the config drafts with layers (a draft head exists); `shadow_checks`: the guard
        may shadow-check a sequence it keeps from drafting (shared layers: the layer-E state is at
        hand); `fused_rounds`: rounds are fused (the planner prices lengths for the whole batch)."""
        self.states = states
        self.num_drafts = config.num_speculations
        self.layer_drafts = config.layer_draft_length
        self.feature_drafts = config.feature_draft_length
        self.layers_above = config.layers_above  # more decoding: lookup drafts alone
        self.uses_lookup = config.uses_lookup
        self.switches_per_token = config.switches_per_token
        self.has_layers = layers
        self.guard = guard
        self.draft_length = draft_length
        self.shadow_checks = shadow_checks
        self.planner = DraftPlanner(self.layer_drafts, self.num_drafts if config.uses_lookup else 0, states,
                                    shared_rounds=fused_rounds, max_feature=self.feature_drafts,
                                    feature_rows=config.feature_tree_nodes) if config.adaptive else None
        self.recorder = RoundRecorder(guard, draft_length, lookup=config.uses_lookup, layers=config.uses_layers,
                                      trees=max(config.top_k, config.feature_top_k) > 1, features=config.uses_feature)
        self._room_budgets: list[int] = []
        self._round_plan = None  # plan_round's last: (the batch's sequence ids, rounds it still holds, length)
        self._layers_now = False

    # ---- before the proposers ------------------------------------------------------------------
    def plan(self, seqs: list[Sequence], rooms: list[int], behinds: Optional[list[int]] = None,
             new_round: bool = True) -> list[DraftPlan]:
        """Each sequence's caps this round by kind: the planner's (adaptive), else the config's.
        `rooms`: the tokens each may still emit; `behinds`: the tokens a draft copy must catch up
        on before it drafts (the planner prices them); `new_round=False`: the round was planned
        already (plan_round) and now runs op by op."""
        self._room_budgets = budgets = [max(0, min(self.num_drafts, room - 1)) for room in rooms]
        self._layers_now = self.has_layers and (self.layers_above is None or len(seqs) <= self.layers_above)
        if self.planner is None:
            return [DraftPlan(n, min(n, self.layer_drafts), min(n, self.feature_drafts)) for n in budgets]
        if new_round:
            self.planner.new_round()
        return self.planner.plan_all(seqs, len(seqs), budgets, rooms, behinds or [0] * len(seqs))

    # A fused round's length is planned again after this many rounds of the same batch (at once
    # when the batch changes): the rates it weighs move by a tenth a round and the costs by a fifth,
    # while planning a batch of 64 costs the host about a sixth of the round (bench/cost_host.py
    # --fused).
    REPLAN_ROUNDS = 4

    def plan_round(self, seqs: list[Sequence], rooms: list[int], behinds: list[int]) -> int:
        """A fused round's length of layer drafts (0: a plain step): the planner's for the whole
        batch (DraftPlanner.plan_round), else the config's cap, within what the sequences may emit."""
        if not (self.has_layers and (self.layers_above is None or len(seqs) <= self.layers_above)):
            return 0
        budgets = [max(0, min(self.layer_drafts, room - 1)) for room in rooms]
        if self.planner is None:
            return max(budgets)
        self.planner.new_round()
        batch = [seq.seq_id for seq in seqs]
        planned = self._round_plan
        if planned is not None and planned[0] == batch and planned[1] > 0:
            self._round_plan = (batch, planned[1] - 1, planned[2])
            return min(planned[2], max(budgets))
        length = self.planner.plan_round(seqs, budgets, rooms, behinds)
        # (a plain round is planned again at the next: a batch probe counts its rounds)
        self._round_plan = (batch, self.REPLAN_ROUNDS - 1, length) if length else None
        return length

    def planned_out(self, plans: list[DraftPlan]) -> bool:
        """Nobody may draft and the guard has nothing to watch: the round is a plain step before
        any proposer runs. (Never with the token switch, whose round records every sequence,
        drafted or not.)"""
        return self.guard is None and not self.switches_per_token and \
            not any(p.lookup or p.layer or p.feature for p in plans)

    def budgets(self, kind: str, seqs: list[Sequence], drafts: list[Draft], plans: list[DraftPlan]) -> Budgets:
        """What a proposer of `kind` may draft now (see Proposer.kind). Layer drafts go to the
        sequences that hold no draft yet, as far as the guard allows: the guard sees only the rounds
        in which a sequence could draft with the layers (its calls count them)."""
        if kind == "lookup":
            return Budgets([p.lookup for p in plans])
        if kind == "feature":  # (beside layer drafts the planner gives a sequence one or the other)
            return Budgets([0 if d else p.feature for d, p in zip(drafts, plans)])
        if kind == "hybrid":  # one draft of lookup and copy tokens, at most plan.layer copy passes
            passes = [p.layer if self._layers_now and (self.guard is None or self.guard.allows(s)) else 0
                      for s, p in zip(seqs, plans)]
            return Budgets([min(n, max(p.lookup, p.layer)) for n, p in zip(self._room_budgets, plans)], passes)
        tokens, shadowed = [0] * len(seqs), []
        if self._layers_now:
            for b, seq in enumerate(seqs):
                if drafts[b]:
                    continue
                if self.guard is None or self.guard.allows(seq):
                    tokens[b] = plans[b].layer
                elif self.shadow_checks and self.guard.wants_shadow(seq):
                    shadowed.append(b)
        return Budgets(tokens, shadowed=shadowed)

    def plain_ahead(self, lookup: bool) -> bool:
        """Whether a plain round's step may launch the next one ahead (decode ahead, on a GPU): where
        the planner has turned drafting off (the copy's drafts fail, or rounds cost more than they
        emit, as when the host's share of a round outweighs the GPU's at large batches) and no
        sequence's probe falls due, so that the next round is plain too. Not with prompt lookup
        (`lookup`), whose matches come and go with the text, nor with the guard, which shadow-checks
        plain steps; a step launched ahead that a drafting round follows is work lost (the next
        plain step does not take it: its sequences moved on)."""
        return self.planner is not None and not lookup and self.guard is None and self.planner.all_quiet

    # ---- after verification --------------------------------------------------------------------
    def record(self, seq: Sequence, draft: Optional[Draft], accepted: int, alternative_accepted: bool = False,
               layer_turn: Optional[bool] = None) -> None:
        """A verified round of `seq`: its draft (None: it drafted nothing), the leading drafts kept."""
        self.recorder.record(seq, draft, accepted, alternative_accepted, layer_turn)
        if self.planner is not None:
            self.planner.record(seq, draft, accepted)

    def record_fused(self, seqs: list[Sequence], drafts: int, accepted: list[int]) -> None:
        """A fused round (eecore.speculative.fused_round): each of `seqs` drafted `drafts` layer
        tokens and kept the first accepted[i] (what `record` would learn, in one pass)."""
        self.recorder.record_layer_rounds(self.states, seqs, drafts, accepted)
        if self.planner is not None:
            self.planner.record_layer_rounds(seqs, drafts, accepted)

    def record_undrafted(self, seq: Sequence, draft: Draft) -> None:
        """A round in which a proposer that does not verify empty drafts (the token switch) ran for
        `seq` and drafted nothing; a plain step followed (a copy pass counts as a round at rate 0)."""
        self.recorder.record(seq, None, 0, layer_turn=draft.copy_ran)
        if self.planner is not None:
            self.planner.record(seq, draft, 0)

    def record_plain(self, seqs: list[Sequence]) -> None:
        """A round in which `seqs` drafted nothing and no proposer ran."""
        self.recorder.plain(seqs)

    def metrics(self, seq: Sequence) -> dict[str, float]:
        self.recorder.flush(seq, self.states)
        return self.recorder.metrics(seq)

    def release(self, seq: Sequence) -> None:
        self.recorder.flush(seq, self.states)
        for part in (self.guard, self.draft_length, self.planner):
            if part is not None:
                part.release(seq)
