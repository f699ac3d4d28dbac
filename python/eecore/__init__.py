"""eecore: an inference engine for early-exit LLMs.

    import eecore
    llm = eecore.LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["Hello"], eecore.SamplingParams(max_tokens=32))
    out[0].text, out[0].exit_layers

The compiled ops are `torch.ops.eecore.*` (typed wrappers in `eecore.ops`).
"""
from eecore import ops  # noqa: F401  (loads eecore._C and registers torch.ops.eecore)
from eecore.exits.config import EarlyExitConfig
from eecore.llm import LLM, generate
from eecore.outputs import RequestDelta, RequestOutput
from eecore.sampling_params import SamplingParams
from eecore.speculative import (AcceptanceGuard, DraftCopy, FeatureDrafts, LayerDrafts, LookupDrafts,
                                SelfSpeculativeConfig)

__version__ = "0.1.0"

__all__ = ["LLM", "generate", "SamplingParams", "EarlyExitConfig", "SelfSpeculativeConfig", "LayerDrafts",
           "LookupDrafts", "DraftCopy", "AcceptanceGuard", "FeatureDrafts", "RequestOutput",
           "RequestDelta", "ops"]
