"""What a self-speculation round leaves behind: the per-sequence counts behind the metrics, and what
the guard and the draft-length rule learn from it."""
from __future__ import annotations

from typing import Optional

from eecore.engine.sequence import Sequence
from eecore.speculative.draft import Draft


class RoundRecorder:
    def __init__(self, guard=None, draft_length=None, lookup: bool = False, layers: bool = False,
                 trees: bool = False):
        self.guard = guard
        self.draft_length = draft_length
        self.lookup = lookup    # which metric groups apply: lookup drafts, layer drafts, token trees
        self.layers = layers
        self.trees = trees

    def plain(self, seq: Sequence) -> None:
        """A round in which `seq` drafted nothing: one verify step of one token."""
        self.record(seq, None, 0)

    def record(self, seq: Sequence, draft: Optional[Draft], accepted: int, alternative_accepted: bool = False,
               layer_turn: Optional[bool] = None) -> None:
        """`accepted`: the leading drafts kept (an accepted tree alternative counted among them);
        `layer_turn` overrides the draft's (a copy pass that drafted nothing is a round at rate 0)."""
        from_lookup = [] if draft is None else draft.from_lookup
        turn = (draft is not None and draft.layer_turn) if layer_turn is None else layer_turn
        alternatives = 0 if draft is None else sum(len(a) for a in draft.alternatives)
        drafted = len(from_lookup)
        accepted = min(accepted, drafted)
        lookup_drafted, lookup_accepted = sum(from_lookup), sum(from_lookup[:accepted])
        if self.guard is not None and turn:  # the guard judges the layer drafts alone
            self.guard.record_round(seq, drafted - lookup_drafted, accepted - lookup_accepted)
        if self.draft_length is not None and turn:
            # the chain's first layer token (a hybrid draft may open with lookup tokens); none made:
            # the threshold dropped it, a rejected first draft
            first = next((i for i, lookup in enumerate(from_lookup) if not lookup), None)
            self.draft_length.record(seq, first is not None and accepted > first)
        st = seq.stats
        st["spec_drafted"] = st.get("spec_drafted", 0) + drafted
        st["spec_accepted"] = st.get("spec_accepted", 0) + accepted
        st["spec_steps"] = st.get("spec_steps", 0) + 1
        st["spec_emitted"] = st.get("spec_emitted", 0) + accepted + 1
        if alternatives:
            st["tree_alternatives"] = st.get("tree_alternatives", 0) + alternatives
            st["tree_alternatives_accepted"] = st.get("tree_alternatives_accepted", 0) + alternative_accepted
        if lookup_drafted:
            st["lookup_rounds"] = st.get("lookup_rounds", 0) + 1
            st["lookup_drafted"] = st.get("lookup_drafted", 0) + lookup_drafted
            st["lookup_accepted"] = st.get("lookup_accepted", 0) + lookup_accepted
        if drafted > lookup_drafted:
            st["layer_drafted"] = st.get("layer_drafted", 0) + drafted - lookup_drafted
            st["layer_accepted"] = st.get("layer_accepted", 0) + accepted - lookup_accepted

    def metrics(self, seq: Sequence) -> dict[str, float]:
        st = seq.stats
        if not st.get("spec_steps"):
            return {}
        m = {"acceptance_rate": st["spec_accepted"] / max(st["spec_drafted"], 1),
             "mean_accepted_tokens_per_step": st["spec_emitted"] / st["spec_steps"],
             "num_verify_steps": st["spec_steps"], "num_drafted_tokens": st["spec_drafted"],
             "num_accepted_tokens": st["spec_accepted"]}
        if self.lookup:
            m.update(num_lookup_rounds=st.get("lookup_rounds", 0),
                     num_lookup_drafted_tokens=st.get("lookup_drafted", 0),
                     num_lookup_accepted_tokens=st.get("lookup_accepted", 0),
                     lookup_acceptance_rate=st.get("lookup_accepted", 0) / max(st.get("lookup_drafted", 0), 1))
        if self.layers:
            m.update(num_layer_proposals=st.get("layer_proposals", 0),
                     num_layer_drafted_tokens=st.get("layer_drafted", 0),
                     num_layer_accepted_tokens=st.get("layer_accepted", 0),
                     layer_acceptance_rate=st.get("layer_accepted", 0) / max(st.get("layer_drafted", 0), 1))
        if self.trees:
            m.update(num_tree_alternatives=st.get("tree_alternatives", 0),
                     num_tree_alternatives_accepted=st.get("tree_alternatives_accepted", 0))
        return m
