"""T5 (v1.1 and the original) on the eecore ops: an encoder that runs once per request, and a
decoder exposed one piece at a time exactly like `LlamaModel` (embed, layer i, final norm, LM
head, kv_fill), so the runner, the early-exit decoder and the measures drive it unchanged.

Each decoder layer reads two kinds of paged blocks of the same KV tensor (one layer's slice each):
- its self-attention K/V, at the sequence's `block_table` (causal, with the relative position
  bias handed to `paged_attention` as a per-distance table; no RoPE);
- the cross-attention K/V of the request's encoder output, at the sequence's own
  `cross_block_table` (non-causal). They are written once, at the start of the prefill, by
  `write_cross_kv` for every decoder layer with one GEMM, and never change.
T5 attention has no 1/sqrt(D) scaling (it is folded into the trained weights).

Early exit: the skipped layers' self-attention K/V come from the exit hidden state through
`kv_fill` (no RoPE, no bias); their cross-attention K/V are already in the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from eecore import ops
from eecore.models.amx_weights import tile_projections
from eecore.models.huge_pages import place_in_huge_pages
from eecore.models.int8_weights import dense
from eecore.models.llama import AttentionInputs
from eecore.models.relative_position import causal_bias_table
from eecore.models.t5_config import T5Config
from eecore.models.t5_encoder import T5Encoder
from eecore.models.weights import weight_taker
from eecore.models.workspace import RowViewCache


@dataclass
class DecoderLayerWeights:
    self_norm: torch.Tensor   # [d]
    # the projections are [N, K], or AMX tiles for a bf16 model (eecore.models.amx_weights)
    qkv: torch.Tensor         # [3 inner, d]
    self_o: torch.Tensor      # [d, inner]
    cross_norm: torch.Tensor  # [d]
    cross_q: torch.Tensor     # [inner, d]
    cross_o: torch.Tensor     # [d, inner]
    ff_norm: torch.Tensor     # [d]
    wi: torch.Tensor          # [2 ff, d] (gated: wi_0 then wi_1) or [ff, d]
    wo: torch.Tensor          # [d, ff]


class T5Workspace:
    """Decoder activation buffers for up to `max_tokens` rows, allocated once per engine."""

    def __init__(self, config: T5Config, max_tokens: int, dtype: torch.dtype, device: torch.device):
        c = config

        def buf(width):
            return torch.empty(max_tokens, width, dtype=dtype, device=device)

        self.max_tokens = max_tokens
        self.hidden = buf(c.hidden_size)
        self.normed = buf(c.hidden_size)
        self.qkv = buf(3 * c.inner_size)
        self.q = buf(c.inner_size)
        self.attn = buf(c.inner_size)
        self.o = buf(c.hidden_size)
        self.ff = buf((2 if c.gated else 1) * c.intermediate_size)
        self.act = buf(c.intermediate_size)
        # the views a decoder layer over T rows reads and writes, made once per T (slicing them
        # per layer cost about a tenth of a batch-1 step of T5-small)
        self.views: RowViewCache[LayerViews] = RowViewCache(lambda T: LayerViews(self, c, T))


class LayerViews:
    """One row count's views of a T5Workspace (no storage of their own)."""

    def __init__(self, ws: T5Workspace, c: T5Config, T: int):
        H, D, inner = c.num_heads, c.head_dim, c.inner_size
        self.normed = ws.normed[:T]
        self.qkv = ws.qkv[:T]
        self.q = self.qkv[:, :inner].view(T, H, D)
        self.k = self.qkv[:, inner:2 * inner].view(T, H, D)
        self.v = self.qkv[:, 2 * inner:].view(T, H, D)
        self.attn = ws.attn[:T].view(T, H, D)
        self.attn_flat = ws.attn[:T]
        self.o = ws.o[:T]
        self.cross_q_flat = ws.q[:T]
        self.cross_q = self.cross_q_flat.view(T, H, D)
        self.ff = ws.ff[:T]
        if c.gated:
            self.gate, self.up = self.ff.chunk(2, dim=-1)
            self.act = ws.act[:T]


