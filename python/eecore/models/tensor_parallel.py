"""How a Llama checkpoint splits over tensor-parallel ranks (Megatron-LM's layout).

Each rank holds:
- q, k and v projections by output rows, whole heads: rank r has query heads r*Hq/N.. and KV heads
  r*Hkv/N.. (a query head's KV head is then on the same rank, since Hq/Hkv query heads share one);
- gate and up by output rows, down by input columns (the MLP's hidden units r*I/N..), o_proj by input
  columns (its query heads' outputs): both then give a partial sum that one all-reduce completes;
- the embedding and the LM head by vocabulary rows, ceil(V/N) a rank, the last rank's padded with
  zero rows (the LM head's padded logits are masked, never sampled);
- the norms whole.

A GGUF block weight splits by rows freely; by columns only on its blocks' boundaries (32 or 256
values), which `check_tensor_parallel` asks for before any process starts.
"""
from __future__ import annotations

from typing import Union

import torch

from eecore.models.config import ModelConfig
from eecore.models.gguf_weights import GGUFWeight

Tensorish = Union[torch.Tensor, GGUFWeight]


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(first id, end id, rows a rank holds) of `rank`'s vocabulary rows."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size), per_rank


def check_tensor_parallel(config, world_size: int, state_dict: dict | None = None) -> None:
    """A ValueError naming what does not split `world_size` ways, before any worker starts."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {world_size!r}")
    if world_size == 1:
        return
    if not isinstance(config, ModelConfig):
        raise ValueError("tensor_parallel_size > 1 is for the Llama family (decoder-only); this model is "
                         f"{type(config).__name__}")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {name} ({value})")
    for name, w in (state_dict or {}).items():
        if isinstance(w, GGUFWeight) and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
            block = _block_values(w)
            if (w.features // world_size) % block:
                raise ValueError(f"tensor_parallel_size={world_size}: {name} ({w.features} inputs in GGUF blocks of "
                                 f"{block}) does not split on block boundaries; use quantization='none' or a "
                                 "smaller size")


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's slice: its heads and MLP units (the vocabulary stays whole: logits
    are gathered to full width)."""
    return config.replace(num_heads=config.num_heads // world_size, num_kv_heads=config.num_kv_heads // world_size,
                          intermediate_size=config.intermediate_size // world_size)


def shard_state_dict(state_dict: dict, config: ModelConfig, rank: int, world_size: int) -> dict:
    """`rank`'s slices of a Llama state dict in HF naming (views where possible; the model copies
    what it keeps)."""
    D = config.head_dim
    q = config.num_heads // world_size * D
    kv = config.num_kv_heads // world_size * D
    inter = config.intermediate_size // world_size
    start, end, per_rank = vocab_shard(config.vocab_size, rank, world_size)
    out = {}
    for name, w in state_dict.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = _pad_rows(_rows(w, start, end), per_rank)
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            out[name] = _rows(w, rank * q, (rank + 1) * q)
        elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            out[name] = _rows(w, rank * kv, (rank + 1) * kv)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = _rows(w, rank * inter, (rank + 1) * inter)
        elif name.endswith("o_proj.weight"):
            out[name] = _columns(w, rank * q, (rank + 1) * q)
        elif name.endswith("down_proj.weight"):
            out[name] = _columns(w, rank * inter, (rank + 1) * inter)
        else:  # norms
            out[name] = w
    return out


def _block_values(w: GGUFWeight) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(w.quant_type)][0]


def _rows(w: Tensorish, start: int, end: int) -> Tensorish:
    if isinstance(w, GGUFWeight):
        return GGUFWeight(w.data[start:end].contiguous(), w.quant_type, w.features)
    return w[start:end]


def _columns(w: Tensorish, start: int, end: int) -> Tensorish:
    if isinstance(w, GGUFWeight):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(w.quant_type)]
        if start % values or end % values:
            raise ValueError(f"a GGUF weight of blocks of {values} values cannot split at columns {start}..{end}")
        return GGUFWeight(w.data[:, start // values * nbytes: end // values * nbytes].contiguous(), w.quant_type,
                          end - start)
    return w[:, start:end]


def _pad_rows(w: Tensorish, rows: int) -> Tensorish:
    have = w.shape[0]
    if have == rows:
        return w
    if isinstance(w, GGUFWeight):  # zero bytes: a zero scale, so the padded rows read as zeros
        pad = torch.zeros(rows - have, w.data.shape[1], dtype=w.data.dtype, device=w.data.device)
        return GGUFWeight(torch.cat([w.data, pad]), w.quant_type, w.features)
    return torch.cat([w, w.new_zeros(rows - have, w.shape[1])])
