"""The verify pass of a self-speculation round, one varlen pass over every sequence's pending token
and drafts (query length d + 1 per sequence, nothing padded):

- from the exit-query cache (shared layer drafts): the layer-E states the draft passes stored
  continue through layers E..L-1; the first E layers never run again for these positions;
- through every layer (lookup drafts, a separate copy's drafts, token trees), optionally copying
  the layer-E states out for the guard's shadow check on the way.

Only the rows a round reads go through the LM head (`logit_rows`)."""
from __future__ import annotations

from typing import Optional

import torch

from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.speculative.draft import Draft


def logit_rows(widths: list[int], drafts: list[Draft]) -> Optional[list[int]]:
    """The rows of a full-depth pass (sequences' `widths` rows each, in order) whose logits a round
    reads: every row after a sequence's leading exits (LayerDrafts.exit_threshold), so all of a verified
    sequence's and the last of one whose drafts all exited; None: all."""
    if not any(d.exits for d in drafts):
        return None
    rows, start = [], 0
    for n, draft in zip(widths, drafts):
        rows.extend(range(start + len(draft.exits), start + n))
        start += n
    return rows


def _rows_of(logits: torch.Tensor, rows: Optional[list[int]]) -> torch.Tensor:
    """The logits of `rows` (None: all)."""
    if rows is not None and len(rows) < logits.shape[0]:
        return logits.index_select(0, torch.tensor(rows, device=logits.device))
    return logits


class Verifier:
    def __init__(self, runner, exit_layer, exit_states: Optional[torch.Tensor] = None, static_from_exit_states=None):
        self.runner = runner
        self.exit_layer = exit_layer
        self.exit_states = exit_states  # [rows, verify width, d] (shared layer drafts), else None
        self.static_from_exit_states = static_from_exit_states  # engine.static_decode.StaticExitVerify
        self.num_layers = runner.num_layers

    def from_exit_states(self, seqs: list[Sequence], drafts: list[Draft],
                         rows_read: Optional[list[int]] = None) -> torch.Tensor:
        """Layers E..L-1 over every drafted position at once, from the exit-query cache; the logits of
        `rows_read` (None: of every row)."""
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id] + d.tokens) for s, d in zip(seqs, drafts)]
        static = self.static_from_exit_states
        if static is not None and static.takes(rows):
            return _rows_of(static.run(rows), rows_read)  # a CUDA graph replay on a GPU
        inputs = self.runner.prepare(rows)
        B, width = len(seqs), self.exit_states.shape[1]
        flat = self.exit_states[:B].view(B * width, -1)
        if all(len(d) + 1 == width for d in drafts):
            hidden = flat
        else:
            index = [b * width + k for b, d in enumerate(drafts) for k in range(len(d) + 1)]
            hidden = flat.index_select(0, torch.tensor(index, device=flat.device))
        self.runner.run_layers(hidden, inputs.attn, self.exit_layer, self.num_layers)
        return self._logits(hidden, rows_read)

    def full(self, rows: list[Row], shadowed: list[int] = (), rows_read: Optional[list[int]] = None) -> torch.Tensor:
        """`rows` (pending tokens and drafts, possibly token trees) through every layer; for the
        sequences in `shadowed`, the layer-E state of their first row is copied to slot 0 of their
        exit-query cache row on the way (the guard's shadow check); the logits of `rows_read`."""
        static = self.runner.static_verify
        if not shadowed and static is not None and static.takes(rows):
            return _rows_of(static.run(rows), rows_read)  # a CUDA graph replay on a GPU
        inputs = self.runner.prepare(rows)
        hidden = self.runner.embed(inputs)
        if shadowed:
            self.runner.run_layers(hidden, inputs.attn, 0, self.exit_layer)
            starts = inputs.attn.query_start_loc[:-1].tolist()
            rows_at = torch.tensor([starts[b] for b in shadowed], device=hidden.device)
            self.exit_states[:, 0].index_copy_(0, torch.tensor(shadowed, device=hidden.device),
                                               hidden.index_select(0, rows_at))
            self.runner.run_layers(hidden, inputs.attn, self.exit_layer, self.num_layers)
        else:
            self.runner.run_layers(hidden, inputs.attn, 0, self.num_layers)
        return self._logits(hidden, rows_read)

    def _logits(self, hidden: torch.Tensor, rows: Optional[list[int]]) -> torch.Tensor:
        if rows is not None and len(rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
        return self.runner.logits(hidden)
