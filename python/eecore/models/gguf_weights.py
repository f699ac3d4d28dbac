"""A projection's weight kept in its GGUF block bytes (Q4_0, Q4_1, Q8_0), computed by
`ops.linear_gguf` with the file's exact values: a decode step then reads the file's bytes (Q4_1:
0.625 bytes a weight) instead of a dequantized copy's (fp32: 4)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eecore import ops


@dataclass(frozen=True)
class GGUFWeight:
    data: torch.Tensor  # uint8 [N, K / 32 * block bytes], rows of blocks as the file stores them
    quant_type: int     # GGML's type id (ops.GGUF_QUANT_TYPES)
    features: int       # K

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.features))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, index: torch.Tensor) -> "GGUFWeight":
        return GGUFWeight(self.data.index_select(0, index).contiguous(), self.quant_type, self.features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return ops.dequantize_gguf(self.data, self.quant_type, self.features).to(dtype)

    @staticmethod
    def cat(weights: list["GGUFWeight"]) -> "GGUFWeight":
        """Weights of one type stacked along their output rows (q, k, v into one projection)."""
        first = weights[0]
        if any(w.quant_type != first.quant_type or w.features != first.features for w in weights):
            raise ValueError("GGUFWeight.cat: the weights must share one block type and one input size")
        return GGUFWeight(torch.cat([w.data for w in weights]), first.quant_type, first.features)
