"""What a self-speculation round leaves behind: the per-sequence counts behind the metrics, and what
the guard and the draft-length rule learn from it."""
from __future__ import annotations

from typing import Optional

from eecore.engine.sequence import Sequence
from eecore.speculative.draft import Draft


class RoundRecorder:
    def __init__(self, guard=None, draft_length=None, lookup: bool = False, layers: bool = False,
                 trees: bool = False, features: bool = False):
        self.guard = guard
        self.draft_length = draft_length
        self.lookup = lookup    # which metric groups apply: lookup drafts, layer drafts, token trees, a feature head
        self.layers = layers
        self.trees = trees
        self.features = features

    def plain(self, seqs: list[Sequence]) -> None:
        """A round in which `seqs` drafted nothing: one verify step of one token each (what record
        counts for them, without the rest; planned-out rounds come in long runs)."""
        for seq in seqs:
            st = seq.stats
            st["spec_steps"] += 1
            st["spec_emitted"] += 1

    def record(self, seq: Sequence, draft: Optional[Draft], accepted: int, alternative_accepted: bool = False,
               layer_turn: Optional[bool] = None) -> None:
        """`accepted`: the leading drafts kept (an accepted tree alternative counted among them);
        `layer_turn` overrides the draft's (a copy pass that drafted nothing is a round at rate 0)."""
        from_lookup = () if draft is None else draft.from_lookup
        turn = (draft is not None and draft.layer_turn) if layer_turn is None else layer_turn
        drafted = len(from_lookup)
        accepted = min(accepted, drafted)
        lookup_drafted = lookup_accepted = 0
        if any(from_lookup):
            lookup_drafted, lookup_accepted = sum(from_lookup), sum(from_lookup[:accepted])
        if self.guard is not None and turn:  # the guard judges the layer drafts alone
            self.guard.record_round(seq, drafted - lookup_drafted, accepted - lookup_accepted)
        if self.draft_length is not None and turn:
            # the chain's first layer token (a hybrid draft may open with lookup tokens); none made:
            # the threshold dropped it, a rejected first draft
            first = from_lookup.index(False) if lookup_drafted < drafted else None
            self.draft_length.record(seq, first is not None and accepted > first)
        st = seq.stats
        st["spec_drafted"] += drafted
        st["spec_accepted"] += accepted
        st["spec_steps"] += 1
        st["spec_emitted"] += accepted + 1
        if draft is not None and draft.alternatives:
            st["tree_alternatives"] += sum(len(a) for a in draft.alternatives)
            st["tree_alternatives_accepted"] += alternative_accepted
        if lookup_drafted:
            st["lookup_rounds"] += 1
            st["lookup_drafted"] += lookup_drafted
            st["lookup_accepted"] += lookup_accepted
        if drafted > lookup_drafted:
            source = draft.source  # (the rest of a draft is the layers' or a feature head's)
            st[source + "_drafted"] += drafted - lookup_drafted
            st[source + "_accepted"] += accepted - lookup_accepted

    def record_layer_rounds(self, states, seqs: list[Sequence], drafts: int, accepted: list[int]) -> None:
        """`record` for a fused round: each of `seqs` drafted `drafts` layer tokens (every one of them
        run by the copy) and kept the first accepted[i]. Three counts a sequence, kept in its state
        (`states`, SequenceStates) until `flush` adds them to its stats. The draft-length rule learns
        nothing from them: a fused round drafts its length whatever the first draft's confidence."""
        get = states.get
        for seq, kept in zip(seqs, accepted):
            state = get(seq)
            counts = state.fused
            if counts is None:
                state.fused = [1, drafts, kept]
            else:
                counts[0] += 1
                counts[1] += drafts
                counts[2] += kept

    @staticmethod
    def flush(seq: Sequence, states) -> None:
        """`seq`'s fused rounds' counts into its stats (before metrics read them, and when it ends)."""
        state = states.get(seq)
        counts = None if state is None else state.fused
        if counts is None:
            return
        rounds, drafted, accepted = counts
        st = seq.stats
        st["spec_steps"] += rounds
        st["spec_emitted"] += rounds + accepted
        st["spec_drafted"] += drafted
        st["spec_accepted"] += accepted
        st["layer_proposals"] += drafted
        st["layer_drafted"] += drafted
        st["layer_accepted"] += accepted
        state.fused = None

    def metrics(self, seq: Sequence) -> dict[str, float]:
        st = seq.stats
        if not st["spec_steps"]:
            return {}
        m = {"acceptance_rate": st["spec_accepted"] / max(st["spec_drafted"], 1),
             "mean_accepted_tokens_per_step": st["spec_emitted"] / st["spec_steps"],
             "num_verify_steps": st["spec_steps"], "num_drafted_tokens": st["spec_drafted"],
             "num_accepted_tokens": st["spec_accepted"]}
        if self.lookup:
            m.update(num_lookup_rounds=st["lookup_rounds"],
                     num_lookup_drafted_tokens=st["lookup_drafted"],
                     num_lookup_accepted_tokens=st["lookup_accepted"],
                     lookup_acceptance_rate=st["lookup_accepted"] / max(st["lookup_drafted"], 1))
        if self.layers:
            m.update(num_layer_proposals=st["layer_proposals"],
                     num_layer_drafted_tokens=st["layer_drafted"],
                     num_layer_accepted_tokens=st["layer_accepted"],
                     layer_acceptance_rate=st["layer_accepted"] / max(st["layer_drafted"], 1))
        if self.features:
            m.update(num_feature_drafted_tokens=st["feature_drafted"],
                     num_feature_accepted_tokens=st["feature_accepted"],
                     feature_acceptance_rate=st["feature_accepted"] / max(st["feature_drafted"], 1))
        if self.trees:
            m.update(num_tree_alternatives=st["tree_alternatives"],
                     num_tree_alternatives_accepted=st["tree_alternatives_accepted"])
        return m
