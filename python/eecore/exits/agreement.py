"""The learned exit decision as an Algorithm 1 measure (`EarlyExitConfig(measure="agreement")`).

At a checked exit layer E the measure reads the layer's early head (its exit adapter and draft
vocabulary where the model has one, else the final norm and the whole LM head), takes the five
inputs of eecore.exits.decision (the head's top-1 probability, top-2 gap and entropy; whether
prompt lookup proposes a next token for the row's sequence, and whether it is the head's top-1) and
returns the probability that full depth emits the head's token, from a logistic regression fit for
that layer. A row exits once it is above the threshold, under either batch rule, and a greedy row
that exits takes the head's top-1 as its token (no second pass through the head).

Prompt lookup's token is the one thing the measure reads from a sequence rather than the layer's
state: it is known before the iteration runs (it depends only on the tokens so far), so
`start_iteration` writes it into a fixed buffer, and the check itself stays a chain of kernels on
static buffers (one CUDA graph per segment, eecore.exits.static_segments).

The regressions live in a decision file fit for one model and one set of exit adapters
(`python -m eecore.train.exit_decision`):
    format          "eecore-exit-decision-layers-1"
    inputs          eecore.exits.decision.INPUTS; lookup_ngrams: [2, 4]
    model           eecore.exits.thresholds_file.model_identity of the model it was fit on
    exit_adapter    eecore.exits.thresholds_file.adapter_identity of its exit adapters, or null
    layers          {"E": {"mean", "std", "weight", "bias", "positions", "agreement"}}: a regression
                    per exit layer, with the positions it was fit on and the head's agreement there
    how             how it was fit
The shipped file is fit for the shipped exit adapters of the default model (SHIPPED).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from eecore.engine.sequence import Sequence
from eecore.exits.confidence import ConfidenceMeasure
from eecore.exits.decision import (INPUTS, LOOKUP_NGRAMS, LogisticDecision, distribution_inputs, lookup_inputs,
                                   optional_lookup)
from eecore.exits.thresholds_file import (ThresholdsFileError, adapter_identity, check_model, file_sha256,
                                         model_identity, read_json_object)
from eecore.text.ngram_index import NgramIndex, PromptLookup

FORMAT = "eecore-exit-decision-layers-1"
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                       "smollm2-135m-instruct-exit-decision-layers.json")


class DecisionFileError(ValueError):
    """The decision file is missing, malformed, or fit for another model or exit adapters."""


def save(path: str, model, adapters, decisions: dict[int, LogisticDecision], how: str = "",
         stats: Optional[dict[int, dict]] = None) -> None:
    """Writes the decision file of `decisions` (exit layer -> regression) fit on `model` with
    `adapters` (or None); `stats[E]`: what to record beside layer E's coefficients."""
    data = dict(format=FORMAT, inputs=list(INPUTS), lookup_ngrams=list(LOOKUP_NGRAMS),
                model=model_identity(model), exit_adapter=adapter_identity(adapters),
                layers={str(E): dict(d.coefficients(), **(stats or {}).get(E, {}))
                        for E, d in sorted(decisions.items())},
                how=how)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def load(path: str, model=None, adapters=None) -> dict[int, LogisticDecision]:
    """The regressions of a decision file, by exit layer. With `model`, also checks that the file
    was fit on it and on `adapters` (DecisionFileError otherwise)."""
    data = read_json_object(path, "decision file", DecisionFileError)
    if data.get("format") != FORMAT:
        raise DecisionFileError(f"decision file {path!r}: not a {FORMAT} file (for the draft copy's exits, "
                                f"LayerDrafts(exit_measure=...) reads eecore-exit-decision-1 files)")
    if data.get("inputs") != list(INPUTS) or data.get("lookup_ngrams") != list(LOOKUP_NGRAMS):
        raise DecisionFileError(f"decision file {path!r}: fit over inputs {data.get('inputs')} with lookup n-grams "
                                f"{data.get('lookup_ngrams')}; this eecore reads {list(INPUTS)} with "
                                f"{list(LOOKUP_NGRAMS)}")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise DecisionFileError(f"decision file {path!r}: 'layers' must map exit layers to regressions")
    decisions = {}
    for key, value in layers.items():
        try:
            E = int(key)
            decisions[E] = LogisticDecision(**{k: value[k] for k in ("mean", "std", "weight", "bias")})
        except (ValueError, KeyError, TypeError) as exc:
            raise DecisionFileError(f"decision file {path!r}: layer {key!r}: {exc}") from None
        if E < 1:
            raise DecisionFileError(f"decision file {path!r}: exit layers are >= 1, got {E}")
    if model is not None:
        if "model" not in data or "exit_adapter" not in data:
            raise DecisionFileError(f"decision file {path!r}: missing 'model' or 'exit_adapter'")
        try:
            check_model(data, path, model, adapters, kind="decision file", made="fit")
        except ThresholdsFileError as exc:
            raise DecisionFileError(f"{exc} (EarlyExitConfig 'decision_path'; fit one for this model with "
                                    f"python -m eecore.train.exit_decision)") from None
        if max(decisions) >= model.num_layers:
            raise DecisionFileError(f"decision file {path!r}: exit layer {max(decisions)} is not below the "
                                    f"model's {model.num_layers} layers")
    return decisions


