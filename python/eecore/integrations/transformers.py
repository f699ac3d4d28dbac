"""HF transformers on eecore's kernels: `attn_implementation="eecore"` and eecore's RMSNorm.

    import eecore.integrations.transformers as eet
    eet.register()                                   # once: adds "eecore" to transformers' registries
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eecore")
    eet.use_eecore_rms_norm(model)                   # optional: every RMSNorm on eecore.ops.rms_norm

Attention goes through `eecore.ops.paged_attention` (the same op, CPU or CUDA kernels, that eecore's
engine runs), with transformers' own KV cache: each call lays the keys and values transformers
hands over into eecore's paged layout, one block per sequence ([B, S, Hkv, D], one copy, as
transformers' flash-attention path makes its own [B, S, H, D] copy) and runs the varlen kernel
with the causal mask aligned bottom-right. Padding (a 2-D attention mask, as `generate` builds for
a batch of prompts of different lengths) becomes blocks of one token holding only each sequence's
unpadded keys, and the real query rows run back to back (padded rows get 0). No other mask shape
is taken (sliding windows, custom 4-D masks): those models keep transformers' own attention.
"""
from __future__ import annotations

from typing import Optional

import torch

from eecore import ops

NAME = "eecore"


def register() -> None:
    """Registers the "eecore" attention (and its mask format: None or the 2-D padding mask, as
    flash-attention's) with transformers. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, eecore_attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def eecore_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, S, D], key/value [B, Hkv, S_kv, D],
    attention_mask None or [B, S_kv] (1 = a real token); returns ([B, S, H, D], no weights)."""
    if dropout:
        raise ValueError("eecore attention: dropout is not supported (it serves inference)")
    if getattr(module, "sliding_window", None):
        raise ValueError("eecore attention: sliding-window attention is not supported")
    B, H, S, D = query.shape
    S_kv = key.shape[2]
    q = query.transpose(1, 2).reshape(B * S, H, D)
    k_cache = key.transpose(1, 2).contiguous()  # [B, S_kv, Hkv, D]: one block of S_kv tokens a sequence
    v_cache = value.transpose(1, 2).contiguous()
    device = query.device
    query_start_loc = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=device)
    if attention_mask is None:
        block_table = torch.arange(B, dtype=torch.int32, device=device)[:, None]
        seq_lens = torch.full((B,), S_kv, dtype=torch.int32, device=device)
    else:  # padding: blocks of one token, each row of the table listing its sequence's real keys
        k_cache = k_cache.view(B * S_kv, 1, *k_cache.shape[2:])
        v_cache = v_cache.view(B * S_kv, 1, *v_cache.shape[2:])
        block_table, seq_lens = _unpadded_tables(attention_mask[:, -S_kv:].bool())
    scale = scaling if scaling is not None else D ** -0.5
    if attention_mask is None:
        out = torch.empty_like(q)
        ops.paged_attention(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, S, scale, True)
        return out.view(B, S, H, D), None
    # the real query rows only (a sequence's query rows must be its last tokens), back to back
    real_rows = attention_mask[:, -S:].bool()
    rows = real_rows.reshape(-1).nonzero().squeeze(1)
    query_start_loc = torch.zeros(B + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = real_rows.sum(dim=1).cumsum(0)
    compact = torch.empty(rows.numel(), H, D, dtype=q.dtype, device=device)
    ops.paged_attention(compact, q.index_select(0, rows), k_cache, v_cache, block_table, seq_lens, query_start_loc,
                        S, scale, True)
    out = torch.zeros_like(q).index_copy_(0, rows, compact)  # padded rows: 0 (transformers masks them)
    return out.view(B, S, H, D), None


def _unpadded_tables(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and lengths over blocks of one token: row b lists the flat indices of sequence
    b's real keys in order, then -1."""
    B, S_kv = real.shape
    seq_lens = real.sum(dim=1, dtype=torch.int32)
    flat = torch.arange(B * S_kv, dtype=torch.int32, device=real.device).view(B, S_kv)
    # stable sort puts each row's real keys first, in order
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices
    table = torch.gather(flat, 1, order)
    table = torch.where(torch.arange(S_kv, device=real.device)[None, :] < seq_lens[:, None], table, -1)
    return table.to(torch.int32), seq_lens


def use_eecore_rms_norm(model: torch.nn.Module) -> int:
    """Every RMSNorm module of `model` (a `weight` and `variance_epsilon`, as Llama, Mistral and Qwen2
    have) runs `eecore.ops.rms_norm`; returns how many. fp32 arithmetic, rounded once to the input's
    dtype, as transformers' own."""
    count = 0
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and hasattr(m, "weight"):
            m.forward = _rms_norm_forward.__get__(m)
            count += 1
    return count


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    x = hidden_states.contiguous()
    weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
    return ops.rms_norm(torch.empty_like(x), x, weight, self.variance_epsilon)
