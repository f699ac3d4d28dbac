"""A learned answer to "is this layer draft right?" (`LayerDrafts(exit_measure="agreement")`).

The draft's own distribution tells its right tokens from its wrong ones only so well: its top-1
probability, its top-2 gap, its entropy and a logistic regression on all three rank the exit-ready
copy's tokens alike (bench/analysis/exit_decision_ceiling.py: at precision 0.99, 31-33% of the
positions can exit). What tells more lies outside it: whether prompt lookup has a continuation at
the position, and whether that continuation is the copy's token. Text that the sequence already
holds is text the copy rarely gets wrong where it agrees with it, and often gets wrong where it
does not. With those two inputs added the same regression lets 49% of the positions exit at
precision 0.99.

`AgreementModel` is that regression: five inputs (top-1 probability, top-1 minus top-2, entropy,
all over the draft head's columns; lookup has a token; lookup's token is the draft's), normalized,
through one linear layer and a sigmoid: the probability that full depth emits the draft's token.
With `exit_measure="agreement"` the draft rules that read a draft's confidence read this instead:
`stop_below` (the draft stop rule), `exit_threshold` (unverified exits) and `long_draft_acceptance`.
A model is fit for one draft file (its SHA-256 is in the model's file, and a model is refused for
another); the shipped one is fit for the shipped draft layers by
`python bench/analysis/exit_decision_ceiling.py --write FILE`.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from eecore.engine.sequence import Sequence
from eecore.exits.decision import (INPUTS, LOOKUP_NGRAMS, LogisticDecision, distribution_inputs, lookup_inputs,
                                   optional_lookup)
from eecore.exits.thresholds_file import file_sha256
from eecore.text.ngram_index import PromptLookup

FORMAT = "eecore-exit-decision-1"
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                       "smollm2-135m-instruct-exit-decision.json")


@dataclass
class AgreementModel(LogisticDecision):
    """The regression (eecore.exits.decision) for the drafts of one draft layers file."""

    draft_file_sha256: str  # the draft layers file the model was fit for
    how: str = ""           # how it was fit (data, command)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dict(format=FORMAT, inputs=list(INPUTS), **{k: v for k, v in asdict(self).items()}), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "AgreementModel":
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != FORMAT or data.get("inputs") != list(INPUTS):
            raise ValueError(f"exit decision file {path!r}: not a {FORMAT} file over inputs {list(INPUTS)}")
        return cls(**{k: data[k] for k in ("mean", "std", "weight", "bias", "draft_file_sha256", "how")})


class AgreementMeasure:
    """The agreement probability of layer drafts as they are picked (DraftPicker), with a prompt
    lookup index of its own per sequence."""

    def __init__(self, model: AgreementModel, lookup: Optional[PromptLookup] = None):
        """`lookup`: the decoder's prompt lookup, shared when it matches the n-grams the model was
        fit with (LOOKUP_NGRAMS); otherwise the measure keeps an index of its own."""
        self.model = model
        self._owns_lookup = lookup is None or (lookup.min_ngram, lookup.max_ngram) != LOOKUP_NGRAMS
        self.lookup = PromptLookup(*LOOKUP_NGRAMS) if self._owns_lookup else lookup

    def confidence(self, probs: torch.Tensor, tokens: list[int], seqs: list[Sequence], drafted: list[list[int]]
                   ) -> list[float]:
        """Per row: `probs` the draft head's probabilities `[n, K]`, `tokens[i]` the draft token of
        seqs[i], `drafted[i]` the tokens it drafted before this one this round."""
        looked = [optional_lookup(self.lookup.continuation(seq, 1, after=before)) for seq, before in zip(seqs, drafted)]
        lookup = lookup_inputs(torch.tensor(looked), torch.tensor(tokens))
        inputs = torch.cat([distribution_inputs(probs.float())[0], lookup], 1)
        return self.model.probability(inputs).tolist()

    def release(self, seq: Sequence) -> None:
        if self._owns_lookup:
            self.lookup.release(seq)


def agreement_measure(draft_file: Optional[str], lookup: Optional[PromptLookup] = None,
                      model_file: str = SHIPPED) -> AgreementMeasure:
    """The measure for drafts of `draft_file` (the exit-ready file the copy's LoRA pairs came from)."""
    model = AgreementModel.load(model_file)
    if draft_file is None or not os.path.isfile(draft_file) or file_sha256(draft_file) != model.draft_file_sha256:
        raise ValueError(f"LayerDrafts: exit_measure='agreement' reads a model fit for one draft file "
                         f"({os.path.basename(model_file)}: SHA-256 {model.draft_file_sha256[:12]}...); the loaded "
                         f"drafts come from {draft_file!r}. Load the shipped draft layers (exit_adapter=True), or "
                         f"fit a model for yours: bench/analysis/exit_decision_ceiling.py --write FILE")
    return AgreementMeasure(model, lookup)
