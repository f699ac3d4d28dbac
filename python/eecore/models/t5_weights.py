"""The state-dict layout of an HF T5 checkpoint, checked before the model reads it.

HF names are kept. After `normalize_t5_state_dict` the dict holds exactly the tensors
`expected_t5_shapes` lists: the per-stack copies of the shared embedding are dropped (HF ties
them to `shared.weight`), and `lm_head.weight` is present only when the checkpoint has a head
of its own (T5 v1.1); otherwise the model reads its logits through `shared.weight`.
"""
from __future__ import annotations

import torch

from eecore.models.errors import CorruptCheckpointError
from eecore.models.t5_config import T5Config

# Copies of shared.weight that some checkpoints store (HF ties them; they are never distinct).
_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def expected_t5_shapes(config: T5Config, with_lm_head: bool) -> dict[str, tuple[int, ...]]:
    c = config
    d, inner, ff = c.hidden_size, c.inner_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"shared.weight": (c.vocab_size, d),
                                          "encoder.final_layer_norm.weight": (d,),
                                          "decoder.final_layer_norm.weight": (d,)}
    if with_lm_head:
        shapes["lm_head.weight"] = (c.vocab_size, d)

    def attention(prefix: str) -> None:
        for n in "qkv":
            shapes[f"{prefix}.{n}.weight"] = (inner, d)
        shapes[f"{prefix}.o.weight"] = (d, inner)

    def feed_forward(prefix: str) -> None:
        if c.gated:
            shapes[f"{prefix}.wi_0.weight"] = (ff, d)
            shapes[f"{prefix}.wi_1.weight"] = (ff, d)
        else:
            shapes[f"{prefix}.wi.weight"] = (ff, d)
        shapes[f"{prefix}.wo.weight"] = (d, ff)

    for stack, depth, sublayers in (("encoder", c.num_encoder_layers, 2), ("decoder", c.num_layers, 3)):
        shapes[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (c.num_buckets, c.num_heads)
        for i in range(depth):
            p = f"{stack}.block.{i}.layer."
            attention(p + "0.SelfAttention")
            if sublayers == 3:
                attention(p + "1.EncDecAttention")
            feed_forward(p + f"{sublayers - 1}.DenseReluDense")
            for j in range(sublayers):
                shapes[p + f"{j}.layer_norm.weight"] = (d,)
    return shapes


def normalize_t5_state_dict(state_dict: dict[str, torch.Tensor], config: T5Config, source: str) -> None:
    """Drop the tied embedding copies, then raise CorruptCheckpointError naming `source` unless
    the names and shapes are exactly those expected."""
    for name in _TIED_COPIES:
        state_dict.pop(name, None)
    expected = expected_t5_shapes(config, with_lm_head="lm_head.weight" in state_dict)
    missing = [n for n in expected if n not in state_dict]
    if missing:
        raise CorruptCheckpointError(
            f"{source}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:3]} (expected "
            f"{len(expected)} tensors for a T5 with {config.num_encoder_layers} encoder and {config.num_layers} "
            f"decoder layers, feed-forward {'gated-' if config.gated else ''}{config.activation})")
    unexpected = [n for n in state_dict if n not in expected]
    if unexpected:
        raise CorruptCheckpointError(f"{source}: {len(unexpected)} unexpected tensor(s) for a T5 model, "
                                     f"e.g. {unexpected[:3]} (does config.json match the weights?)")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise CorruptCheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(state_dict[name].shape)}, expected {shape} from the config")
