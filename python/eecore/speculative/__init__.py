"""Self-speculative decoding: drafts from layer E (LayerSkip) or from prompt lookup, verified by the
full model in one pass.

    config.py        SelfSpeculativeConfig: the draft sources, their length and batch limits
    options.py       its parts: LayerDrafts (DraftCopy, AcceptanceGuard), LookupDrafts
    flat_options.py  the options by flat name (CLI flags, preset overrides, deprecated keywords)
    presets.py       the exit-ready presets of the embedded model
    decoder.py       SelfSpeculativeDecoder: propose -> verify -> accept -> record
    proposers.py     one proposer per layer-draft source (prompt lookup: eecore.text.ngram_index)
    draft.py, verification.py, acceptance.py, stats.py: the steps of a round
    guard.py, draft_length.py: what stops a sequence's layer drafts where they lose
"""
from eecore.speculative.config import DRAFT_MODES, SelfSpeculativeConfig
from eecore.speculative.decoder import SelfSpeculativeDecoder
from eecore.speculative.guard import ShadowCheck, SpeculationGuard, break_even_acceptance
from eecore.speculative.options import BREAK_EVEN, AcceptanceGuard, DraftCopy, LayerDrafts, LookupDrafts
from eecore.text.ngram_index import PromptLookup

__all__ = ["SelfSpeculativeConfig", "LayerDrafts", "LookupDrafts", "DraftCopy", "AcceptanceGuard",
           "SelfSpeculativeDecoder", "BREAK_EVEN", "DRAFT_MODES", "PromptLookup", "SpeculationGuard", "ShadowCheck",
           "break_even_acceptance"]
