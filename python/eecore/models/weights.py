"""The state-dict layout every loader produces: HF Llama names and the shapes a config implies.

Both the safetensors and the GGUF loader end with `check_state_dict`, so the decoder can index the
dict without defensive code: every tensor it needs is there, with the right shape, and nothing else.
"""
from __future__ import annotations

from typing import Callable

import torch

from eecore.models.config import ModelConfig
from eecore.models.errors import CorruptCheckpointError


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a Llama-family causal LM with this config, in HF naming.

    `lm_head.weight` is absent when the embeddings are tied (the decoder reuses embed_tokens).
    """
    d, v, f = config.hidden_size, config.vocab_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (config.q_size, d)
        shapes[p + "self_attn.k_proj.weight"] = (config.kv_size, d)
        shapes[p + "self_attn.v_proj.weight"] = (config.kv_size, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, config.q_size)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (config.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (config.kv_size,)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
    return shapes


def check_state_dict(state_dict: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    """Raise CorruptCheckpointError naming `source` unless the names and shapes are exactly those expected."""
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise CorruptCheckpointError(
            f"{source}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:3]} "
            f"(expected {len(expected)} tensors for a {config.num_layers}-layer {config.architecture} model)")
    unexpected = [name for name in state_dict if name not in expected]
    if unexpected:
        raise CorruptCheckpointError(
            f"{source}: {len(unexpected)} unexpected tensor(s) for a {config.architecture} model, "
            f"e.g. {unexpected[:3]} (does config.json match the weights?)")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise CorruptCheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(state_dict[name].shape)}, expected {shape} from the config")


# The CPU kernels stream weights with 32- and 64-byte vector loads. A weight that starts off a
# 64-byte boundary splits those loads across cache lines: numpy's buffers (the GGUF reader's) are
# only 16-byte aligned, and they made SmolLM2's o_proj and down projections stream 25-40% slower.
# torch's own allocations are 64-byte aligned.
WEIGHT_ALIGNMENT = 64


def weight_taker(state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, consume: bool = False) -> Callable[[str], torch.Tensor]:
    """`take(name)`: the checkpoint tensor `name` as a model keeps it (on `device`, in `dtype`,
    contiguous, 64-byte aligned on the CPU), or a ValueError naming the missing tensor. A GGUF
    block weight stays in its blocks on the CPU; elsewhere it is dequantized to `dtype`. With
    `consume`, each tensor leaves `state_dict` as it is taken (the loader's copy can then be freed
    as the model builds its own, which keeps the peak memory near one copy of the weights)."""
    from eecore.models.gguf_weights import GGUFWeight

    def take(name: str):
        if name not in state_dict:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        tensor = state_dict.pop(name) if consume else state_dict[name]
        if isinstance(tensor, GGUFWeight):
            if device.type == "cpu":
                return tensor
            tensor = tensor.dequantize(dtype)
        tensor = tensor.to(device=device, dtype=dtype).contiguous()
        if tensor.device.type == "cpu" and tensor.data_ptr() % WEIGHT_ALIGNMENT:
            tensor = tensor.clone()
        return tensor
    return take
