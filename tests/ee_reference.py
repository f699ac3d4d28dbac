"""A pure-PyTorch early-exit decoder written from the seed paper's Algorithm 1, as a test oracle.

It uses an HF Llama-family model's weights and modules but none of eecore: a contiguous per-row,
per-layer KV cache, one row at a time, layer by layer. Rows decode in lockstep like a batch:
- rule "all" (Algorithm 1): every row runs each layer until every row's sticky status is set;
  all rows then take their tokens from the hidden state at that layer;
- rule "compact" / batch 1: each row stops at its own first confident layer.
After the exit at layer E, the K/V of layers E..L-1 are computed from the exit hidden state
(KV cache filling, Algorithm 1 lines 9-11), which later tokens attend to.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class ReferenceEarlyExit:
    def __init__(self, hf_model, measure: str = "softmax", threshold: float = 0.5, min_exit_layer: int = 1,
                 check_every: int = 1, exit_layer: int | None = None, rule: str = "all", decay=None,
                 classifier=None, exit_logits=None, decisions=None):
        self.m = hf_model.model
        self.lm_head = hf_model.lm_head
        self.cfg = hf_model.config
        self.L = self.cfg.num_hidden_layers
        self._settings(measure, threshold, min_exit_layer, check_every, exit_layer, rule, decay, classifier,
                       exit_logits)
        # measure "agreement": {E: (mean, std, weight, bias)} of a logistic regression per exit layer
        self.decisions = decisions or {}
        self.heads = self.cfg.num_attention_heads
        self.kv_heads = self.cfg.num_key_value_heads
        self.head_dim = getattr(self.cfg, "head_dim", None) or self.cfg.hidden_size // self.heads

    def _settings(self, measure, threshold, min_exit_layer, check_every, exit_layer, rule, decay, classifier,
                  exit_logits):
        self.measure, self.threshold, self.rule = measure, threshold, rule
        self.min_exit_layer, self.check_every, self.exit_layer = min_exit_layer, check_every, exit_layer
        self.decay, self.classifier = decay, classifier
        # {E: fn(h) -> logits}: the exit heads of exit adapters; only their layers are checked
        self.exit_logits = exit_logits or {}

    # ---- model hooks (tests/t5_ee_reference.py overrides them for T5) -------------------------
    def _embed(self, token):
        return self.m.embed_tokens.weight[token]

    def _final_norm(self, h):
        return self.m.norm(h)

    def _new_cache(self, b):
        """Row b's cache: per layer, the lists of its K and V vectors."""
        return [([], []) for _ in range(self.L)]

    # ---- one layer, one row ---------------------------------------------------------------
    def _rope(self, x, pos):
        cos, sin = self.m.rotary_emb(x, torch.tensor([[pos]]))
        cos, sin = cos[0, 0], sin[0, 0]  # [D]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _kv(self, layer, h, pos):
        x = layer.input_layernorm(h)
        k = layer.self_attn.k_proj(x).view(self.kv_heads, self.head_dim)
        v = layer.self_attn.v_proj(x).view(self.kv_heads, self.head_dim)
        return self._rope(k, pos), v

    def _layer(self, i, h, pos, cache):
        layer = self.m.layers[i]
        x = layer.input_layernorm(h)
        q = self._rope(layer.self_attn.q_proj(x).view(self.heads, self.head_dim), pos)
        k, v = self._kv(layer, h, pos)
        cache[i][0].append(k)
        cache[i][1].append(v)
        K = torch.stack(cache[i][0]).repeat_interleave(self.heads // self.kv_heads, dim=1)  # [S, H, D]
        V = torch.stack(cache[i][1]).repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = torch.einsum("hd,shd->hs", q, K) / math.sqrt(self.head_dim)
        attn = torch.einsum("hs,shd->hd", scores.softmax(-1), V).reshape(-1)
        h = h + layer.self_attn.o_proj(attn)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _logits(self, h, E=None):
        if E in self.exit_logits:
            return self.exit_logits[E](h)
        return self.lm_head(self._final_norm(h))

    def _confidence(self, E, h, prev):
        if self.measure == "softmax":
            top2 = self._logits(h, E).softmax(-1).topk(2).values
            return float(top2[0] - top2[1])
        if self.measure == "cosine":
            return float(F.cosine_similarity(prev, h, dim=0))
        if self.measure == "agreement":
            p = self._logits(h, E).float().softmax(-1)
            top = p.topk(2)
            entropy = -sum(float(q) * math.log(float(q)) for q in p if q > 0)
            proposal = lookup_next(self._row_tokens)
            token = int(top.indices[0])
            x = torch.tensor([float(top.values[0]), float(top.values[0] - top.values[1]), entropy,
                              float(proposal is not None), float(proposal == token)])
            mean, std, weight, bias = self.decisions[E]
            return float(torch.sigmoid(((x - mean) / std) @ weight + bias))
        w1, b1, w2, b2 = self.classifier[E]
        z = torch.relu(w1 @ self._final_norm(h) + b1)
        return float(torch.sigmoid(w2 @ z + b2[0]))

    def _threshold(self, t, max_tokens):
        if self.decay is None:
            return self.threshold
        return min(max(0.9 * self.threshold + 0.1 * math.exp(-self.decay * t / max_tokens), 0.0), 1.0)

    def _checked(self, E):
        return self.measure != "static" and E < self.L and E >= self.min_exit_layer \
            and (E - self.min_exit_layer) % self.check_every == 0 \
            and (not self.exit_logits or E in self.exit_logits) \
            and (self.measure != "agreement" or E in self.decisions)

    # ---- generation ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int):
        B, L = len(prompts), self.L
        caches = [self._new_cache(b) for b in range(B)]
        tokens, exits = [[] for _ in range(B)], [[] for _ in range(B)]
        last = []
        for b, prompt in enumerate(prompts):  # prefill: every layer, token by token
            for pos, tok in enumerate(prompt):
                h = self._embed(tok)
                for i in range(L):
                    h = self._layer(i, h, pos, caches[b])
            last.append(int(self._logits(h).argmax()))
            tokens[b].append(last[b])
            exits[b].append(L)
        for t in range(1, max_tokens):
            pos = [len(p) + t - 1 for p in prompts]
            h = [self._embed(last[b]) for b in range(B)]
            status, exit_at, exit_h = [False] * B, [None] * B, [None] * B
            for E in range(1, L + 1):
                for b in range(B):
                    if exit_at[b] is not None:
                        continue
                    prev = h[b]
                    self._row_tokens = prompts[b] + tokens[b]
                    h[b] = self._layer(E - 1, h[b], pos[b], caches[b])
                    if self._checked(E) and self._confidence(E, h[b], prev) > self._threshold(t, max_tokens):
                        status[b] = True  # sticky
                    if self.measure == "static" and E == self.exit_layer:
                        status[b] = True
                    if self.rule == "compact" and status[b]:
                        exit_at[b], exit_h[b] = E, h[b]
                if self.rule == "all" and all(status):
                    exit_at, exit_h = [E] * B, list(h)
                if all(e is not None for e in exit_at):
                    break
            for b in range(B):
                E = exit_at[b] or L
                hb = exit_h[b] if exit_h[b] is not None else h[b]
                for j in range(E, L):  # fill the skipped layers' KV from the exit hidden state
                    k, v = self._kv(self.m.layers[j], hb, pos[b])
                    caches[b][j][0].append(k)
                    caches[b][j][1].append(v)
                last[b] = int(self._logits(hb, E).argmax())
                tokens[b].append(last[b])
                exits[b].append(E)
        return tokens, exits


def lookup_next(tokens: list[int], min_n: int = 2, max_n: int = 4):
    """Prompt lookup by its definition: for n from max_n down to min_n, the token that followed the
    most recent earlier occurrence of the last n tokens (None: no n matches)."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n]
    return None
