"""The model object for a loaded checkpoint: `LlamaModel` for the decoder-only family, `T5Model`
for T5 encoder-decoders. Both expose the same decoder pieces to the engine."""
from __future__ import annotations

import torch

from eecore.models.loader import LoadedModel
from eecore.models.t5_config import T5Config


def build_model(loaded: LoadedModel, dtype: torch.dtype, device: torch.device, consume: bool = False, tp=None):
    """`consume`: the decoder-only model takes its tensors out of `loaded.state_dict` as it builds.
    `tp`: this rank's tensor-parallel group (decoder-only: LlamaModel keeps its slice)."""
    if isinstance(loaded.config, T5Config):
        from eecore.models.t5 import T5Model

        return T5Model(loaded.config, loaded.state_dict, dtype, device)
    from eecore.models.llama import LlamaModel

    return LlamaModel(loaded.config, loaded.state_dict, dtype, device, consume_state_dict=consume, tp=tp)
