"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) on the eecore ops.

The decoder is exposed one piece at a time (embed, layer i, final norm, LM head) so the decoding
strategies can stop after any layer, resume, or run a slice of layers. Every method writes into
caller-provided buffers (see `Workspace`): the decode loop allocates nothing.

The residual stream `hidden [T, d]` is kept explicit between layers (not deferred into the next
norm as some engines do) because early exit reads it: the exit hidden state is the residual
stream after layer E-1, and `kv_fill` starts from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eecore import envs, ops
from eecore.models.amx_weights import tile_projections
from eecore.models.config import ModelConfig
from eecore.models.huge_pages import place_in_huge_pages
from eecore.models.gguf_weights import q8_activations, stack_weights, with_q8_activations
from eecore.models.int8_weights import Weight, dense, eight_bit, project, weight_rows
from eecore.models.rope import cos_sin_cache
from eecore.models.tensor_parallel import shard_config, shard_state_dict
from eecore.models.vocab_parallel import VocabParallel
from eecore.models.weight_prefetch import WeightPrefetch
from eecore.models.weights import weight_taker
from eecore.models.workspace import RowViewCache

# Fused projections (LLM(fused_projections=True) or EECORE_FUSED_PROJECTIONS=1): each layer runs the
# fused projection ops (ops.qkv_projection, linear_residual, gate_up_projection: five launches a
# decode layer on a GPU instead of nine, the norms, RoPE with the cache write, the residual add and
# the activation folded into the projections). Off by default until a GPU has shown them correct and
# faster; on a CPU the ops run the separate ones.


@dataclass
class LayerWeights:
    input_norm: torch.Tensor          # [d]
    qkv: Weight                       # [(Hq + 2 Hkv) D, d]: q, k, v projections stacked
    qkv_bias: Optional[torch.Tensor]  # [(Hq + 2 Hkv) D] (Qwen2)
    o_proj: Weight                    # [d, Hq D]
    post_norm: torch.Tensor           # [d]
    gate_up: Weight                   # [2 I, d]: gate and up projections stacked
    down: Weight                      # [d, I]
    # The projections are dense tensors in the model's dtype, or a GGUF file's blocks (GGUFWeight,
    # or a StackedWeight where q, k and v, or gate and up, differ in type: eecore.models.gguf_weights),
    # or 8-bit (LlamaModel(weight_dtype=torch.int8): eecore.models.int8_weights.eight_bit), or, on
    # a CPU with AMX, their tiles: bf16 [N/16, K/32, 16, 32], int8 [N/16, K/64, 16, 64]
    # (eecore.models.amx_weights; `dense` gives any of them back as [N, K]).


@dataclass
class AttentionInputs:
    """Where this step's tokens sit in the paged cache (built by engine.inputs.InputBuilder)."""
    positions: torch.Tensor        # int64 [T]
    slot_mapping: torch.Tensor     # int64 [T]
    block_table: torch.Tensor      # int32 [B, W]
    seq_lens: torch.Tensor         # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    max_query_len: int
    # Encoder-decoder models only (T5): each row's cross-attention blocks, which hold the K/V of
    # its encoder output in every decoder layer, and the encoder length. None for decoder-only.
    cross_block_table: Optional[torch.Tensor] = None  # int32 [B, Wc]
    cross_seq_lens: Optional[torch.Tensor] = None     # int32 [B]
    # Token-tree rows (speculative verification, see engine.inputs.Row.parents): each query row's
    # ancestor-or-self bitmask over its sequence's query rows. None: every row is a causal chain.
    tree_mask: Optional[torch.Tensor] = None          # int64 [T]


