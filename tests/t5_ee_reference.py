"""The seed paper's Algorithm 1 on a T5 decoder, in pure PyTorch on HF's T5 modules: the oracle of
the T5 early-exit tests. It reuses ReferenceEarlyExit's generation loop (tests/ee_reference.py)
and replaces the model pieces:
- each row's encoder output comes from HF's encoder and is attended to by every decoder layer's
  cross-attention (recomputed from it, never cached: cross-attention needs no fill);
- self-attention K/V go into a contiguous per-row, per-layer list, with HF's relative position
  buckets as the bias; after an exit at E the K/V of layers E..L-1 are computed from the exit
  hidden state (no RoPE, no bias: K = W_k norm(h), V = W_v norm(h));
- the logits are HF's head on the final-normed state (times d_model^-0.5 for the original T5).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ee_reference import ReferenceEarlyExit


class _RowCache(list):
    """Row b's per-layer self-attention K/V lists, plus its encoder output."""

    def __init__(self, layers, encoder_out):
        super().__init__(layers)
        self.encoder_out = encoder_out


class T5ReferenceEarlyExit(ReferenceEarlyExit):
    def __init__(self, hf_t5, encoder_inputs: list[list[int]], measure: str = "softmax", threshold: float = 0.5,
                 min_exit_layer: int = 1, check_every: int = 1, exit_layer: int | None = None, rule: str = "all",
                 decay=None, classifier=None):
        from transformers.models.t5.modeling_t5 import T5Attention

        self.hf = hf_t5
        self.cfg = hf_t5.config
        self.dec = hf_t5.decoder
        self.m = SimpleNamespace(layers=self.dec.block)  # what the base class's fill loop reads
        self.lm_head = hf_t5.lm_head
        self.L = self.cfg.num_decoder_layers
        self._settings(measure, threshold, min_exit_layer, check_every, exit_layer, rule, decay, classifier, None)
        self.H, self.D = self.cfg.num_heads, self.cfg.d_kv
        self.scale = self.cfg.d_model ** -0.5 if self.cfg.scale_decoder_outputs else 1.0
        self.bucket = T5Attention._relative_position_bucket
        self.bias = self.dec.block[0].layer[0].SelfAttention.relative_attention_bias
        with torch.no_grad():
            self.encoder_outs = [hf_t5.encoder(input_ids=torch.tensor([e])).last_hidden_state[0]
                                 for e in encoder_inputs]

    def generate(self, max_tokens: int):
        start = [[self.cfg.decoder_start_token_id] for _ in self.encoder_outs]
        return super().generate(start, max_tokens)

    # ---- model hooks ----------------------------------------------------------------------
    def _embed(self, token):
        return self.hf.shared.weight[token]

    def _final_norm(self, h):
        return self.dec.final_layer_norm(h) * self.scale

    def _new_cache(self, b):
        return _RowCache([([], []) for _ in range(self.L)], self.encoder_outs[b])

    def _kv(self, block, h, pos):
        attention = block.layer[0]
        x = attention.layer_norm(h)
        return (attention.SelfAttention.k(x).view(self.H, self.D), attention.SelfAttention.v(x).view(self.H, self.D))

    def _layer(self, i, h, pos, cache):
        block = self.dec.block[i]
        self_attn = block.layer[0]
        x = self_attn.layer_norm(h)
        q = self_attn.SelfAttention.q(x).view(self.H, self.D)
        k, v = self._kv(block, h, pos)
        cache[i][0].append(k)
        cache[i][1].append(v)
        K, V = torch.stack(cache[i][0]), torch.stack(cache[i][1])  # [S, H, D]
        relative = torch.arange(K.shape[0]) - pos  # key position - query position
        buckets = self.bucket(relative, bidirectional=False, num_buckets=self.cfg.relative_attention_num_buckets,
                              max_distance=self.cfg.relative_attention_max_distance)
        scores = torch.einsum("hd,shd->hs", q, K) + self.bias(buckets).T  # T5: no 1/sqrt(D)
        h = h + self_attn.SelfAttention.o(torch.einsum("hs,shd->hd", scores.softmax(-1), V).reshape(-1))

        cross = block.layer[1]
        x = cross.layer_norm(h)
        q = cross.EncDecAttention.q(x).view(self.H, self.D)
        enc = cache.encoder_out
        K = cross.EncDecAttention.k(enc).view(-1, self.H, self.D)
        V = cross.EncDecAttention.v(enc).view(-1, self.H, self.D)
        scores = torch.einsum("hd,shd->hs", q, K)
        h = h + cross.EncDecAttention.o(torch.einsum("hs,shd->hd", scores.softmax(-1), V).reshape(-1))
        return block.layer[2](h.unsqueeze(0))[0]  # T5LayerFF: h + ff(norm(h))
