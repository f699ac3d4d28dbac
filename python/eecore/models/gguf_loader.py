"""Loading a Llama-family GGUF file (llama.cpp's format) into HF-layout weights.

Three translations happen here:
  * metadata keys (`llama.block_count`, ...) -> `ModelConfig`;
  * tensor names (`blk.3.attn_q.weight`, ...) -> HF names (`model.layers.3.self_attn.q_proj.weight`),
    each tensor dequantized to the requested dtype, or, with `keep_quantized`, each matrix in a block
    type eecore's kernels compute kept in its blocks (a `GGUFWeight`);
  * the row order of Q and K. llama.cpp's converter permutes the rows of every head of q_proj and
    k_proj so that its "normal" RoPE, which rotates adjacent pairs (x0, x1), (x2, x3), ..., computes
    what HF's rotate-half RoPE computes on pairs (x0, x_{d/2}), (x1, x_{d/2+1}), .... We undo that, so
    the weights equal the HF checkpoint and the decoder uses HF's (NeoX-style) RoPE for every format.
    Qwen2 files are not permuted: llama.cpp runs them with NeoX RoPE directly.
"""
from __future__ import annotations

import math
import re

import torch

from eecore.models.config import ModelConfig
from eecore.models.errors import CorruptCheckpointError, UnsupportedModelError
from eecore import ops
from eecore.models.gguf_file import GGUFFile
from eecore.models.gguf_weights import GGUFWeight
from eecore.models.gguf_tokenizer import tokenizer_from_gguf
from eecore.models.huge_pages import weight_buffer
from eecore.models.tokenizer import Tokenizer
from eecore.models.weights import WEIGHT_ALIGNMENT, check_state_dict

