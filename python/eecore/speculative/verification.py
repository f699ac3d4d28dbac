"""The verify pass of a self-speculation round, one varlen pass over every sequence's pending token
and drafts (query length d + 1 per sequence, nothing padded):

- from the exit-query cache (shared layer drafts): the layer-E states the draft passes stored
  continue through layers E..L-1; the first E layers never run again for these positions;
- through every layer (lookup drafts, a separate copy's drafts, token trees), optionally copying
  the layer-E states out for the guard's shadow check on the way.

Only the rows a round reads go through the LM head (`logit_rows`)."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
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
        self.static_from_exit_states = static_from_exit_states  # speculative.static_passes.StaticExitVerify
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

    def full(self, rows: list[Row], shadowed: list[int] = (), rows_read: Optional[list[int]] = None,
             tap=None) -> torch.Tensor:
        """`rows` (pending tokens and drafts, possibly token trees) through every layer; for the
        sequences in `shadowed`, the layer-E state of their first row is copied to slot 0 of their
        exit-query cache row on the way (the guard's shadow check); the logits of `rows_read`.
        `tap`: (layers, out) the streams after those layers are copied to, for every token (feature
        drafts: ModelRunner.run_layers_tapped)."""
        static = self.runner.static_verify
        if not shadowed and static is not None and (tap is None or static.takes_taps) and static.takes(rows):
            return _rows_of(static.run(rows, tap), rows_read)  # a CUDA graph replay on a GPU
        inputs = self.runner.prepare(rows)
        hidden = self.runner.embed(inputs)
        if tap is not None:
            self.runner.run_layers_tapped(hidden, inputs.attn, tap)
        elif shadowed:
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


class VerifyAhead:
    """A round's verify pass launched from its draft chain's tokens on the device, right behind the
    chain's passes and before the host reads the chain back (draft ahead with EECORE_VERIFY_AHEAD=1,
    CopyProposer). Without it the GPU idles while the host reads the chain, builds the verify pass
    and launches it; with it the round has one host round trip, the chain and the verdict read back
    together.

    The host does not know the chain's tokens when the pass goes out, nor where a stop rule will
    cut it, so the pass verifies each sequence's drafts at the length planned for it (the static
    verify pass runs every row at its full width anyway), and acceptance reads the rows of the
    drafts the chain kept: a row's logits depend only on the tokens up to it, so they are the same
    whatever follows a cut, and the K/V written past it is overwritten later, as a rejected draft's
    is. Greedy rounds only (the chain's own condition), without the guard's shadow check."""

    def __init__(self, static, seqs: list[Sequence], drafts: list[Draft]):
        self.static = static  # engine.static_decode.StaticVerify
        self.seqs, self.drafts = seqs, drafts
        self.logits: Optional[torch.Tensor] = None  # once launched: `width` rows a sequence, padding included
        self.rows_verified = 0  # the real rows among them (what the round's verify pass cost is per row)
        # what `launch` added to the draft passes' wall time, which is the verify pass's share of the
        # round (DraftPlanner's clock): on the CPU the pass runs inside `launch`; on a GPU `launch`
        # only builds and queues it while the chain's passes run, and the wait for the chain's
        # read-back times the chain, so nothing is taken off
        self.seconds = 0.0

    @classmethod
    def for_round(cls, static, seqs: list[Sequence], drafts: list[Draft]) -> Optional["VerifyAhead"]:
        """One for this round where the static verify pass can take it: every sequence greedy, few
        enough for the pass."""
        if static is None or not 0 < len(seqs) <= static.max_batch or static.runner.model.is_encoder_decoder \
                or not all(seq.params.greedy for seq in seqs):
            return None
        return cls(static, seqs, drafts)

    def chain_slots(self, seq_of: np.ndarray, step: np.ndarray) -> np.ndarray:
        """The pass's token slots of chain drafts: draft `step[k]` of the chain of seqs[seq_of[k]]
        (int64 arrays), after that sequence's pending token and the drafts it already holds."""
        drafted = np.fromiter((len(draft) for draft in self.drafts), np.int64, len(self.drafts))
        return seq_of * self.static.width + 1 + drafted[seq_of] + step

    def launch(self, live: list[int], more: list[int], values: torch.Tensor, where: torch.Tensor) -> None:
        """The pass, with the chain's drafts `values` (on the device) at `where` (chain_slots' slots,
        on the device); each sequence's row the pending token, its drafts so far, and placeholders
        for the chain's. Not launched (`logits` stays None) where the rows do not fit the pass."""
        extra = dict(zip(live, more))
        rows = [Row(seq, seq.num_computed_tokens, [seq.last_token_id] + draft.tokens + [0] * extra.get(b, 0))
                for b, (seq, draft) in enumerate(zip(self.seqs, self.drafts))]
        if not self.static.takes(rows):
            return
        begin = time.perf_counter()
        self.rows_verified = sum(len(row.tokens) for row in rows)
        self.logits = self.static.run_with_tokens(rows, values, where)
        if values.device.type != "cuda":
            self.seconds = time.perf_counter() - begin
