"""Self-speculative decoding: drafts from layer E (LayerSkip) or from prompt lookup, verified by the
full model in one pass.

    config.py        SelfSpeculativeConfig: the draft sources, their length and batch limits
    options.py       its parts: LayerDrafts (DraftCopy, AcceptanceGuard), LookupDrafts, FeatureDrafts
    presets.py       the exit-ready presets of the embedded model
    decoder.py       SelfSpeculativeDecoder: plan -> propose -> verify -> accept -> record
    proposers.py     the Proposer interface, one per draft source (prompt lookup, shared layers, a copy,
                     the token switch): the seam a new draft source plugs into
    feature_drafts.py  drafts from a feature head (models.feature_head) on the target's own states
    policy.py        DraftPolicy: each round's budgets per sequence and source, and what a round
                     teaches (the planner, the guard, the draft-length rule): the other seam
    state.py         SequenceState: everything kept about a sequence between rounds, in one object
    draft.py, verification.py, acceptance.py, stats.py: the steps of a round
    guard.py, draft_length.py, draft_planner.py, pass_clock.py: the policy's parts
    static_passes.py LayerSkip's draft and verify passes as CUDA graphs
    fused_round.py, round_inputs.py, round_planning.py: a draft copy's greedy round with one host
                     round trip, its inputs, and its planning and books for the whole batch
"""
from eecore.speculative.config import DRAFT_MODES, SelfSpeculativeConfig
from eecore.speculative.decoder import SelfSpeculativeDecoder
from eecore.speculative.guard import ShadowCheck, SpeculationGuard, break_even_acceptance
from eecore.speculative.options import BREAK_EVEN, AcceptanceGuard, DraftCopy, FeatureDrafts, LayerDrafts, LookupDrafts
from eecore.text.ngram_index import PromptLookup

__all__ = ["SelfSpeculativeConfig", "LayerDrafts", "LookupDrafts", "DraftCopy", "AcceptanceGuard", "FeatureDrafts",
           "SelfSpeculativeDecoder", "BREAK_EVEN", "DRAFT_MODES", "PromptLookup", "SpeculationGuard", "ShadowCheck",
           "break_even_acceptance"]
