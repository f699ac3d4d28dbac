"""Exit thresholds: per layer, optionally decaying over the output (CALM).

CALM's decaying threshold for token t (0-based) of a request with N = max_tokens:
    lambda'(t) = clip(0.9 * lambda + 0.1 * exp(-tau * t / N), 0, 1)
Early tokens get a stricter threshold; later ones relax towards 0.9 * lambda.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from eecore.engine.sequence import Sequence
from eecore.exits.config import EarlyExitConfig


class ThresholdSchedule:
    def __init__(self, config: EarlyExitConfig, num_layers: int, max_rows: int, device: torch.device):
        t = config.threshold
        self.base = [float(t)] * num_layers if isinstance(t, (int, float)) else [float(x) for x in t]
        self.decay = config.decay
        # Constant thresholds are 0-dim tensors made once; decaying ones are [B], refilled per check.
        self._constant = [torch.tensor(b, dtype=torch.float32, device=device) for b in self.base]
        self._row_term = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self._rows = torch.empty(max_rows, dtype=torch.float32, device=device)
        self._num_rows = 0

    def start_iteration(self, seqs: list[Sequence], num_rows: Optional[int] = None) -> None:
        """Per-row decay terms for the token each sequence is about to produce; `num_rows`: the
        thresholds cover that many rows (a padded batch), the padding's being of no use."""
        self._num_rows = len(seqs) if num_rows is None else num_rows
        if self.decay is None:
            return
        terms = [0.1 * math.exp(-self.decay * s.num_output_tokens / s.params.max_tokens) for s in seqs]
        self._row_term[: len(seqs)].copy_(torch.tensor(terms, dtype=torch.float32))

    def keep_rows(self, keep: torch.Tensor) -> None:
        """The batch was compacted to the rows `keep` (indices into the current rows)."""
        if self.decay is not None:
            kept = self._row_term[: self._num_rows].index_select(0, keep)
            self._row_term[: kept.shape[0]].copy_(kept)
        self._num_rows = keep.shape[0]

    def at(self, exit_layer: int) -> torch.Tensor:
        """The threshold(s) of the check at `exit_layer`: a 0-dim tensor, or `[B]` under decay."""
        base = self.base[exit_layer - 1]
        if self.decay is None:
            return self._constant[exit_layer - 1]
        rows = self._rows[: self._num_rows]
        torch.add(self._row_term[: self._num_rows], 0.9 * base, out=rows)
        return rows.clamp_(0.0, 1.0)
