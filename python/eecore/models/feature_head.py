"""A feature-level draft head (EAGLE-style): one decoder layer on top of the target model that
drafts from the target's own hidden states instead of from an early layer's.

What it reads, for a sequence whose last verified position is p: the residual stream after a low,
a middle and a high layer of the target at p (each RMS-normalized, then fused into one state by a
linear map), and the embedding of the token at p + 1 (the one the target emitted at p). It drafts
the token at p + 2; then, as EAGLE's heads do, it goes on from its own output state instead of the
target's (which it does not have for a drafted position) and the drafted token's embedding, one
step a draft. Its logits come from the target's own LM head (over the draft vocabulary, where there
is one), after a norm of its own.

Its attention covers the round's window only: the positions it has drafted in this round, from the
verified one on. The target's states already carry the context; a window of d + 1 positions keeps
the head free of any cache between rounds (no K/V in the pool, nothing to catch up on after a
round drafted by other means), and training unrolls exactly these windows from the target's states
(eecore.train.feature_head: what EAGLE-3 calls training-time test, with no gap left between the
trained and the run procedure).

The weights are plain tensors and `step` is plain PyTorch: the same code trains (with autograd) and
drafts. A head file (safetensors) carries the weights, the tapped layers, the draft vocabulary and
the fingerprint of the target it was trained on, which loading checks.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from eecore.models.exit_adapter import _DATA, check_fingerprint, model_fingerprint
from eecore.models.int8_weights import Int8Weight
from eecore.models.rope import cos_sin_cache

FORMAT = "eecore-feature-head-1"
# the head trained by eecore for the default model, shipped inside the package (its card beside it)
SHIPPED_FILE = os.path.join(_DATA, "smollm2-135m-instruct-feature-head.safetensors")
WEIGHTS = ("fuse", "merge", "norm_attn", "qkv", "o", "norm_mlp", "gate_up", "down", "norm_out")
SCALE = ".scale"  # a matrix stored as 8-bit integers: its scale a row (FeatureHead.save(dtype=torch.int8))


def default_taps(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high: the residual stream after these many layers (EAGLE-3's choice of a low,
    a middle and a high layer; distinct and below the last layer, whose output the final norm reads)."""
    taps = sorted({min(2, num_layers - 1), max(1, num_layers // 2), max(1, num_layers - 2)})
    return tuple(t for t in taps if 1 <= t < num_layers) or (1,)


@dataclass
class FeatureHead:
    """The head's weights (fp32 or the target's dtype) and what it was made for."""
    weights: dict[str, torch.Tensor]
    taps: tuple[int, ...]                   # the target's layers it reads: the stream after that many layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    vocab: Optional[torch.Tensor] = None    # int64 [K]: the draft vocabulary's token ids (None: all)
    base: dict = field(default_factory=dict)  # models.exit_adapter.model_fingerprint of the target
    info: dict = field(default_factory=dict)  # how it was trained
    _cos_sin: Optional[torch.Tensor] = None

    # ---- making one ----------------------------------------------------------------------------
    @classmethod
    def initialized(cls, model, taps: Optional[tuple[int, ...]] = None, intermediate_size: Optional[int] = None,
                    vocab: Optional[torch.Tensor] = None, seed: int = 0) -> "FeatureHead":
        """A new head for `model` (an eecore LlamaModel), fp32, randomly initialized (the fused state
        starts as the mean of the tapped streams, the merge as their sum with the token's embedding)."""
        c = model.config
        taps = tuple(taps or default_taps(c.num_layers))
        if not taps or any(not 1 <= t < c.num_layers for t in taps) or list(taps) != sorted(set(taps)):
            raise ValueError(f"FeatureHead: 'taps' must be distinct ascending layer counts in 1..{c.num_layers - 1}, "
                             f"got {taps}")
        d, hd, inter = c.hidden_size, c.head_dim, intermediate_size or c.intermediate_size
        g = torch.Generator().manual_seed(seed)

        def rand(*shape, scale=0.02):
            return torch.randn(*shape, generator=g) * scale

        eye = torch.eye(d)
        weights = {
            "fuse": torch.cat([eye / len(taps)] * len(taps), dim=1) + rand(d, d * len(taps), scale=0.002),
            "merge": torch.cat([eye, eye], dim=1) + rand(d, 2 * d, scale=0.002),
            "norm_attn": torch.ones(d), "qkv": rand((c.num_heads + 2 * c.num_kv_heads) * hd, d),
            "o": rand(d, c.num_heads * hd) / 4, "norm_mlp": torch.ones(d), "gate_up": rand(2 * inter, d),
            "down": rand(d, inter) / 4, "norm_out": torch.ones(d)}
        return cls(weights, taps, c.num_heads, c.num_kv_heads, hd, c.rms_norm_eps, c.rope_theta,
                   None if vocab is None else vocab.to(torch.int64), model_fingerprint(model))

    def widened(self, intermediate_size: int, seed: int = 0) -> "FeatureHead":
        """This head with an MLP of `intermediate_size` neurons: the new ones read the input as the old
        ones do (random rows at their scale) and write nothing yet (zero columns of `down`), so the
        wider head drafts exactly what this one does until training moves them."""
        w = self.weights
        d, old = w["down"].shape
        if intermediate_size < old:
            raise ValueError(f"FeatureHead.widened: 'intermediate_size' must be at least the MLP's {old}, "
                             f"got {intermediate_size}")
        g = torch.Generator().manual_seed(seed)
        gate, up = w["gate_up"].float().chunk(2, dim=0)
        extra = intermediate_size - old

        def more_rows(rows):
            return torch.cat([rows, torch.randn(extra, d, generator=g) * float(rows.std())])
        weights = dict(w, gate_up=torch.cat([more_rows(gate), more_rows(up)]),
                       down=torch.cat([w["down"].float(), torch.zeros(d, extra)], dim=1))
        return dataclasses.replace(self, weights=weights)

    # ---- the head's step -------------------------------------------------------------------------
    def start_state(self, features: torch.Tensor, linear: Callable = F.linear) -> torch.Tensor:
        """The fused state `[N, d]` of the target's tapped streams `[N, len(taps) * d]` (`linear`: as step's)."""
        d = self.weights["fuse"].shape[0]
        parts = features.float().view(features.shape[0], len(self.taps), d)
        normed = F.rms_norm(parts, (d,), eps=self.eps).reshape(features.shape[0], -1)
        return linear(normed, self.weights["fuse"])

    def step(self, state: torch.Tensor, token_embedding: torch.Tensor, head_rows,
             window: Optional[tuple[torch.Tensor, torch.Tensor]] = None, linear: Callable = F.linear):
        """One drafted position for N windows at once: the window's state so far (`state` `[N, d]`:
        the fused target state at the window's start, then the head's own output), the embedding of
        the token at this position `[N, d]`, and the window's keys and values so far (None at its
        start). Returns (the output state `[N, d]`, fp32 logits over `head_rows` `[N, K]` (the target's
        LM head rows of the draft vocabulary), the window's keys and values with this position's).
        `linear(x, weight)` multiplies: F.linear to train (autograd), eecore's own kernel to draft
        (FeatureDraftHead: the weights there may be 8-bit)."""
        w = self.weights
        N, H, Hkv, hd = state.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        h = linear(torch.cat([token_embedding.float(), state.float()], dim=-1), w["merge"])
        qkv = linear(F.rms_norm(h, (h.shape[-1],), w["norm_attn"], self.eps), w["qkv"])
        q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        groups = H // Hkv
        if window is None:
            # the window's first position attends to itself alone: its softmax weight is 1, and the
            # rotation at position 0 is the identity, so each head reads its group's value as it is
            # (the same numbers, without a dozen small ops: every draft round runs this step)
            keys, values = k.reshape(N, 1, Hkv, hd), v.reshape(N, 1, Hkv, hd)
            attended = values.expand(N, groups, Hkv, hd).transpose(1, 2)                   # [N, Hkv, groups, hd]
        else:
            cos, sin = self._rope(window[0].shape[1], state.device)
            q, k = rotate_half(q.view(N, H, hd), cos, sin), rotate_half(k.view(N, Hkv, hd), cos, sin)
            keys = torch.cat([window[0], k[:, None]], dim=1)                                 # [N, j+1, Hkv, hd]
            values = torch.cat([window[1], v.view(N, 1, Hkv, hd)], dim=1)
            scores = torch.einsum("nhd,njhd->nhj", q, keys.repeat_interleave(groups, dim=2)) / hd ** 0.5
            attended = torch.einsum("nhj,njhd->nhd", scores.softmax(dim=-1), values.repeat_interleave(groups, dim=2))
        h = h + linear(attended.reshape(N, H * hd), w["o"])
        gate, up = linear(F.rms_norm(h, (h.shape[-1],), w["norm_mlp"], self.eps), w["gate_up"]).chunk(2, dim=-1)
        h = h + linear(F.silu(gate) * up, w["down"])
        logits = linear(F.rms_norm(h, (h.shape[-1],), w["norm_out"], self.eps), head_rows)
        return h, logits, (keys, values)

    def _rope(self, position: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None or self._cos_sin.device != torch.device(device):
            self._cos_sin = cos_sin_cache(64, self.head_dim, self.rope_theta, device=device)
        row = self._cos_sin[position]
        half = self.head_dim // 2
        return row[:half], row[half:]

    # ---- files -----------------------------------------------------------------------------------
    def save(self, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """The file: its weights in `dtype` (a float type), or with torch.int8 its matrices as per-row
        symmetric 8-bit integers with a scale a row (`NAME` and `NAME.scale`, half a bf16 file's
        bytes; its norms in bf16), which loading widens back to floats."""
        from safetensors.torch import save_file

        tensors = {}
        for name, t in self.weights.items():
            t = t.detach().cpu()
            if dtype == torch.int8 and t.dim() == 2:
                quantized = Int8Weight.quantize(t)
                tensors[name], tensors[name + SCALE] = quantized.data, quantized.scale
            else:
                tensors[name] = t.to(torch.bfloat16 if dtype == torch.int8 else dtype).contiguous()
        if self.vocab is not None:
            tensors["draft_vocab"] = self.vocab.to(torch.int32).contiguous().cpu()
        config = dict(taps=list(self.taps), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                      head_dim=self.head_dim, eps=self.eps, rope_theta=self.rope_theta)
        save_file(tensors, path, metadata={"format": FORMAT, "config": json.dumps(config),
                                           "base": json.dumps(self.base), "info": json.dumps(self.info)})

    @classmethod
    def load(cls, path: str, model=None) -> "FeatureHead":
        """A head file; with `model`, checked to fit it (its shape and fingerprint)."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not a feature head file (format {meta.get('format')!r}, "
                                 f"expected {FORMAT!r})")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        missing = [name for name in WEIGHTS if name not in tensors]
        if missing:
            raise ValueError(f"{path}: a feature head file without {', '.join(missing)}")
        config, base = json.loads(meta["config"]), json.loads(meta.get("base", "{}"))
        vocab = tensors.pop("draft_vocab", None)
        weights = {name: Int8Weight(tensors[name], tensors[name + SCALE]).dequantize(torch.float32)
                   if name + SCALE in tensors else tensors[name].float() for name in WEIGHTS}
        head = cls(weights, tuple(config["taps"]), config["num_heads"],
                   config["num_kv_heads"], config["head_dim"], config["eps"], config["rope_theta"],
                   None if vocab is None else vocab.to(torch.int64), base, json.loads(meta.get("info", "{}")))
        if model is not None:
            head.check_fits(model, path)
        return head

    def check_fits(self, model, source: str = "FeatureHead") -> None:
        """Raises unless this head was made for `model` (shape, embedding checksum, layers, vocabulary)."""
        c = getattr(model, "full_config", model.config)  # (the head is whole on every tensor-parallel rank)
        check_fingerprint(self.base, model, source)
        if self.weights["fuse"].shape != (c.hidden_size, c.hidden_size * len(self.taps)) or \
                (self.num_heads, self.num_kv_heads, self.head_dim) != (c.num_heads, c.num_kv_heads, c.head_dim):
            raise ValueError(f"{source}: its shapes do not fit this model")
        if any(not 1 <= t < c.num_layers for t in self.taps):
            raise ValueError(f"{source}: taps layers {self.taps}, outside this model's 1..{c.num_layers - 1}")
        if self.vocab is not None and (int(self.vocab.min()) < 0 or int(self.vocab.max()) >= c.vocab_size):
            raise ValueError(f"{source}: its draft vocabulary names tokens outside this model's {c.vocab_size}")

    def to(self, device, dtype: torch.dtype = torch.float32) -> "FeatureHead":
        self.weights = {name: t.to(device=device, dtype=dtype) for name, t in self.weights.items()}
        if self.vocab is not None:
            self.vocab = self.vocab.to(device)
        return self


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `[..., heads, hd]`, `cos` and `sin` `[hd / 2]` or broadcasting to it (rotate-half pairs, as
    the Llama family)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
