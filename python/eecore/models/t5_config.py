"""`T5Config`: the architecture facts of a T5 encoder-decoder, read from an HF `config.json`.

It carries the same engine-facing names as `ModelConfig` (num_layers, num_heads, num_kv_heads,
head_dim, hidden_size, vocab_size, max_position_embeddings, eos_token_ids, ...), where
`num_layers` is the DECODER's depth: the engine's paged cache, early exit and kv_fill all live in
the decoder, so everything downstream that counts layers counts decoder layers.

Two variants share one layout:
- T5 v1.1 (and mT5, Flan-T5): gated-GELU feed-forward, untied LM head, no output scaling;
- the original T5: ReLU feed-forward, LM head tied to the shared embedding, decoder output
  scaled by d_model^-0.5 before the head.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from eecore.models.config import token_id_tuple
from eecore.models.errors import CorruptCheckpointError, UnsupportedModelError

T5_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "t5": ("T5ForConditionalGeneration",),
    "mt5": ("MT5ForConditionalGeneration",),
}
# HF's activation names for the feed-forward (`dense_act_fn`) that the T5 layer implements.
T5_ACTIVATIONS = ("relu", "gelu_new", "gelu", "silu")
# T5 has relative positions and no context limit of its own; this is HF's `n_positions` default,
# the length the released checkpoints were trained at.
DEFAULT_MAX_POSITIONS = 512


@dataclass(frozen=True)
class T5Config:
    architecture: str                 # "t5" | "mt5"
    vocab_size: int
    hidden_size: int                  # d_model
    head_dim: int                     # d_kv (num_heads * d_kv need not equal d_model)
    intermediate_size: int            # d_ff
    num_encoder_layers: int
    num_layers: int                   # decoder layers
    num_heads: int
    num_buckets: int                  # relative_attention_num_buckets
    max_distance: int                 # relative_attention_max_distance
    rms_norm_eps: float
    activation: str                   # one of T5_ACTIVATIONS
    gated: bool                       # wi_0 / wi_1 (v1.1) or a single wi (original)
    scale_decoder_outputs: bool       # multiply by d_model^-0.5 before the head (original T5)
    max_position_embeddings: int
    decoder_start_token_id: int
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None   # T5 has none; kept for the engine's common reads

    is_encoder_decoder = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "head_dim", "intermediate_size", "num_encoder_layers",
                     "num_layers", "num_heads", "num_buckets", "max_distance", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CorruptCheckpointError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_buckets < 4:
            raise CorruptCheckpointError(f"model config: relative_attention_num_buckets must be >= 4, got {self.num_buckets}")
        if not self.rms_norm_eps > 0:
            raise CorruptCheckpointError(f"model config: layer_norm_epsilon must be > 0, got {self.rms_norm_eps!r}")
        if self.activation not in T5_ACTIVATIONS:
            raise UnsupportedModelError(f"model config: activation {self.activation!r} is not one of {T5_ACTIVATIONS}")
        if not 0 <= self.decoder_start_token_id < self.vocab_size:
            raise CorruptCheckpointError(f"model config: decoder_start_token_id {self.decoder_start_token_id} is "
                                         f"outside the vocabulary [0, {self.vocab_size})")

    # ---- the names the engine reads for any model --------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # T5 has no grouped-query attention

    @property
    def inner_size(self) -> int:
        """Width of q/k/v and of the attention output: num_heads * d_kv."""
        return self.num_heads * self.head_dim

    @property
    def tie_word_embeddings(self) -> bool:
        return self.scale_decoder_outputs

    def replace(self, **changes: Any) -> "T5Config":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_hf_dict(d: dict, source: str = "config.json") -> "T5Config":
        model_type = d.get("model_type")
        if model_type not in T5_ARCHITECTURES:
            raise UnsupportedModelError(f"{source}: model_type {model_type!r} is not a T5 model")
        architectures = d.get("architectures") or []
        wanted = T5_ARCHITECTURES[model_type]
        if architectures and not any(a in wanted for a in architectures):
            raise UnsupportedModelError(
                f"{source}: architectures {architectures} is not a T5 encoder-decoder eecore can load; "
                f"expected one of {list(wanted)}")

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise CorruptCheckpointError(f"{source}: missing required key {key!r}")
            return d[key]

        proj = str(d.get("feed_forward_proj", "relu"))
        parts = proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise UnsupportedModelError(f"{source}: feed_forward_proj {proj!r} is not 'ACT' or 'gated-ACT'")
        gated = len(parts) == 2
        # As HF does: "gated-gelu" means the tanh approximation (gelu_new); plain "gelu" is exact.
        activation = "gelu_new" if proj == "gated-gelu" else parts[-1]
        if activation not in T5_ACTIVATIONS:
            raise UnsupportedModelError(f"{source}: feed_forward_proj {proj!r}: activation {parts[-1]!r} is not "
                                        f"supported (expected one of {T5_ACTIVATIONS})")
        # transformers 5 writes `scale_decoder_outputs`; older configs only say whether the head
        # is tied, and the original (tied) T5 always scaled while v1.1 (untied) never does.
        scale = d.get("scale_decoder_outputs")
        if scale is None:
            scale = d.get("tie_word_embeddings", True) is not False
        num_layers = int(need("num_layers"))
        eos = token_id_tuple(d.get("eos_token_id", 1))
        pad = d.get("pad_token_id", 0)
        start = d.get("decoder_start_token_id")
        if start is None:
            start = pad if pad is not None else 0
        return T5Config(
            architecture=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("d_model")),
            head_dim=int(need("d_kv")),
            intermediate_size=int(need("d_ff")),
            num_encoder_layers=num_layers,
            num_layers=int(d.get("num_decoder_layers") or num_layers),
            num_heads=int(need("num_heads")),
            num_buckets=int(d.get("relative_attention_num_buckets", 32)),
            max_distance=int(d.get("relative_attention_max_distance", 128)),
            rms_norm_eps=float(d.get("layer_norm_epsilon", 1e-6)),
            activation=activation,
            gated=gated,
            scale_decoder_outputs=bool(scale),
            max_position_embeddings=int(d.get("n_positions") or DEFAULT_MAX_POSITIONS),
            decoder_start_token_id=int(start),
            pad_token_id=None if pad is None else int(pad),
            eos_token_ids=eos,
        )


def is_t5_config(d: dict) -> bool:
    """Whether an HF config.json dict describes a T5 encoder-decoder (routes the loader)."""
    return d.get("model_type") in T5_ARCHITECTURES
