"""`ModelConfig`: the architecture facts the Llama-family decoder needs, independent of file format.

Both loaders build one: the safetensors loader from an HF `config.json`, the GGUF loader from the
file's metadata. Everything downstream (the decoder, the KV-cache sizing, the sampler's stop tokens)
reads only this, so the two formats cannot drift apart.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from eecore.models.errors import CorruptCheckpointError, UnsupportedModelError

# HF `model_type` -> the `architectures` entries whose weights are the plain causal-LM layout we load.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"  (SmolLM2 is "llama")
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # The HF rope-scaling dict with the key normalized to "rope_type" (e.g. {"rope_type": "llama3",
    # "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # "original_max_position_embeddings": 8192}), or None for plain RoPE.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases (Qwen2); o_proj never does
    sliding_window: int | None  # Mistral / Qwen2 with use_sliding_window; informational
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CorruptCheckpointError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise CorruptCheckpointError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.rms_norm_eps > 0:
            raise CorruptCheckpointError(f"model config: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise CorruptCheckpointError(f"model config: rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def q_size(self) -> int:
        """Rows of q_proj: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k_proj and of v_proj: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_hf_dict(d: dict, source: str = "config.json") -> "ModelConfig":
        """Build from an HF `config.json` dict (transformers 4.x or 5.x spelling).

        `source` only names the origin in error messages (the loader passes the file's path).
        """
        model_type = _check_hf_architecture(d, source)

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise CorruptCheckpointError(f"{source}: missing required key {key!r}")
            return d[key]

        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)

        attention_bias = _attention_bias(d, model_type, source)
        sliding_window = _sliding_window(d, model_type)
        rope_theta, rope_scaling = _rope_from_hf(d, source)
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=sliding_window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=token_id_tuple(d.get("eos_token_id")),
        )


def token_id_tuple(value: Any) -> tuple[int, ...]:
    """An HF `eos_token_id` (None, an int, or a list of ints) as a tuple without duplicates."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))



def _check_hf_architecture(d: dict, source: str) -> str:
    """The config's model_type, once it and its architecture are ones eecore loads."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; eecore loads "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (Llama 2/3, Mistral, Qwen2, SmolLM2) and t5, mt5 "
            "(T5ForConditionalGeneration, from HF directories)")
    architectures = d.get("architectures") or []
    wanted = SUPPORTED_ARCHITECTURES[model_type]
    if architectures and not any(a in wanted for a in architectures):
        raise UnsupportedModelError(
            f"{source}: architectures {architectures} is not a causal LM eecore can load; expected one of {list(wanted)}")
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {d['hidden_act']!r} is not supported; expected 'silu'")
    if d.get("mlp_bias", False):
        raise UnsupportedModelError(f"{source}: mlp_bias=True is not supported (the MLP projections have no bias)")
    return model_type


def _attention_bias(d: dict, model_type: str, source: str) -> bool:
    if model_type == "qwen2":
        # Qwen2 always has q/k/v biases (and none on o_proj); its config has no switch for it.
        return True
    # Llama's switch also adds an o_proj bias, which this decoder does not have.
    if d.get("attention_bias", False):
        raise UnsupportedModelError(
            f"{source}: attention_bias=True on a {model_type} model is not supported "
            "(it also adds an o_proj bias); only Qwen2-style q/k/v biases are")
    return False


def _sliding_window(d: dict, model_type: str) -> Optional[int]:
    if model_type == "mistral" or (model_type == "qwen2" and d.get("use_sliding_window", False)):
        window = d.get("sliding_window")
        return int(window) if window is not None else None
    return None

def _rope_from_hf(d: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either spelling.

    transformers 4.x writes `rope_theta` plus an optional `rope_scaling` dict whose type key is
    "type" (old) or "rope_type"; 5.x writes one `rope_parameters` dict holding both.
    """
    params = d.get("rope_parameters")
    if params is not None and any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(f"{source}: per-layer-type rope_parameters are not supported")
    merged = dict(params or {})
    merged.update(d.get("rope_scaling") or {})
    theta = merged.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta", 10000.0)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None)
    merged.pop("type", None)
    if rope_type in (None, "default"):
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **merged}
