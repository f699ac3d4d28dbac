"""Low-rank weight deltas (LoRA) that eecore merges into a checkpoint's weights when it loads them.

A LoRA pair for a linear layer with weight W [out, in] is A [r, in] and B [out, r]; the layer's
weight becomes W + scale * B A, scale = alpha / r as in the LoRA paper and `peft`. The deltas are
merged once, into the loaded state dict (Hugging Face names), before the model is built, so
inference runs plain dense weights: no extra matmul per step, and every op, kernel and test of the
dense model applies unchanged.

Pairs are keyed by the module path of the weight they change, e.g.
`model.layers.3.self_attn.q_proj` changes `model.layers.3.self_attn.q_proj.weight`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from eecore.models.int8_weights import dense

# The projections of a Llama-family decoder layer a LoRA may change, by their HF module names.
LLAMA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def layer_index(path: str) -> Optional[int]:
    """The decoder layer of a module path or state-dict key ("model.layers.3.mlp.up_proj" -> 3);
    None for a key outside the layers (embeddings, final norm, LM head)."""
    prefix = "model.layers."
    return int(path[len(prefix):].split(".", 1)[0]) if path.startswith(prefix) else None


@dataclass
class LoraDeltas:
    """LoRA pairs by module path (see the module doc), all of one rank, and their common scale."""
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return next(iter(self.pairs.values()))[0].shape[0] if self.pairs else 0

    def validate(self, source: str = "LoRA") -> None:
        if not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale) or self.scale == 0:
            raise ValueError(f"{source}: LoRA scale must be a non-zero finite number, got {self.scale!r}")
        for path, (a, b) in self.pairs.items():
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] != self.rank:
                raise ValueError(f"{source}: LoRA pair {path!r} has inconsistent shapes A {tuple(a.shape)}, "
                                 f"B {tuple(b.shape)} (expected A [r, in], B [out, r] with r = {self.rank})")

    def check_state_dict(self, state_dict: dict[str, torch.Tensor], source: str = "LoRA") -> None:
        """Raises unless every pair changes a weight of `state_dict` of the shape [B.rows, A.cols]."""
        for path, (a, b) in self.pairs.items():
            weight = state_dict.get(path + ".weight")
            if weight is None:
                raise ValueError(f"{source}: LoRA pair {path!r} changes {path}.weight, which the model does not have")
            if tuple(weight.shape) != (b.shape[0], a.shape[1]):
                raise ValueError(f"{source}: LoRA pair {path!r} is for a weight of shape {(b.shape[0], a.shape[1])}, "
                                 f"the model's {path}.weight is {tuple(weight.shape)}")

    def delta(self, path: str) -> torch.Tensor:
        """scale * B A in fp32: what merging adds to `path`'s weight."""
        a, b = self.pairs[path]
        return self.scale * (b.float() @ a.float())

    def merge_into(self, state_dict: dict[str, torch.Tensor], source: str = "LoRA") -> None:
        """Adds every delta to its weight in place (computed in fp32, stored in the weight's dtype; a
        weight in GGUF blocks becomes dense: requantizing would change the merged model)."""
        self.check_state_dict(state_dict, source)
        for path in self.pairs:
            name = path + ".weight"
            weight = state_dict[name]
            if isinstance(weight, torch.Tensor):
                state_dict[name] = (weight.float() + self.delta(path).to(weight.device)).to(weight.dtype)
            else:  # a GGUF file's blocks: the merged weight is dense fp32 (the model casts it)
                state_dict[name] = dense(weight, torch.float32) + self.delta(path).to(weight.device)

    def truncated(self, rank: int) -> "LoraDeltas":
        """The best rank-`rank` approximation of every delta (truncated SVD, Eckart-Young), as pairs
        of that rank with this scale; the singular values are split evenly between A and B. A
        smaller file for a small loss: a trained delta's spectrum falls off (bench figures in the
        draft-layers card)."""
        if not isinstance(rank, int) or not 1 <= rank <= self.rank:
            raise ValueError(f"LoRA: truncation rank must be an int in [1, {self.rank}], got {rank!r}")
        pairs = {}
        for path, (a, b) in self.pairs.items():
            u, s, vh = torch.linalg.svd(b.float() @ a.float(), full_matrices=False)
            root = s[:rank].sqrt()
            pairs[path] = ((root[:, None] * vh[:rank]).to(a.dtype), (u[:, :rank] * root).to(b.dtype))
        return LoraDeltas(pairs, self.scale)

    # ---- the adapter file's tensors (eecore.models.exit_adapter) ------------------------------
    def tensors(self, prefix: str = "lora.") -> dict[str, torch.Tensor]:
        out = {}
        for path, (a, b) in self.pairs.items():
            out[f"{prefix}{path}.a"] = a.detach().contiguous().cpu()
            out[f"{prefix}{path}.b"] = b.detach().contiguous().cpu()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], scale: float, source: str,
                     prefix: str = "lora.") -> "LoraDeltas":
        pairs: dict[str, list] = {}
        for name, t in tensors.items():
            if not name.startswith(prefix):
                continue
            path, _, which = name[len(prefix):].rpartition(".")
            if not path or which not in ("a", "b"):
                raise ValueError(f"{source}: tensor {name!r} is not named {prefix}<module path>.a|b")
            pairs.setdefault(path, [None, None])["ab".index(which)] = t
        for path, (a, b) in pairs.items():
            if a is None or b is None:
                raise ValueError(f"{source}: LoRA pair {path!r} lacks its {'A' if a is None else 'B'} matrix")
        out = cls({p: (a, b) for p, (a, b) in pairs.items()}, scale)
        out.validate(source)
        return out
