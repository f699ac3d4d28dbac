"""eecore: an inference engine for early-exit LLMs."""
from eecore import ops  # noqa: F401  (loads eecore._C and registers torch.ops.eecore)

__version__ = "0.1.0"
