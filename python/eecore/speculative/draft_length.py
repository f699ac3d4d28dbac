"""Adaptive draft length per sequence (`LayerDrafts(long_draft_acceptance=a)`): a sequence
whose first drafts are accepted less often than `a` stops trusting its draft's confidence for long
chains. Its round's chain goes past the first layer draft only when that draft is at least `a`
sure; otherwise the round verifies one draft.

Why on top of the draft threshold: the threshold stops a chain at a token the draft itself doubts,
but how far the draft's confidence can be trusted depends on the text. The exit-ready draft copy of
SmolLM2 learned from code; on chat its drafts are wrong far more often at the same confidence, and
chains of 4 go on past where they pay. Exact replay of greedy runs (bench/analysis/hybrid_policy_replay.py
--layer-only, a copy pass costing 0.15 of a step) ranks d = 4 with threshold 0.15 first of 78
stopping rules on held-out code (1.88x by the cost model) but 58th on the benches' chat prompts
(0.95x) and 69th on everyday requests (0.89x), where one draft a round is best (1.07x, 1.05x). How
often a sequence's *first* draft is accepted tells the two apart: every round measures it, and it
needs no calibration of the draft's probabilities. Cutting a doubtful sequence to one draft a round
outright cost code tokens in its hard stretches, where chains after a sure first draft still pay
(the preset ran 0.94x on code that way), so a first draft at least `a` sure keeps its chain. With
a = 0.5 the replay gives 1.89x on code, 1.06x on chat and 1.02x on everyday requests, and the
layer preset, measured against itself without the rule (bench/e2e_ab.py configs, 2 Zen 3 cores), ran
1.05x faster on code, 1.05x on chat and 1.11x on everyday requests, with the same outputs.

A round counts when the sequence was allowed to draft with the layers; a draft the threshold dropped
before its first token counts as a rejected first draft (its pass was paid for nothing). The running
rate is an exponential average over those rounds, and a new sequence starts trusting. The rule
depends only on the sequence's past and the draft's own probabilities, so sampled outputs keep the
model's law and greedy outputs stay full depth's.
"""
from __future__ import annotations

from typing import Optional

from eecore.engine.sequence import Sequence
from eecore.speculative.state import SequenceStates


class DraftLength:
    # The running rate's weight on its past: long enough to ride out a few unlucky rounds of a
    # sequence whose drafts pay (code), short enough to react within a chat reply's first rounds.
    DECAY = 0.85

    def __init__(self, min_acceptance: float, states: Optional[SequenceStates] = None):
        self.min_acceptance = min_acceptance
        # each sequence's running rate of accepted first drafts (SequenceState.first_draft_rate)
        self.states = SequenceStates() if states is None else states

    def goes_on(self, seq: Sequence, first_confidence: float) -> bool:
        """Whether `seq`'s chain goes past its round's first layer draft, whose top-1 probability
        is `first_confidence`."""
        return self.trusts(seq) or first_confidence >= self.min_acceptance

    def trusts(self, seq: Sequence) -> bool:
        """Whether `seq`'s chain goes past its first draft however sure that draft is."""
        running = self.states.slot(seq, "first_draft_rate")
        return running is None or running >= self.min_acceptance

    def record(self, seq: Sequence, first_accepted: bool) -> None:
        """A round in which `seq` drafted with the layers: whether its first layer draft was made and
        accepted."""
        hit = 1.0 if first_accepted else 0.0
        state = self.states.of(seq)
        running = state.first_draft_rate
        state.first_draft_rate = hit if running is None else self.DECAY * running + (1 - self.DECAY) * hit

    def release(self, seq: Sequence) -> None:
        self.states.clear_slot(seq, "first_draft_rate")

    def __len__(self) -> int:
        return self.states.count("first_draft_rate")