class Workspace:
    """Activation buffers for up to `max_tokens` rows, allocated once per engine."""

    def __init__(self, config: ModelConfig, max_tokens: int, dtype: torch.dtype, device: torch.device):
        c = config
        q_width = c.num_heads * c.head_dim
        qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim

        def buf(width):
            return torch.empty(max_tokens, width, dtype=dtype, device=device)

        self.max_tokens = max_tokens
        self.hidden = buf(c.hidden_size)   # the residual stream
        self.normed = buf(c.hidden_size)
        self.qkv = buf(qkv_width)
        self.attn = buf(q_width)
        self.o = buf(c.hidden_size)
        self.gate_up = buf(2 * c.intermediate_size)
        self.act = buf(c.intermediate_size)
        # the views a layer over T rows reads and writes, made once per T (eecore.models.workspace)
        self.views: RowViewCache[LayerViews] = RowViewCache(lambda T: LayerViews(self, c, T))


class LayerViews:
    """One row count's views of a Workspace (no storage of their own)."""

    def __init__(self, ws: Workspace, c: ModelConfig, T: int):
        q_end = c.num_heads * c.head_dim
        k_end = q_end + c.num_kv_heads * c.head_dim
        self.normed = ws.normed[:T]
        self.qkv = ws.qkv[:T]
        self.q = self.qkv[:, :q_end].view(T, c.num_heads, c.head_dim)
        self.k = self.qkv[:, q_end:k_end].view(T, c.num_kv_heads, c.head_dim)
        self.v = self.qkv[:, k_end:].view(T, c.num_kv_heads, c.head_dim)
        self.attn_flat = ws.attn[:T]
        self.attn = self.attn_flat.view(T, c.num_heads, c.head_dim)
        self.o = ws.o[:T]
        self.gate_up = ws.gate_up[:T]
        self.act = ws.act[:T]