class T5Model:
    is_encoder_decoder = True

    tp = None               # encoder-decoders run on one rank
    vocab_parallel = None

    def __init__(self, config: T5Config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_layers
        self.eps = config.rms_norm_eps
        c = config

        take = weight_taker(state_dict, dtype, self.device)

        self.embed = take("shared.weight")
        self.lm_head = take("lm_head.weight") if "lm_head.weight" in state_dict else self.embed
        final_norm = take("decoder.final_layer_norm.weight")
        if c.scale_decoder_outputs:
            # The original T5 multiplies the decoder output by d_model^-0.5 before its tied head.
            # Folded into the final norm's gain, every reader of the final-normed state (logits,
            # the softmax and classifier measures, the fused lm_head_top2_gap) sees it for free.
            final_norm = (final_norm.float() * c.hidden_size ** -0.5).to(dtype)
        self.final_norm = final_norm
        self.layers: list[DecoderLayerWeights] = []
        cross_kv = []
        for i in range(c.num_layers):
            p = f"decoder.block.{i}.layer."
            ff = p + "2.DenseReluDense."
            wi = torch.cat([take(ff + "wi_0.weight"), take(ff + "wi_1.weight")]) if c.gated else take(ff + "wi.weight")
            self.layers.append(DecoderLayerWeights(
                self_norm=take(p + "0.layer_norm.weight"),
                qkv=torch.cat([take(p + f"0.SelfAttention.{n}.weight") for n in "qkv"]),
                self_o=take(p + "0.SelfAttention.o.weight"),
                cross_norm=take(p + "1.layer_norm.weight"),
                cross_q=take(p + "1.EncDecAttention.q.weight"),
                cross_o=take(p + "1.EncDecAttention.o.weight"),
                ff_norm=take(p + "2.layer_norm.weight"), wi=wi, wo=take(ff + "wo.weight")))
            cross_kv += [take(p + "1.EncDecAttention.k.weight"), take(p + "1.EncDecAttention.v.weight")]
        # [L * 2 * inner, d]: every decoder layer's cross-attention K and V projections, so the
        # encoder output becomes the cross K/V of all layers in one GEMM.
        self.cross_kv_weight = torch.cat(cross_kv).contiguous()
        self.self_bias = causal_bias_table(
            take("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"), c.num_buckets,
            c.max_distance)
        self.encoder = T5Encoder(c, take)
        # the LM head as lm_head_logits multiplies it: the same tensor, or its AMX tiles
        self.lm_head_proj = self.lm_head
        if self.device.type == "cpu" and dtype == torch.bfloat16:
            # the decoder's projections in AMX tiles, as LlamaModel's; the encoder runs once per
            # request, through torch
            self.lm_head_proj = tile_projections(self.layers, ("qkv", "self_o", "cross_q", "cross_o", "wi", "wo"),
                                                 self.lm_head)
        if self.device.type == "cpu":  # see eecore.models.huge_pages
            place_in_huge_pages((self, ("embed", "lm_head", "lm_head_proj", "final_norm", "layers", "cross_kv_weight",
                                        "self_bias")),
                                (self.encoder, ("bias_weight", "final_norm", "layers")))
        self.act = _activation_(c.activation)
        self._kv_fill_weights: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    def new_workspace(self, max_tokens: int) -> T5Workspace:
        return T5Workspace(self.config, max_tokens, self.dtype, self.device)

    def decoder_prompt(self) -> list[int]:
        """The decoder's prompt: T5 starts every output with its decoder start token (pad)."""
        return [self.config.decoder_start_token_id]

    # ---- the encoder -------------------------------------------------------------------------
    def encode(self, token_lists: list[list[int]]) -> torch.Tensor:
        """The encoder output of each request, concatenated: `[sum(len), d]`."""
        return self.encoder(self.embed, token_lists)

    def write_cross_kv(self, kv_cache: torch.Tensor, encoder_out: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Every decoder layer's cross-attention K/V of `encoder_out [T, d]` into `kv_cache`
        (`[L, 2, NB, BS, H, D]`) at `slot_mapping [T]` (the requests' cross blocks)."""
        c = self.config
        L, T = c.num_layers, encoder_out.shape[0]
        kv = F.linear(encoder_out, self.cross_kv_weight).view(T, L, 2, c.num_heads, c.head_dim)
        flat = kv_cache.view(L, 2, -1, c.num_heads, c.head_dim)  # slots of every block in a row
        flat[:, :, slot_mapping] = kv.permute(1, 2, 0, 3, 4).to(kv_cache.dtype)

    # ---- decoder pieces (the LlamaModel interface) ------------------------------------------
    def embed_tokens(self, token_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.embed, 0, token_ids, out=out)

    def layer(self, i: int, hidden: torch.Tensor, attn: AttentionInputs, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ws: T5Workspace) -> torch.Tensor:
        """Decoder block `i` on `hidden [T, d]` in place, writing this step's self-attention K/V."""
        if attn.cross_block_table is None:
            raise ValueError("T5Model.layer: the attention inputs carry no cross-attention blocks "
                             "(the sequences were not given encoder inputs)")
        c, w = self.config, self.layers[i]
        v = ws.views(hidden.shape[0])

        x = ops.rms_norm(v.normed, hidden, w.self_norm, self.eps)
        ops.linear(v.qkv, x, w.qkv)
        ops.reshape_and_cache(v.k, v.v, k_cache, v_cache, attn.slot_mapping)
        ops.paged_attention(v.attn, v.q, k_cache, v_cache, attn.block_table, attn.seq_lens, attn.query_start_loc,
                            attn.max_query_len, 1.0, True, self.self_bias)
        o = ops.linear(v.o, v.attn_flat, w.self_o)
        ops.fused_add_rms_norm(o, hidden, w.cross_norm, self.eps)  # hidden += self-attn; o = norm(hidden)

        ops.linear(v.cross_q_flat, o, w.cross_q)
        ops.paged_attention(v.attn, v.cross_q, k_cache, v_cache, attn.cross_block_table, attn.cross_seq_lens,
                            attn.query_start_loc, attn.max_query_len, 1.0, False, None)
        o = ops.linear(v.o, v.attn_flat, w.cross_o)
        ops.fused_add_rms_norm(o, hidden, w.ff_norm, self.eps)  # hidden += cross-attn; o = norm(hidden)

        h = ops.linear(v.ff, o, w.wi)
        if c.gated:
            self.act(v.gate)
            h = torch.mul(v.gate, v.up, out=v.act)
        else:
            self.act(h)
        return ops.linear(hidden, h, w.wo, accumulate=True)  # hidden += feed-forward

    def final_norm_(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(out, hidden, self.final_norm, self.eps)

    def lm_head_logits(self, normed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return ops.linear(out, normed, self.lm_head_proj)

    # ---- early exit support ----------------------------------------------------------------
    def kv_fill_weights(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every decoder layer's self-attention K and V projections stacked `[L, 2 inner, d]`, with
        that layer's self-attention norm gain folded in; no biases (T5 has none)."""
        if self._kv_fill_weights is None:
            inner = self.config.inner_size
            weight = torch.stack([(dense(w.qkv, torch.float32)[inner:] * w.self_norm.float()).to(self.dtype)
                                  for w in self.layers])
            self._kv_fill_weights = (weight.contiguous(), None)
        return self._kv_fill_weights

    def fill_kv(self, kv_cache: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, start_layer: torch.Tensor) -> None:
        weight, _ = self.kv_fill_weights()
        # No RoPE: T5's positions enter through the attention bias, not the keys.
        ops.kv_fill(kv_cache, hidden, weight, None, None, positions, slot_mapping, start_layer, self.eps, True)


def _activation_(name: str):
    """The feed-forward activation, in place on the workspace buffer."""
    if name == "relu":
        return torch.relu_
    if name == "silu":
        return lambda x: F.silu(x, inplace=True)
    approximate = "tanh" if name == "gelu_new" else "none"
    return lambda x: torch.ops.aten.gelu_(x, approximate=approximate)
