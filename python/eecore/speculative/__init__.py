"""Self-speculative decoding: drafts from layer E (LayerSkip) or from prompt lookup, verified by the
full model in one pass.

    config.py    SelfSpeculativeConfig (draft="layer" | "lookup" | "hybrid"), BREAK_EVEN
    decoder.py   SelfSpeculativeDecoder: draft, verify and accept on the batched paged engine
    drafters.py  prompt-lookup (n-gram) drafts, which run no layer
    guard.py     the speculation guard: stop layer drafts where they lose (break_even_acceptance)
"""
from eecore.speculative.config import BREAK_EVEN, DRAFT_MODES, SelfSpeculativeConfig
from eecore.speculative.decoder import SelfSpeculativeDecoder
from eecore.speculative.drafters import PromptLookup
from eecore.speculative.guard import ShadowCheck, SpeculationGuard, break_even_acceptance

__all__ = ["SelfSpeculativeConfig", "SelfSpeculativeDecoder", "BREAK_EVEN", "DRAFT_MODES", "PromptLookup",
           "SpeculationGuard", "ShadowCheck", "break_even_acceptance"]
