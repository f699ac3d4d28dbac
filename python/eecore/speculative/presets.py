"""The exit-ready presets: the self-speculation settings measured fastest for the embedded
SmolLM2-135M with its shipped draft layers (`SelfSpeculativeConfig.exit_ready`, `--exit-ready`).

Both draft with the copy of layers 0..7 that the shipped file makes (its LoRA pairs merged in,
weight-only int8) and verify with the original model:
- "layer": d = 4, a chain stopped below top-1 probability 0.15, and past its first draft only when
  that draft is at least 0.5 sure while the sequence's first drafts are accepted less than half the
  time;
- "hybrid": 4 drafted tokens, each position from a prompt-lookup match of 2-4 tokens where the draft
  so far ends in one and from the copy otherwise (at most 3 copy passes), with the same stops.

On a CPU, verifying many sequences' drafts is bound by arithmetic, so each preset stops drafting
above the batch where it stopped paying: 2 (layer) and 4 (hybrid) running sequences; where the int8
copy runs on AMX-INT8 tiles the layer preset drafts up to 4, and where bf16 verify rows run on
AMX-BF16 the hybrid's lookup drafts go on up to 8 (layer drafts up to 4). The measurements behind
every number are in docs/exit-ready.md and docs/draft-layers-history.md.
"""
from __future__ import annotations

import torch

from eecore.models.amx_weights import amx_available

EXIT_READY_PRESETS = {
    "layer": dict(exit_layer=8, num_speculations=4, draft_threshold=0.15, long_draft_acceptance=0.5,
                  draft_layers="separate", draft_dtype="int8", disable_by_batch_size=2),
    "hybrid": dict(draft="hybrid", hybrid_switch="token", exit_layer=8, num_speculations=4, layer_speculations=3,
                   lookup_min_ngram=2, lookup_max_ngram=4, draft_threshold=0.15, long_draft_acceptance=0.5,
                   draft_layers="separate", draft_dtype="int8", disable_by_batch_size=4),
}
LAYER_PRESET_AMX_MAX_BATCH = 4
HYBRID_PRESET_AMX_LOOKUP_MAX_BATCH = 8


def exit_ready_settings(preset: str, overrides: dict) -> dict:
    """The preset's SelfSpeculativeConfig fields on this CPU (`overrides` are applied by the caller;
    they only steer how the batch limits combine)."""
    if preset not in EXIT_READY_PRESETS:
        raise ValueError(f"SelfSpeculativeConfig.exit_ready: 'preset' must be one of "
                         f"{', '.join(EXIT_READY_PRESETS)}, got {preset!r}")
    settings = dict(EXIT_READY_PRESETS[preset])
    if preset == "layer" and amx_available(torch.int8):
        settings["disable_by_batch_size"] = LAYER_PRESET_AMX_MAX_BATCH
    if preset == "hybrid" and amx_available(torch.bfloat16):
        settings["layer_disable_by_batch_size"] = settings["disable_by_batch_size"]
        settings["disable_by_batch_size"] = HYBRID_PRESET_AMX_LOOKUP_MAX_BATCH
        limit = overrides.get("disable_by_batch_size")
        if limit is not None and "layer_disable_by_batch_size" not in overrides:
            # a lower overall limit given alone lowers the layer drafts' with it
            settings["layer_disable_by_batch_size"] = min(settings["layer_disable_by_batch_size"], limit)
    return settings
