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

import functools
import glob
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from eecore import envs, ops
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
    """The rows `ids` of a dense, GGUF or 8-bit weight, in `out`'s dtype, into `out` (an embedding
    lookup; the rows of an LM head)."""
    if isinstance(weight, GGUFWeight):
        return gguf_rows(out, weight, ids)
    if isinstance(weight, Int8Weight):  # (a draft copy's head: read once, when its draft head is built)
        return out.copy_(dense(weight.rows(ids), out.dtype))
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
    tokens, so their arithmetic need not be the model's. Two forms compete where linear_gguf_q8 has
    its AVX512-VNNI kernel and the int8 path no AMX-INT8 tiles (integer_gguf_kernel): GGUF blocks
    with 8-bit activations (GGUF weights stay in their blocks, 8 bits or fewer already, and dense
    ones, the LoRA-merged layers, become Q8_0 blocks: int8 with an fp16 scale per 32 weights, all
    repacked for that kernel) and per-row int8, which ops.linear widens in registers. Elsewhere every
    weight becomes per-row int8."""
    if weight.device.type == "cpu" and integer_gguf_kernel():
        if isinstance(weight, (GGUFWeight, StackedWeight)):
            return with_q8_activations(weight)
        if weight.shape[1] % 32 == 0:
            return GGUFWeight.quantize(weight, "Q8_0").with_q8_activations()
    return Int8Weight.quantize(dense(weight, torch.float32))


# EECORE_EIGHT_BIT=q8_0 or int8 fixes eight_bit's form where both exist (to time one against the
# other); unset, the process measures which is faster (_q8_blocks_read_faster).


def integer_gguf_kernel() -> bool:
    """Whether eight_bit makes GGUF blocks with 8-bit activations (see there)."""
    from eecore import _C

    if not _C.gguf_q8_vectorized() or amx_available(torch.int8):
        return False
    forced = envs.raw("EECORE_EIGHT_BIT")
    if forced is not None:
        return forced == "q8_0"
    return _q8_blocks_read_faster()


# the MLP of a layer of the embedded SmolLM2, [N, K]: gate, up, down (2.6 M weights, most of a layer)
_PROBE_SHAPES = ((1536, 576), (1536, 576), (576, 1536))


@functools.lru_cache(maxsize=None)
def _q8_blocks_read_faster() -> bool:
    """Whether a layer's MLP multiplies faster as Q8_0 blocks with 8-bit activations than as
    per-row int8, each read from memory as a draft pass reads it, after a full-depth pass has pushed
    it out of the caches (a buffer twice the last-level cache is written before each timed pass;
    ~0.15 s, once per process and only where both forms exist). Which wins depends on the core
    (docs/gguf.md): on Zen 4, whose AVX-512 runs at half width, the integer kernel's quarter of the
    instructions did (the hybrid preset ran 1.19x full depth with Q8_0 blocks, 1.11x with per-row
    int8); on Zen 5 both keep up with memory and per-row int8 reads 6% fewer bytes (the MLP cold in
    108 us against 130; the hybrid preset 1.30x against 1.27x)."""
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(n, k, generator=g) for n, k in _PROBE_SHAPES]
    forms = {"int8": [Int8Weight.quantize(w) for w in layers],
             "q8_0": [GGUFWeight.quantize(w, "Q8_0").with_q8_activations() for w in layers]}
    inputs = {k: torch.randn(1, k, generator=g) for _, k in _PROBE_SHAPES}
    outputs = [torch.empty(1, n) for n, _ in _PROBE_SHAPES]
    flush = torch.empty(2 * _last_level_cache_bytes(), dtype=torch.uint8)
    seconds: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(5):
        for name, weights in forms.items():
            flush.fill_(1)
            start = time.perf_counter()
            for w, out in zip(weights, outputs):
                project(out, inputs[w.shape[1]], w)
            seconds[name].append(time.perf_counter() - start)
    return statistics.median(seconds["q8_0"]) < statistics.median(seconds["int8"])


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache's size from sysfs (Linux), else `default`."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                sizes.append(cache_size_bytes(f.read()))
        except (OSError, ValueError):
            continue
    return max(sizes, default=default)


def cache_size_bytes(text: str) -> int:
    """A sysfs cache size ("32768K", "1M", "512") in bytes."""
    text = text.strip()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    if not digits.isdigit():
        raise ValueError(f"cache_size_bytes: expected a size like 32768K, got {text!r}")
    return int(digits) * scale
