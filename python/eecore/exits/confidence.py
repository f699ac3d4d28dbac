"""Per-row confidence that the token can be produced at the current layer (seed paper §2.1).

A measure is called at exit layer E with the residual stream after layer E-1 (`hidden [B, d]`)
and, for the cosine measure, the stream before that layer (`previous`). It returns fp32 `[B]`.
"""
from __future__ import annotations

from typing import Optional

import torch

from eecore import ops
from eecore.engine.sequence import Sequence
from eecore.exits.classifier import ExitClassifier
from eecore.models.int8_weights import project
from eecore.models.llama import LlamaModel


class ConfidenceMeasure:
    needs_previous_hidden = False
    gives_top1 = False  # after a call, `top1` holds each row's greedy token at that layer

    def available_at(self, exit_layer: int) -> bool:
        return True

    def start_iteration(self, seqs: list[Sequence], num_rows: Optional[int] = None) -> None:
        """Before an iteration over `seqs`' rows (`num_rows`: padded to that many): what a measure
        reads from the sequences rather than the layers."""

    def keep_rows(self, keep: torch.Tensor) -> None:
        """The batch was compacted to the rows `keep` (indices into the current rows)."""

    def start_positions(self, ids: list[int], start: int, end: int) -> None:
        """Before a teacher-forced call whose rows are positions start..end-1 of one sequence `ids`
        (calibration's record), each predicting the token after it."""

    def release(self, seq: Sequence) -> None:
        """Drop any per-sequence state once `seq` finished."""

    def __call__(self, exit_layer: int, hidden: torch.Tensor, previous: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class _FinalNormed:
    """The final norm of the hidden rows, into a buffer allocated once."""

    def __init__(self, model: LlamaModel, max_rows: int):
        self.model = model
        self._buf = torch.empty(max_rows, model.config.hidden_size, dtype=model.dtype, device=model.device)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.final_norm_(hidden, self._buf[: hidden.shape[0]])


class SoftmaxGap(ConfidenceMeasure):
    """p1 - p2 of the LM head's softmax at this layer, fused (`lm_head_top2_gap`). The top-1 of
    the last call is kept: when a row exits at this check, it is that row's greedy token."""

    gives_top1 = True

    def __init__(self, model: LlamaModel, max_rows: int):
        self.model = model
        self.normed = _FinalNormed(model, max_rows)
        self.top1: Optional[torch.Tensor] = None
        # a head in GGUF blocks has no fused kernel: its logits, then the gap
        self._logits = None if isinstance(model.lm_head, torch.Tensor) else \
            torch.empty(max_rows, model.config.vocab_size, dtype=model.dtype, device=model.device)

    def __call__(self, exit_layer, hidden, previous):
        if self.model.vocab_parallel is not None:  # the head split over ranks: one all-gather of their stats
            gap, self.top1 = self.model.vocab_parallel.top2_gap(self.normed(hidden), self.model.lm_head)
        elif self._logits is None:
            gap, self.top1 = ops.lm_head_top2_gap(self.normed(hidden), self.model.lm_head)
        else:
            logits = project(self._logits[: hidden.shape[0]], self.normed(hidden), self.model.lm_head)
            gap, self.top1 = ops.softmax_top2_gap(logits)
        return gap


class HiddenCosine(ConfidenceMeasure):
    """cos(h_{E-1}, h_E): the layer barely moved the hidden state."""

    needs_previous_hidden = True

    def __call__(self, exit_layer, hidden, previous):
        return ops.hidden_cosine(previous, hidden)


class ClassifierConfidence(ConfidenceMeasure):
    """CALM's dedicated classifier: an MLP on the final-normed hidden state, per exit layer."""

    def __init__(self, model: LlamaModel, classifier: ExitClassifier, max_rows: int):
        self.classifier = classifier.to(model.device)
        self.normed = _FinalNormed(model, max_rows)

    def available_at(self, exit_layer):
        return self.classifier.covers(exit_layer)

    def __call__(self, exit_layer, hidden, previous):
        w1, b1, w2, b2 = self.classifier.weights(exit_layer)
        return ops.mlp_confidence(self.normed(hidden), w1, b1, w2, b2)


class AdapterSoftmaxGap(ConfidenceMeasure):
    """The softmax top-2 gap read through an exit adapter (eecore.models.exit_adapter.DraftHead):
    the adapter block, the final norm and the draft vocabulary's rows of the LM head. Only the
    layers that have an adapter can be checked. The top-1 of the last call is a token id."""

    gives_top1 = True

    def __init__(self, draft_heads: dict):
        self.draft_heads = draft_heads
        self.top1: Optional[torch.Tensor] = None

    def available_at(self, exit_layer):
        return exit_layer in self.draft_heads

    def __call__(self, exit_layer, hidden, previous):
        gap, self.top1 = self.draft_heads[exit_layer].top2_gap(hidden)
        return gap
