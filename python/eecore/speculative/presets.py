"""The exit-ready presets: the self-speculation settings measured fastest for the embedded
SmolLM2-135M with its shipped draft layers (`SelfSpeculativeConfig.exit_ready`, `--exit-ready`).

Both draft with the copy of layers 0..7 that the shipped file makes (its LoRA pairs merged in,
8-bit: int8_weights.eight_bit) and verify with the original model:
- "layer": d = 4, a chain stopped below top-1 probability 0.15, and past its first draft only when
  that draft is at least 0.5 sure while the sequence's first drafts are accepted less than half the
  time; on a CPU, beside the copy, the shipped feature head (eecore.speculative.feature_drafts:
  token trees of 3 tokens a position, at most 2 positions, their nodes the most likely of the
  chain and its runners-up), and each round the planner gives each
  sequence the copy's chain or the head's tree, whichever emits more tokens a second at the
  measured costs and that sequence's acceptance: the copy on code, the head on chat and everyday
  requests (docs/feature-heads.md); and before either, prompt lookup: a sequence whose text ends in
  a 2-4-gram seen before drafts that occurrence's continuation (on code 1.71-2.06x full depth
  against 1.54-1.87x without it in the same runs; on chat and everyday requests the same within
  the runs' spread). With another model's exit-ready file, which the shipped head does not fit, the
  preset drafts with the copy and lookup;
- "hybrid": 4 drafted tokens, each position from a prompt-lookup match of 2-4 tokens where the draft
  so far ends in one and from the copy otherwise (at most 3 copy passes), with the same stops.

Both are adaptive (eecore.speculative.draft_planner): those lengths are caps, and each round a
sequence drafts as far as pays at the pass costs measured while decoding and its running
acceptance. What a verify row costs depends on the weights: over fp32 weights a second verify row
is nearly free, over the Q4_1 file's exact kernel a pass of 2 / 5 rows costs 1.12 / 1.78 one-row
steps, so there the copy's drafts pay only at short lengths, and on chat, where they are
mostly wrong, the planner drafts next to nothing.

On a CPU, verifying many sequences' drafts is bound by arithmetic, so each preset stops drafting
above the batch where it stopped paying: 2 (layer) and 4 (hybrid) running sequences; where the int8
copy runs on AMX-INT8 tiles the layer preset drafts up to 4, and where bf16 verify rows run on
AMX-BF16 the hybrid's lookup drafts go on up to 8 (layer drafts up to 4). The measurements behind
every number are in docs/exit-ready.md and docs/draft-layers-history.md.

On a GPU neither CPU limit holds: a verify pass of several rows a sequence costs about what one row
costs up to large batches, and the int8 copy is a CPU format (CUDA widens its weights on every
call). There the copy runs in the model's dtype and the planner, which prices the rounds it times
on that device, sets the lengths. The layer preset drafts at every batch size (where its rounds do
not pay the planner turns drafting off: 0.91-1.08x full depth at batch 8 and 64 on an H200). The
hybrid preset stops above 2 running sequences: on an H200 it ran 1.41x / 1.37x full depth at batch
1 on code / chat and 0.70x / 0.61x at batch 8 (a round's host work grows with the batch, a decode
step's GPU time barely does); a line through those two puts the break-even near 3.7 sequences, and
2 keeps the predicted gain above 1.2x
(bench/results/nvidia-h200/nvidia-h200-2026-11-28-real-weights.md).
"""
from __future__ import annotations

import torch

from eecore.device import resolve_device
from eecore.models.amx_weights import amx_available
from eecore.speculative.options import DraftCopy, FeatureDrafts, LayerDrafts, LookupDrafts

PRESETS = ("layer", "hybrid")
LAYER_PRESET_AMX_MAX_BATCH = 4
HYBRID_PRESET_AMX_LOOKUP_MAX_BATCH = 8
HYBRID_PRESET_GPU_MAX_BATCH = 2
# the layer preset's feature head on a CPU: a tree of 3 tokens a position, at most 2 positions
FEATURE_TOP_K, FEATURE_MAX_LENGTH = 3, 2


def preset_device(device) -> str:
    """"cpu" or "cuda": `device` as LLM takes it (None: LLM's default, CUDA where eecore has CUDA
    kernels and a GPU is visible)."""
    try:
        return resolve_device(device).type
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"SelfSpeculativeConfig.exit_ready: 'device' {exc}") from None


def exit_ready_preset(config_cls, preset: str, device=None):
    """The preset, a `config_cls` (SelfSpeculativeConfig), as tuned for `device`'s kind, before any
    override."""
    if preset not in PRESETS:
        raise ValueError(f"SelfSpeculativeConfig.exit_ready: 'preset' must be one of {', '.join(PRESETS)}, "
                         f"got {preset!r}")
    gpu = preset_device(device) == "cuda"
    stops = dict(stop_below=0.15, long_draft_acceptance=0.5, copy=DraftCopy(dtype=None if gpu else "int8"))
    if preset == "layer":
        limit = None if gpu else LAYER_PRESET_AMX_MAX_BATCH if amx_available(torch.int8) else 2
        # the shipped feature head beside the copy on a CPU (not yet timed on a GPU, where it runs op by op),
        # and prompt lookup first: code's repeats drafted for free
        feature = None if gpu else FeatureDrafts(top_k=FEATURE_TOP_K, max_length=FEATURE_MAX_LENGTH)
        lookup = None if gpu else LookupDrafts(min_ngram=2, max_ngram=4)
        return config_cls(num_speculations=4, layer=LayerDrafts(exit_layer=8, **stops), feature=feature,
                          lookup=lookup, disable_by_batch_size=limit, adaptive=True)
    if gpu:
        lookup_limit, layer_limit = HYBRID_PRESET_GPU_MAX_BATCH, None
    elif amx_available(torch.bfloat16):
        lookup_limit, layer_limit = HYBRID_PRESET_AMX_LOOKUP_MAX_BATCH, 4
    else:
        lookup_limit, layer_limit = 4, None
    return config_cls(
        num_speculations=4, layer=LayerDrafts(exit_layer=8, max_length=3, disable_by_batch_size=layer_limit, **stops),
        lookup=LookupDrafts(min_ngram=2, max_ngram=4), hybrid_switch="token", disable_by_batch_size=lookup_limit,
        adaptive=True)