def decision_sha256(path: Optional[str]) -> Optional[str]:
    """The SHA-256 of the decision file `EarlyExitConfig.decision_path` names (None: the shipped
    one), recorded in a thresholds file calibrated with it; None where there is no such file."""
    path = SHIPPED if path is None else os.fspath(path)
    return file_sha256(path) if os.path.isfile(path) else None


def load_for(path: Optional[str], model, adapters) -> dict[int, LogisticDecision]:
    """The decisions `EarlyExitConfig.decision_path` names (None: the shipped file, which is fit for
    the default model with its shipped exit adapters)."""
    if path is None:
        try:
            return load(SHIPPED, model, adapters)
        except DecisionFileError as exc:
            raise DecisionFileError(f"EarlyExitConfig: measure='agreement' without 'decision_path' reads the "
                                    f"shipped decision file, fit for the default model with its shipped exit "
                                    f"adapters (exit_adapter=True): {exc}") from None
    return load(os.fspath(path), model, adapters)


def early_inputs(head, hidden: torch.Tensor, proposals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the decision's inputs `[n, 5]`, the head's token ids `[n]`) of layer-E states `hidden`
    `[n, d]` read through `head` (an eecore.models.exit_adapter.DraftHead), `proposals[i]` prompt
    lookup's next token for row i (-1: none)."""
    inputs, column = distribution_inputs(head.columns(hidden).softmax(-1))
    tokens = head.token_ids(column)
    return torch.cat([inputs, lookup_inputs(proposals, tokens)], 1), tokens


def position_proposals(ids: list[int], start: int, end: int) -> list[int]:
    """Prompt lookup's next token (-1: none) after each position start..end-1 of `ids`, from the
    tokens up to and including it: what a sequence holding ids[:p + 1] would be proposed."""
    index = NgramIndex(*LOOKUP_NGRAMS)
    index.extend(ids[: start + 1])
    proposals = []
    for p in range(start, end):
        proposals.append(optional_lookup(index.propose(1)))
        index.extend(ids[p + 1: p + 2])
    return proposals


class LayerAgreement(ConfidenceMeasure):
    """P(full depth emits the early head's token) at each exit layer with a regression."""

    gives_top1 = True  # `top1` after a call: each row's token at that layer (a token id)

    def __init__(self, model, decisions: dict[int, LogisticDecision], draft_heads: dict, max_rows: int):
        from eecore.models.exit_adapter import DraftHead

        self.decisions = decisions
        # the layer's exit adapter where there is one; the final norm and the whole head elsewhere
        self.heads = {E: draft_heads.get(E) or DraftHead(model, E, None, max_rows) for E in decisions}
        self.lookup = PromptLookup(*LOOKUP_NGRAMS)
        self._proposals = torch.full((max_rows,), -1, dtype=torch.int64, device=model.device)
        self._num_rows = 0
        self.top1: Optional[torch.Tensor] = None

    def available_at(self, exit_layer: int) -> bool:
        return exit_layer in self.decisions

    def start_iteration(self, seqs: list[Sequence], num_rows: Optional[int] = None) -> None:
        """Prompt lookup's next token for each sequence's row (rows past len(seqs): padding, none)."""
        n = len(seqs) if num_rows is None else num_rows
        self._set([optional_lookup(self.lookup.continuation(seq, 1)) for seq in seqs] + [-1] * (n - len(seqs)))

    def start_positions(self, ids: list[int], start: int, end: int) -> None:
        self._set(position_proposals(ids, start, end))

    def _set(self, proposals: list[int]) -> None:
        self._proposals[: len(proposals)].copy_(torch.tensor(proposals, dtype=torch.int64))
        self._num_rows = len(proposals)

    def keep_rows(self, keep: torch.Tensor) -> None:
        kept = self._proposals[: self._num_rows].index_select(0, keep)
        self._proposals[: kept.shape[0]].copy_(kept)
        self._num_rows = kept.shape[0]

    def __call__(self, exit_layer, hidden, previous):
        inputs, self.top1 = early_inputs(self.heads[exit_layer], hidden, self._proposals[: hidden.shape[0]])
        return self.decisions[exit_layer].probability(inputs)

    def release(self, seq: Sequence) -> None:
        self.lookup.release(seq)
