"""The columns a draft head scores: the draft vocabulary's tokens (all of them without one), shared by
the layer drafts' head (eecore.models.exit_adapter.DraftHead) and a feature head
(eecore.speculative.feature_drafts.FeatureDraftHead), which the draft picker reads alike."""
from __future__ import annotations

from typing import Optional

import torch


class DraftColumns:
    """The columns of a draft head's logits and the tokens they stand for: the draft vocabulary's
    (all tokens without one). Draft heads score those columns only; sampling and rejection sampling
    read them widened to the whole vocabulary, -inf elsewhere."""

    def __init__(self, vocab: Optional[torch.Tensor], vocab_size: int, max_rows: int, device):
        self.vocab = None if vocab is None else vocab.to(device)
        self._vocab_list = None if vocab is None else vocab.tolist()
        # Those columns are written once, here: widen copies the draft columns into the rest.
        self._full = torch.full((max_rows, vocab_size), float("-inf"), dtype=torch.float32, device=device) \
            if vocab is not None else None

    def widen(self, columns: torch.Tensor) -> torch.Tensor:
        """Column logits `[n, K]` (from `columns`) as vocabulary-wide logits `[n, V]`, -inf outside
        the draft vocabulary (a view of an internal buffer; `columns` itself without one)."""
        if self._full is None:
            return columns
        return self._full[: columns.shape[0]].index_copy_(1, self.vocab, columns)

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of columns of the draft head's weight."""
        return columns if self.vocab is None else self.vocab[columns]

    def token_id_list(self, columns: list[int]) -> list[int]:
        """token_ids on the host: for columns already read back, without one more tensor op."""
        return columns if self._vocab_list is None else [self._vocab_list[c] for c in columns]
