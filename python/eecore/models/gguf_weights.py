"""Projections kept in GGUF block bytes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), computed
by `ops.linear_gguf` with the file's exact values: a decode step then reads the file's bytes (Q4_1:
0.625 bytes a weight) instead of a dequantized copy's (fp32: 4).

`StackedWeight` holds projections stacked along their outputs whose parts cannot share one block
type (a Q4_K_M file's q and k in Q4_K beside its v in Q6_K): each part writes its own columns.
A GGUFWeight may also carry its repacking for 8-bit activations (EECORE_GGUF_ACTIVATIONS below).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from eecore import envs, ops


# LLM(gguf_activations="q8") or EECORE_GGUF_ACTIVATIONS=q8: GGUF projections compute with 8-bit
# activations (ops.linear_gguf_q8, llama.cpp's arithmetic: faster, most of all for several rows, but
# not the dequantized model's values); "exact" (the default): ops.linear_gguf. Read when a model is
# built.
_Q8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def q8_activations() -> bool:
    return envs.value("EECORE_GGUF_ACTIVATIONS") == "q8"


@dataclass(frozen=True)
class GGUFWeight:
    data: torch.Tensor  # uint8 [N, K / W * block bytes], rows of blocks as the file stores them
    quant_type: int     # GGML's type id (ops.GGUF_QUANT_TYPES)
    features: int       # K
    # the same weight repacked for 8-bit activations (ops.repack_gguf_q8), which project() then uses
    packed: Optional[torch.Tensor] = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, type_name: str) -> "GGUFWeight":
        """A dense `[N, K]` weight quantized to GGUF `type_name` (eecore.models.gguf_quantize)."""
        from gguf import GGMLQuantizationType

        from eecore.models.gguf_quantize import quantize

        blocks = quantize(weight.detach().float().cpu().numpy(), type_name)
        return cls(torch.from_numpy(blocks).to(weight.device), int(GGMLQuantizationType[type_name]), weight.shape[1])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.features))

    @property
    def nbytes(self) -> int:
        """The bytes a projection reads (the repacked ones where project() uses them)."""
        return self.data.nbytes if self.packed is None else self.packed.nbytes

    @property
    def device(self) -> torch.device:
        return self.data.device

    def with_q8_activations(self) -> "GGUFWeight":
        """This weight, also repacked for 8-bit activations where its type has that kernel."""
        from gguf import GGMLQuantizationType

        if GGMLQuantizationType(self.quant_type).name not in _Q8_TYPES or self.packed is not None:
            return self
        return GGUFWeight(self.data, self.quant_type, self.features,
                          ops.repack_gguf_q8(self.data, self.quant_type, self.features))

    def rows(self, index: torch.Tensor) -> "GGUFWeight":
        """The weight rows `index` (a draft vocabulary's rows of an LM head), repacked too if this is."""
        rows = GGUFWeight(self.data.index_select(0, index).contiguous(), self.quant_type, self.features)
        return rows if self.packed is None else rows.with_q8_activations()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return ops.dequantize_gguf(self.data, self.quant_type, self.features).to(dtype)

    def to(self, device: torch.device) -> "GGUFWeight":
        return GGUFWeight(self.data.to(device), self.quant_type, self.features)


@dataclass(frozen=True)
class StackedWeight:
    """Weights stacked along their output rows, kept apart (see the module docstring)."""
    parts: tuple  # of GGUFWeight or dense [N_i, K] tensors

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def stack_weights(weights: list) -> Union[torch.Tensor, GGUFWeight, StackedWeight]:
    """Projections with one input stacked along their outputs (q, k, v; gate, up): one tensor or one
    GGUFWeight when they share a form, else a StackedWeight."""
    first = weights[0]
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights)
    if all(isinstance(w, GGUFWeight) and w.quant_type == first.quant_type and w.features == first.features
           for w in weights):
        rows = sum(w.data.shape[0] for w in weights)
        if _back_to_back([w.data for w in weights]):  # as the GGUF loader lays them out: a view
            return GGUFWeight(first.data.as_strided((rows, first.data.shape[1]), first.data.stride()),
                              first.quant_type, first.features)
        return GGUFWeight(torch.cat([w.data for w in weights]), first.quant_type, first.features)
    if any(w.shape[1] != first.shape[1] for w in weights):
        raise ValueError("stack_weights: the weights must share one input size")
    return StackedWeight(tuple(weights))


def _back_to_back(tensors: list[torch.Tensor]) -> bool:
    """Contiguous tensors of one storage, each starting where the one before ends."""
    storage = tensors[0].untyped_storage().data_ptr()
    return all(t.is_contiguous() and t.untyped_storage().data_ptr() == storage for t in tensors) and all(
        a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(tensors, tensors[1:]))


def project_gguf(out: torch.Tensor, input: torch.Tensor, weight: Union[GGUFWeight, StackedWeight], project,
                 bias: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """`project` for the weights of this module; `project` is the model's one projection call, which
    the parts of a StackedWeight go back through."""
    if isinstance(weight, GGUFWeight):
        if weight.packed is not None:
            return ops.linear_gguf_q8(out, input, weight.packed, weight.quant_type, bias, accumulate)
        return ops.linear_gguf(out, input, weight.data, weight.quant_type, bias, accumulate)
    start = 0
    for part in weight.parts:
        end = start + part.shape[0]
        project(out[:, start:end], input, part, None if bias is None else bias[start:end], accumulate)
        start = end
    return out


# LLM(quantization=...) -> the GGUF block type a float checkpoint's matrices are quantized to at load.
# "int8" is Q8_0: int8 weights with one fp16 scale per block of 32.
QUANTIZATIONS = {"int8": "Q8_0", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1",
                 "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}
# A matrix whose rows are not whole 256-weight blocks takes these instead, as llama.cpp's quantize does.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def quantize_state_dict(state_dict: dict, type_name: str) -> None:
    """Every matrix of a decoder's state dict (projections, embedding, LM head) quantized in place to
    GGUF `type_name` (or its fallback, for rows of K = 32 m weights that a K format cannot hold);
    matrices whose rows are not whole 32-weight blocks, norms and biases stay as they are."""
    for name, tensor in state_dict.items():
        if not (isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[1] % 32 == 0):
            continue
        kind = type_name if type_name not in _FALLBACK or tensor.shape[1] % 256 == 0 else _FALLBACK[type_name]
        state_dict[name] = GGUFWeight.quantize(tensor, kind)


def with_q8_activations(weight):
    """A model weight with its GGUF parts repacked for 8-bit activations (others as they are)."""
    if isinstance(weight, GGUFWeight):
        return weight.with_q8_activations()
    if isinstance(weight, StackedWeight):
        return StackedWeight(tuple(with_q8_activations(part) for part in weight.parts))
    return weight


def gguf_rows(out: torch.Tensor, weight: GGUFWeight, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of a GGUF weight, dequantized into `out` (an embedding lookup)."""
    return ops.embedding_gguf(out, ids, weight.data, weight.quant_type)