class LlamaModel:
    is_encoder_decoder = False

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, weight_dtype: Optional[torch.dtype] = None, consume_state_dict: bool = False,
                 tp=None):
        """`dtype`: activations and weights. `weight_dtype=torch.int8`: the projections and the LM
        head are 8-bit instead (int8_weights.eight_bit: per-row int8, or Q8_0 blocks where GGUF
        blocks run with 8-bit activations), activations stay in `dtype`; the embeddings and norms
        keep theirs. `consume_state_dict`: take the tensors out
        of `state_dict` as they are used (a caller that needs the checkpoint no more saves a copy).
        `tp`: a TensorParallelGroup of more than one rank: this rank keeps its slice of the weights
        (eecore.distributed.sharding), `config` becomes its slice's (its heads and MLP units), and
        the layers, the embedding and the LM head make their collectives."""
        if weight_dtype not in (None, dtype, torch.int8):
            raise ValueError(f"LlamaModel: 'weight_dtype' must be None, the model's dtype or torch.int8, "
                             f"got {weight_dtype}")
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.full_config = config  # the whole model's (config is this rank's slice under tensor parallelism)
        self.vocab_parallel = None
        if self.tp is not None:
            state_dict = shard_state_dict(state_dict, config, tp.rank, tp.world_size)
            config = shard_config(config, tp.world_size)
            self.vocab_parallel = VocabParallel(tp, config.vocab_size, dtype, torch.device(device))
        self.config = config
        self.dtype = dtype
        self.weight_dtype = dtype if weight_dtype is None else weight_dtype
        self.device = torch.device(device)
        self.num_layers = config.num_layers
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        c = config

        take = weight_taker(state_dict, dtype, self.device, consume=consume_state_dict)
        # the projections as the model keeps them: as loaded (dense, or a GGUF file's blocks), or
        # 8-bit
        proj = eight_bit if self.weight_dtype == torch.int8 else (lambda w: w)

        self.embed: Weight = take("model.embed_tokens.weight")  # dense, or GGUF blocks (embed_tokens)
        self.final_norm = take("model.norm.weight")
        self.lm_head: Weight = proj(self.embed if c.tie_word_embeddings or "lm_head.weight" not in state_dict
                                    else take("lm_head.weight"))
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = stack_weights([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if c.attention_bias else None
            self.layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=proj(qkv), qkv_bias=bias,
                o_proj=proj(take(p + "self_attn.o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=proj(stack_weights([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=proj(take(p + "mlp.down_proj.weight")),
            ))
        q8 = self.device.type == "cpu" and q8_activations()  # EECORE_GGUF_ACTIVATIONS=q8
        if q8:
            for layer in self.layers:
                for name in ("qkv", "o_proj", "gate_up", "down"):
                    setattr(layer, name, with_q8_activations(getattr(layer, name)))
        # the LM head as lm_head_logits multiplies it: the same weight, a GGUF head repacked for
        # 8-bit activations, or AMX tiles
        self.lm_head_proj: Weight = with_q8_activations(self.lm_head) if q8 else self.lm_head
        if self.device.type == "cpu" and self.weight_dtype in (torch.bfloat16, torch.int8):
            # an int8 model is a draft copy, whose logits come from its draft head's rows (DraftHead):
            # a tiled copy of its whole head would go unread
            head = tile_projections(self.layers, ("qkv", "o_proj", "gate_up", "down"),
                                    self.lm_head if self.weight_dtype == torch.bfloat16 else None)
            if head is not None and head is not self.lm_head:
                self.lm_head_proj = head
        if self.device.type == "cpu":  # see eecore.models.huge_pages
            place_in_huge_pages((self, ("embed", "final_norm", "lm_head", "lm_head_proj", "layers")))
        self.cos_sin = cos_sin_cache(c.max_position_embeddings, c.head_dim, c.rope_theta, c.rope_scaling,
                                     device=self.device)
        self.prefetch = WeightPrefetch.for_device(self.device)  # EECORE_PREFETCH_WEIGHTS=1 on a GPU
        # (the fused ops add the projections into the stream, where tensor parallelism must sum them first)
        self.fused_projections = self.tp is None and envs.flag("EECORE_FUSED_PROJECTIONS") and all(
            _is_dense(getattr(w, name), dtype) for w in self.layers for name in ("qkv", "o_proj", "gate_up", "down"))
        self._kv_fill_weights: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    def new_workspace(self, max_tokens: int) -> Workspace:
        return Workspace(self.config, max_tokens, self.dtype, self.device)

    # ---- pieces ----------------------------------------------------------------------------
    def embed_tokens(self, token_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.vocab_parallel is not None:
            return self.vocab_parallel.rows_of(out, self.embed, token_ids)
        return weight_rows(out, self.embed, token_ids)

    def layer(self, i: int, hidden: torch.Tensor, attn: AttentionInputs, k_cache: torch.Tensor,
              v_cache: torch.Tensor, ws: Workspace) -> torch.Tensor:
        """Run decoder layer `i` on `hidden [T, d]` in place, writing this step's K/V."""
        self.layer_qkv(i, hidden, attn, k_cache, v_cache, ws)
        prefetch = self.prefetch is not None and self.prefetch.takes(hidden.shape[0])
        if prefetch:  # the projections after attention, into L2 while attention runs
            w = self.layers[i]
            self.prefetch.fetch((w.o_proj, w.gate_up))
        self.layer_attention(attn, k_cache, v_cache, ws, hidden.shape[0])
        out = self.layer_output(i, hidden, ws)
        if prefetch:
            self.prefetch.join()
        return out

    # A layer in its three parts: what comes before attention, attention, what comes after. A
    # pass that captures everything but attention as CUDA graphs (engine.piecewise) runs the first
    # and the last over padded rows and attention over the real ones.
    def layer_qkv(self, i: int, hidden: torch.Tensor, attn: AttentionInputs, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, ws: Workspace) -> None:
        """Layer `i`'s input norm, Q/K/V projection and RoPE over `hidden [T, d]`, into the
        workspace; this step's K/V into the cache."""
        w, v = self.layers[i], ws.views(hidden.shape[0])
        if self.fused_projections:
            ops.qkv_projection(v.qkv, v.normed, hidden, w.input_norm, self.eps, w.qkv, w.qkv_bias, attn.positions,
                               self.cos_sin, True, k_cache, v_cache, attn.slot_mapping)
            return
        x = ops.rms_norm(v.normed, hidden, w.input_norm, self.eps)
        project(v.qkv, x, w.qkv, w.qkv_bias)
        ops.rotary_embedding_and_cache(attn.positions, v.q, v.k, v.v, self.cos_sin, True, k_cache, v_cache,
                                       attn.slot_mapping)

    def layer_attention(self, attn: AttentionInputs, k_cache: torch.Tensor, v_cache: torch.Tensor, ws: Workspace,
                        num_tokens: int) -> None:
        """Attention of the first `num_tokens` query rows of the workspace (`layer_qkv`'s)."""
        v = ws.views(num_tokens)
        ops.paged_attention(v.attn, v.q, k_cache, v_cache, attn.block_table, attn.seq_lens, attn.query_start_loc,
                            attn.max_query_len, self.scale, True, None, attn.tree_mask)

    def layer_output(self, i: int, hidden: torch.Tensor, ws: Workspace) -> torch.Tensor:
        """Layer `i` after attention: output projection and residual, post norm, MLP and residual,
        in place on `hidden [T, d]`."""
        w, v = self.layers[i], ws.views(hidden.shape[0])
        if self.fused_projections:
            ops.linear_residual(v.o, hidden, v.attn_flat, w.o_proj)  # hidden += attention
            act = ops.gate_up_projection(v.act, v.gate_up, v.normed, hidden, w.post_norm, self.eps, w.gate_up)
            return project(hidden, act, w.down, accumulate=True)  # hidden += mlp
        o = project(v.o, v.attn_flat, w.o_proj)
        if self.tp is not None:  # this rank's heads' share of the output
            self.tp.all_reduce_(o)
        ops.fused_add_rms_norm(o, hidden, w.post_norm, self.eps)  # hidden += attention; o = norm(hidden)
        project(v.gate_up, o, w.gate_up)
        act = ops.silu_and_mul(v.act, v.gate_up)
        if self.tp is not None:  # this rank's MLP units' share, summed before it joins the stream
            return hidden.add_(self.tp.all_reduce_(project(v.o, act, w.down)))
        return project(hidden, act, w.down, accumulate=True)  # hidden += mlp

    def final_norm_(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(out, hidden, self.final_norm, self.eps)

    def lm_head_logits(self, normed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.vocab_parallel is not None:
            return self.vocab_parallel.logits(out, normed, self.lm_head_proj)
        return project(out, normed, self.lm_head_proj)

    def head_rows(self, out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`out [n, d]` = the LM head's rows of token `ids`, dense (a draft vocabulary's, or the
        candidates a guard scores), whichever rank holds them."""
        if self.vocab_parallel is not None:
            return self.vocab_parallel.rows_of(out, self.lm_head, ids)
        return weight_rows(out, self.lm_head, ids)

    # ---- early exit support ----------------------------------------------------------------
    def kv_fill_weights(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every layer's K and V projections stacked `[L, 2 Hkv D, d]`, with that layer's input
        RMSNorm gain folded in (W_l diag(gamma_l)), plus the stacked biases; for `ops.kv_fill`."""
        if self._kv_fill_weights is None:
            c = self.config
            q_end = c.num_heads * c.head_dim
            weight = torch.stack([(dense(w.qkv, torch.float32)[q_end:] * w.input_norm.float()).to(self.dtype)
                                  for w in self.layers])
            bias = torch.stack([w.qkv_bias[q_end:] for w in self.layers]) if c.attention_bias else None
            self._kv_fill_weights = (weight.contiguous(), bias)
        return self._kv_fill_weights

    def fill_kv(self, kv_cache: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, start_layer: torch.Tensor) -> None:
        weight, bias = self.kv_fill_weights()
        ops.kv_fill(kv_cache, hidden, weight, bias, self.cos_sin, positions, slot_mapping, start_layer,
                    self.eps, True)


def _is_dense(weight: Weight, dtype: torch.dtype) -> bool:
    """Whether a projection is a plain [N, K] tensor in the model's dtype (what the fused projection
    ops take), not GGUF blocks, 8-bit or AMX tiles."""
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == dtype
