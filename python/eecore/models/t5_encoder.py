"""The T5 encoder: runs once per request, at the start of its prefill.

The encoder's attention is bidirectional with a relative position bias that depends on the sign of
q - k, which `paged_attention` (bias by non-negative distance) does not express, and its output is
needed only once, so it runs as dense padded attention (`scaled_dot_product_attention` with the
bias plus a key-padding mask as the float mask) over the requests that start together. Everything
else (projections, feed-forward, norms) runs on the packed tokens, so a ragged batch spends no
GEMM work on padding. Its K/V are never cached: the decoder reads the encoder only through the cross-attention K/V that
`T5Model.write_cross_kv` computes from this output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from eecore.models.relative_position import bidirectional_bias
from eecore.models.t5_config import T5Config


@dataclass
class EncoderLayerWeights:
    attn_norm: torch.Tensor  # [d]
    qkv: torch.Tensor        # [3 inner, d]
    o: torch.Tensor          # [d, inner]
    ff_norm: torch.Tensor    # [d]
    wi: torch.Tensor         # [2 ff, d] (gated: wi_0 then wi_1) or [ff, d]
    wo: torch.Tensor         # [d, ff]


def t5_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """T5's layer norm: no mean, no bias; the mean square in fp32 (as HF computes it)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return {"relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
            "silu": F.silu}[name]


def feed_forward(x: torch.Tensor, wi: torch.Tensor, wo: torch.Tensor, gated: bool, act) -> torch.Tensor:
    h = F.linear(x, wi)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        h = act(gate) * up
    else:
        h = act(h)
    return F.linear(h, wo)


class T5Encoder:
    def __init__(self, config: T5Config, take: Callable[[str], torch.Tensor]):
        self.config = config
        self.eps = config.rms_norm_eps
        self.act = activation_fn(config.activation)
        self.bias_weight = take("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        self.final_norm = take("encoder.final_layer_norm.weight")
        self.layers = []
        for i in range(config.num_encoder_layers):
            p = f"encoder.block.{i}.layer."
            ff = p + "1.DenseReluDense."
            wi = torch.cat([take(ff + "wi_0.weight"), take(ff + "wi_1.weight")]) if config.gated else take(ff + "wi.weight")
            self.layers.append(EncoderLayerWeights(
                attn_norm=take(p + "0.layer_norm.weight"),
                qkv=torch.cat([take(p + f"0.SelfAttention.{n}.weight") for n in "qkv"]),
                o=take(p + "0.SelfAttention.o.weight"),
                ff_norm=take(p + "1.layer_norm.weight"), wi=wi, wo=take(ff + "wo.weight")))

    @torch.inference_mode()
    def __call__(self, embed: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
        """The encoder output of every request, concatenated in order: `[sum(len), d]`."""
        c = self.config
        device = embed.device
        lengths = [len(t) for t in token_lists]
        B, S = len(token_lists), max(lengths)
        flat_ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long, device=device)
        hidden = embed.index_select(0, flat_ids)  # [T, d]: packed, no padding rows
        bias = bidirectional_bias(self.bias_weight, S, c.num_buckets, c.max_distance)  # [H, S, S]
        H, D = c.num_heads, c.head_dim
        # The projections and the feed-forward (nearly all the flops) run on the packed rows; only
        # attention needs the [B, S] layout. A ragged batch scatters its q/k/v rows into padded
        # rows and gathers the attention output back, so no GEMM ever multiplies a padding row.
        ragged = any(n != S for n in lengths)
        if ragged:
            lens = torch.tensor(lengths, device=device)
            valid = torch.arange(S, device=device)[None, :] < lens[:, None]  # [B, S]
            rows = valid.flatten().nonzero().squeeze(1)  # the padded row of each packed token
            key_mask = torch.zeros(B, 1, 1, S, device=device).masked_fill(~valid[:, None, None, :], float("-inf"))
            mask = (bias[None] + key_mask).to(hidden.dtype)  # [B, H, S, S]
            padded = hidden.new_zeros(B * S, 3 * H * D)
        else:
            mask = bias[None].to(hidden.dtype)
        for w in self.layers:
            x = t5_rms_norm(hidden, w.attn_norm, self.eps)
            qkv = F.linear(x, w.qkv)  # [T, 3 inner]
            if ragged:
                padded[rows] = qkv
                qkv = padded
            q, k, v = qkv.view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)  # each [B, H, S, D]
            # T5 folds the 1/sqrt(D) scaling into its weights: the scores are unscaled.
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
            attn = attn.transpose(1, 2).reshape(B * S, H * D)
            if ragged:
                attn = attn[rows]
            hidden = hidden + F.linear(attn, w.o)
            x = t5_rms_norm(hidden, w.ff_norm, self.eps)
            hidden = hidden + feed_forward(x, w.wi, w.wo, c.gated, self.act)
        return t5_rms_norm(hidden, self.final_norm, self.eps)
