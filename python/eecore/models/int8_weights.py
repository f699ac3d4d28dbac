"""Weight-only int8: a projection's weight stored as int8 with one fp32 scale per output row.

Why: a decode step of a small batch is bound by reading weights, so a weight's bytes are its
cost. The draft copy of separate draft layers (eecore.speculative.draft_stack) is read once per
drafted token and only proposes tokens, which the full model then verifies: int8 halves its bytes
against bf16 (a quarter of fp32's) at a small cost in how often its drafts agree, and never
changes an output. `ops.linear` takes the int8 weight and its scales directly (the CPU kernel
widens the integers in registers and scales each finished dot product).

Symmetric per-row quantization: scale[j] = max_k |W[j, k]| / 127, q[j, k] = round(W[j, k] / scale[j]),
so W ~ scale[:, None] * q with an error of at most scale[j] / 2 per element.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from eecore import ops
from eecore.models.amx_weights import amx_available, untile
from eecore.models.gguf_weights import GGUFWeight, StackedWeight, gguf_rows, project_gguf, with_q8_activations

INT8_MAX = 127


@dataclass(frozen=True)
class Int8Weight:
    data: torch.Tensor   # int8 [N, K], or its AMX tiles [N/16, K/64, 16, 64] (eecore.models.amx_weights)
    scale: torch.Tensor  # fp32 [N]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        """Per-row symmetric int8 of a dense weight `[N, K]` (any float dtype), on its device."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"Int8Weight.quantize: expected a 2-D float weight, got {weight.dtype} "
                             f"of shape {tuple(weight.shape)}")
        w = weight.float()
        # an all-zero row keeps scale 0 (its integers are 0 whatever the divisor)
        scale = w.abs().amax(dim=1) / INT8_MAX
        q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        return cls(q.to(torch.int8).contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        """`[N, K]`, tiled or not."""
        if self.data.dim() == 2:
            return self.data.shape
        blocks, steps, rows, depth = self.data.shape
        return torch.Size((blocks * rows, steps * depth))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def rows(self, index: torch.Tensor) -> "Int8Weight":
        """The weight rows `index` (e.g. the draft vocabulary's rows of an LM head)."""
        return Int8Weight(untile(self.data).index_select(0, index).contiguous(),
                          self.scale.index_select(0, index).contiguous())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (untile(self.data).float() * self.scale[:, None]).to(dtype)


Weight = Union[torch.Tensor, Int8Weight, GGUFWeight, StackedWeight]


def project(out: torch.Tensor, input: torch.Tensor, weight: Weight, bias: Optional[torch.Tensor] = None,
            accumulate: bool = False) -> torch.Tensor:
    """`ops.linear` for a dense weight or an Int8Weight, `ops.linear_gguf` for a GGUFWeight (each part
    of a StackedWeight by its own): the one call every model projection makes."""
    if isinstance(weight, Int8Weight):
        return ops.linear(out, input, weight.data, bias, accumulate, weight.scale)
    if isinstance(weight, (GGUFWeight, StackedWeight)):
        return project_gguf(out, input, weight, project, bias, accumulate)
    return ops.linear(out, input, weight, bias, accumulate)


def weight_rows(out: torch.Tensor, weight: Union[torch.Tensor, GGUFWeight], ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of a dense or GGUF weight, in `out`'s dtype, into `out` (an embedding lookup;
    the rows of an LM head)."""
    if isinstance(weight, GGUFWeight):
        return gguf_rows(out, weight, ids)
    return torch.index_select(weight, 0, ids, out=out)


def leading_rows(weight: Union[torch.Tensor, GGUFWeight], count: int) -> torch.Tensor:
    """The first `count` rows of a dense or GGUF weight, as a dense tensor (checksums of a model)."""
    if isinstance(weight, GGUFWeight):
        return weight.rows(torch.arange(min(count, weight.shape[0]), device=weight.device)).dequantize(torch.float32)
    return weight[:count]


def dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense `[N, K]` tensor in `dtype` (for the rare path that needs one: kv_fill's
    stacked K/V projections, a training twin), from int8 or from AMX tiles as well."""
    if isinstance(weight, (Int8Weight, GGUFWeight)):
        return weight.dequantize(dtype)
    if isinstance(weight, StackedWeight):
        return torch.cat([dense(part, dtype) for part in weight.parts])
    return untile(weight).to(dtype)


def eight_bit(weight: Weight) -> Weight:
    """A weight in the 8-bit form that multiplies fastest in this process: a draft copy's weights,
    its exit adapter and draft head (`LlamaModel(weight_dtype=torch.int8)`), which only propose
    tokens, so their arithmetic need not be the model's. Where linear_gguf_q8 has its AVX512-VNNI
    kernel and the int8 path no AMX-INT8 tiles, GGUF blocks with 8-bit activations multiply faster
    than ops.linear widens per-row int8 (a draft pass reads the same bytes with a quarter of the
    instructions): GGUF weights stay in their blocks (8 bits or fewer already) and dense ones (the
    LoRA-merged layers) become Q8_0 blocks (int8 with an fp16 scale per 32 weights), all repacked
    for that kernel. Elsewhere every weight becomes per-row int8."""
    if weight.device.type == "cpu" and integer_gguf_kernel():
        if isinstance(weight, (GGUFWeight, StackedWeight)):
            return with_q8_activations(weight)
        if weight.shape[1] % 32 == 0:
            return GGUFWeight.quantize(weight, "Q8_0").with_q8_activations()
    return Int8Weight.quantize(dense(weight, torch.float32))


def integer_gguf_kernel() -> bool:
    """Whether eight_bit makes GGUF blocks with 8-bit activations (see there)."""
    from eecore import _C

    return bool(_C.gguf_q8_vectorized()) and not amx_available(torch.int8)