# general.architecture -> ModelConfig.architecture. Mistral (v0.x) files say "llama".
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# Architectures whose converter permuted the Q/K rows for llama.cpp's adjacent-pair RoPE.
_PERMUTED_QK = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp stores Llama 3.x's rope scaling as this per-frequency divisor table, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None if it is not a Llama-family weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_qk(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's row permutation of a q/k projection (weight [H*D, in] or bias [H*D]).

    Within each head the converter moved row j*D/2 + i (half j, index i) to row 2*i + j; we move it back.
    """
    rows = tensor.shape[0]
    head_dim = rows // num_heads
    return (tensor.reshape(num_heads, head_dim // 2, 2, *tensor.shape[1:])
            .transpose(1, 2).reshape(tensor.shape).contiguous())


_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def load_gguf(path: str, dtype: torch.dtype | None, keep_quantized: bool = False
              ) -> tuple[ModelConfig, dict, Tokenizer | None, str]:
    """(config, HF-named state dict, tokenizer, the file's precision: see `gguf_precision`).

    `dtype`: what every tensor becomes, or None for as stored (F32 / F16 / BF16; fp32 values of
    quantized blocks). `keep_quantized`: matrices in a type of ops.GGUF_QUANT_TYPES stay in their
    blocks (GGUFWeight) whatever `dtype` says."""
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf)
    permuted = gguf.metadata["general.architecture"] in _PERMUTED_QK
    kept = _block_layout(gguf) if keep_quantized else {}
    buffer = weight_buffer(max((end for _, end in kept.values()), default=0)) if kept else None
    state_dict: dict = {}
    for name, info in gguf.tensors.items():
        if name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            raise UnsupportedModelError(f"{path}: tensor {name!r} is not part of a Llama-family model")
        heads = None
        if permuted and ".self_attn.q_proj." in hf_name:
            heads = config.num_heads
        elif permuted and ".self_attn.k_proj." in hf_name:
            heads = config.num_kv_heads
        if name in kept:
            start, end = kept[name]
            raw = gguf.raw(name)
            blocks = buffer[start:end].view(raw.shape)
            if heads is not None:  # whole rows of blocks move, as the rows of a dense weight would
                blocks.copy_(unpermute_qk(torch.from_numpy(raw.copy()), heads))
            else:
                blocks.numpy()[...] = raw
            gguf.release(name)
            state_dict[hf_name] = GGUFWeight(blocks, int(info.ggml_type), info.shape[1])
            continue
        tensor = gguf.load_tensor(name, dtype=None)
        gguf.release(name)
        # Reorder before the cast: strided copies are fastest in the stored (usually fp32) type.
        if heads is not None:
            tensor = unpermute_qk(tensor, heads)
        state_dict[hf_name] = tensor if dtype is None else tensor.to(dtype)
    check_state_dict(state_dict, config, path)
    return config, state_dict, tokenizer_from_gguf(gguf.metadata, path), gguf_precision(gguf)


# Matrices a layer stacks into one projection (LlamaModel): kept back to back in the buffer, a
# stack of one block type is a view of it, not a copy (eecore.models.gguf_weights.stack_weights).
_STACKED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def _block_layout(gguf: GGUFFile) -> dict[str, tuple[int, int]]:
    """name -> (start, end) in one buffer of every matrix kept in its blocks: each stack's parts
    back to back, every stack and lone matrix starting on a 64-byte boundary."""
    kept = [n for n, info in gguf.tensors.items()
            if len(info.shape) == 2 and info.ggml_type.name in ops.GGUF_QUANT_TYPES and n != _ROPE_FREQS]
    order: list[list[str]] = []
    placed: set[str] = set()
    for name in kept:
        if name in placed:
            continue
        group = [name]
        match = _LAYER_TENSOR.fullmatch(name)
        for parts in _STACKED:
            if match is not None and match.group(2) in parts:
                names = [f"blk.{match.group(1)}.{part}.{match.group(3)}" for part in parts]
                if all(n in kept for n in names):
                    group = names
        order.append(group)
        placed.update(group)
    layout, offset = {}, 0
    for group in order:
        offset = -(-offset // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT
        for name in group:
            layout[name] = (offset, offset + gguf.tensors[name].nbytes)
            offset += gguf.tensors[name].nbytes
    return layout


def gguf_precision(gguf: GGUFFile) -> str:
    """The file's precision: "float32", "float16" or "bfloat16" when its layers' matrices are all
    of that type, else the name of the quantized type most of their bytes are in ("Q4_1";
    "Q4_K" for most Q4_K_M files)."""
    matrices = [info for name, info in gguf.tensors.items() if name.startswith("blk.") and len(info.shape) == 2]
    names = {info.ggml_type.name for info in matrices}
    if len(names) == 1 and next(iter(names)) in _FLOAT_TYPES:
        return _FLOAT_TYPES[next(iter(names))]
    quantized: dict[str, int] = {}
    for info in matrices:
        if info.ggml_type.name not in _FLOAT_TYPES:
            quantized[info.ggml_type.name] = quantized.get(info.ggml_type.name, 0) + info.nbytes
    return max(quantized, key=quantized.get) if quantized else "float32"


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    md, path = gguf.metadata, gguf.path
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; eecore loads {sorted(SUPPORTED_GGUF_ARCHITECTURES)}")

    def need(key: str):
        value = md.get(f"{arch}.{key}")
        if value is None:
            raise CorruptCheckpointError(f"{path}: missing metadata key {arch}.{key!s}")
        return value

    if "token_embd.weight" not in gguf.tensors:
        raise CorruptCheckpointError(f"{path}: no token_embd.weight tensor")
    hidden_size = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(md.get(f"{arch}.attention.head_count_kv") or num_heads)
    head_dim = int(md.get(f"{arch}.attention.key_length") or hidden_size // num_heads)
    value_dim = int(md.get(f"{arch}.attention.value_length") or head_dim)
    rotary_dim = int(md.get(f"{arch}.rope.dimension_count") or head_dim)
    if value_dim != head_dim or rotary_dim != head_dim:
        raise UnsupportedModelError(
            f"{path}: key/value/rotary dims ({head_dim}/{value_dim}/{rotary_dim}) differ; eecore needs them equal")
    eos_ids = [md.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    rope_theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    sliding_window = md.get(f"{arch}.attention.sliding_window")
    return ModelConfig(
        architecture=SUPPORTED_GGUF_ARCHITECTURES[arch],
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden_size,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(gguf, arch, rope_theta, head_dim),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


def _rope_scaling(gguf: GGUFFile, arch: str, rope_theta: float, head_dim: int) -> dict | None:
    md = gguf.metadata
    if _ROPE_FREQS in gguf.tensors:
        factors = gguf.load_tensor(_ROPE_FREQS, torch.float64)
        return _llama3_scaling_from_factors(factors, rope_theta, head_dim, gguf.path)
    kind = md.get(f"{arch}.rope.scaling.type", md.get(f"{arch}.rope.scale_linear") and "linear")
    if kind in (None, "none"):
        return None
    factor = md.get(f"{arch}.rope.scaling.factor", md.get(f"{arch}.rope.scale_linear"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = md.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise UnsupportedModelError(f"{gguf.path}: rope scaling type {kind!r} is not supported")


# (original context, low_freq_factor, high_freq_factor) tried when a table has too few points in
# its smooth region to solve for them; Meta's Llama 3.1 / 3.2 / 3.3 all use the first.
_LLAMA3_CANDIDATES = [(ctx, low, high) for ctx in (8192, 4096, 2048, 16384, 32768)
                      for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0))]


def llama3_rope_factors(factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_max_position_embeddings: int, rope_theta: float, head_dim: int) -> torch.Tensor:
    """The per-frequency divisors llama3 rope scaling applies to the inverse frequencies (float64)."""
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisor = 1.0 / ((1 - smooth) / factor + smooth)
    divisor = torch.where(wavelen < original_max_position_embeddings / high_freq_factor,
                          torch.ones_like(divisor), divisor)
    return torch.where(wavelen > original_max_position_embeddings / low_freq_factor,
                       torch.full_like(divisor, factor), divisor)


def _llama3_scaling_from_factors(factors: torch.Tensor, rope_theta: float, head_dim: int, path: str) -> dict:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's rope_freqs table.

    In the smooth region the divisor d of a frequency with wavelength w satisfies
    s = (1/d - 1/f) / (1 - 1/f) = (ctx/w - low) / (high - low), a line in 1/w. Scaling ctx, low and
    high together leaves the table unchanged, so low = 1 is taken (as Meta's configs have it) and
    ctx, high follow from the line's slope and intercept. The answer is checked by recomputing the table.
    """
    if factors.shape != (head_dim // 2,):
        raise CorruptCheckpointError(f"{path}: rope_freqs has shape {tuple(factors.shape)}, expected ({head_dim // 2},)")
    factor = float(factors.max())
    candidates = list(_LLAMA3_CANDIDATES)
    inv_wavelen = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim) / (2 * math.pi)
    smooth = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor > 1 and int(smooth.sum()) >= 2:
        s = (1 / factors[smooth] - 1 / factor) / (1 - 1 / factor)
        x = inv_wavelen[smooth]
        slope = float(((x - x.mean()) * (s - s.mean())).sum() / ((x - x.mean()) ** 2).sum())
        intercept = float(s.mean() - slope * x.mean())
        if intercept < 0:
            high = 1 - 1 / intercept
            candidates.insert(0, (round(slope * (high - 1)), 1.0, round(high, 4)))
    for ctx, low, high in candidates:
        table = llama3_rope_factors(factor, low, high, ctx, rope_theta, head_dim)
        if torch.allclose(table, factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": round(factor, 5), "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": ctx}
    raise UnsupportedModelError(f"{path}: its rope_freqs table does not follow llama3 rope scaling")
