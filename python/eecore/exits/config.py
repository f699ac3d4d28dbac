"""`EarlyExitConfig`: which confidence measure, which thresholds, where exits may happen, and
how a batch decides to exit."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from eecore.exits.thresholds_file import CALIBRATED_MEASURES

MEASURES = CALIBRATED_MEASURES + ("static",)
BATCH_RULES = ("all", "compact")


@dataclass
class EarlyExitConfig:
    """Engine-wide early-exit settings.

    measure:        "softmax" (top-2 gap of the LM head's softmax at the layer), "cosine" (hidden
                    state before vs after the layer), "classifier" (CALM's MLP on the hidden
                    state; weights from `classifier_path`), "agreement" (the probability that
                    full depth emits the layer's token, learned from the early head's
                    distribution and prompt lookup: eecore.exits.agreement; regressions from
                    `decision_path`), or "static" (always exit at `exit_layer`).
    threshold:      a row exits at a checked layer once its confidence is > threshold. A scalar,
                    or one value per layer: `threshold[E - 1]` applies to the check at exit layer E,
                    or the path of a thresholds file made by `eecore calibrate` (see
                    eecore.exits.thresholds_file). A file supplies the threshold(s) and the settings
                    they were calibrated for (measure, min_exit_layer, check_every, decay,
                    batch_rule): leave those unset, or set them to the file's values; any other
                    value is a ValueError, as is a model (or set of exit adapters) other than the
                    calibrated one when the LLM is built.
    exit_layer:     the static exit layer E (layers 0..E-1 run); only for measure="static".
    min_exit_layer: the first exit layer at which a check runs (E >= min_exit_layer).
    check_every:    check only every k-th layer from min_exit_layer on.
    decay:          CALM's tau: the threshold of token t (0-based) of a request with max_tokens N
                    becomes clip(0.9 * lambda + 0.1 * exp(-tau * t / N), 0, 1). None: constant.
    batch_rule:     "all": the seed paper's rule, the batch exits when every row is confident;
                    "compact": a confident row leaves at its own layer and the rest go on.
    classifier_path: the classifier file (see eecore.exits.classifier for its format).
    decision_path:  measure="agreement": the decision file (`python -m eecore.train.exit_decision`);
                    None reads the shipped one, fit for the default model with its shipped exit
                    adapters (exit_adapter=True).

    The config is engine-wide: one LLM instance, one early-exit policy. Requests in a batch share
    the layer loop, so per-request measures would not be well defined under the "all" rule.
    """

    # None on measure / min_exit_layer / check_every / batch_rule means "the default" (softmax, 1,
    # 1, all), or the thresholds file's value: a file can only fill in what was left unset.
    measure: Optional[str] = None
    threshold: Union[float, Sequence[float], str, os.PathLike] = 0.9
    exit_layer: Optional[int] = None
    min_exit_layer: Optional[int] = None
    check_every: Optional[int] = None
    decay: Optional[float] = None
    batch_rule: Optional[str] = None
    classifier_path: Optional[str] = None
    decision_path: Optional[str] = None
    # the path and contents of the thresholds file `threshold` named, if it named one
    threshold_file: Optional[str] = field(default=None, init=False, compare=False)
    calibration: Optional[dict] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.threshold, (str, os.PathLike)):
            self._load_thresholds_file(os.fspath(self.threshold))
        for name, default in (("measure", "softmax"), ("min_exit_layer", 1), ("check_every", 1), ("batch_rule", "all")):
            if getattr(self, name) is None:
                setattr(self, name, default)
        if self.measure not in MEASURES:
            raise ValueError(f"EarlyExitConfig: 'measure' must be one of {MEASURES}, got {self.measure!r}")
        if self.batch_rule not in BATCH_RULES:
            raise ValueError(f"EarlyExitConfig: 'batch_rule' must be one of {BATCH_RULES}, got {self.batch_rule!r}")
        if self.measure == "static":
            if not isinstance(self.exit_layer, int) or self.exit_layer < 1:
                raise ValueError(f"EarlyExitConfig: measure='static' needs 'exit_layer' >= 1, got {self.exit_layer!r}")
        elif self.exit_layer is not None:
            raise ValueError("EarlyExitConfig: 'exit_layer' is only for measure='static'")
        if self.measure == "classifier" and not self.classifier_path:
            raise ValueError("EarlyExitConfig: measure='classifier' needs 'classifier_path'")
        if self.decision_path is not None and self.measure != "agreement":
            raise ValueError(f"EarlyExitConfig: 'decision_path' is only for measure='agreement' (got measure="
                             f"{self.measure!r})")
        thresholds = [self.threshold] if isinstance(self.threshold, (int, float)) else list(self.threshold)
        if not thresholds or not all(isinstance(t, (int, float)) and 0.0 <= t <= 1.0 for t in thresholds):
            raise ValueError(f"EarlyExitConfig: 'threshold' must be a number or a list of numbers in [0, 1], "
                             f"got {self.threshold!r}")
        if not isinstance(self.min_exit_layer, int) or self.min_exit_layer < 1:
            raise ValueError(f"EarlyExitConfig: 'min_exit_layer' must be an int >= 1, got {self.min_exit_layer!r}")
        if not isinstance(self.check_every, int) or self.check_every < 1:
            raise ValueError(f"EarlyExitConfig: 'check_every' must be an int >= 1, got {self.check_every!r}")
        if self.decay is not None and self.decay < 0:
            raise ValueError(f"EarlyExitConfig: 'decay' must be >= 0 or None, got {self.decay!r}")

    def _load_thresholds_file(self, path: str) -> None:
        from eecore.exits import thresholds_file
        from eecore.exits.agreement import decision_sha256

        data = thresholds_file.load(path)
        for name in ("measure", "min_exit_layer", "check_every", "batch_rule", "decay"):
            if getattr(self, name) is None:
                setattr(self, name, data[name])
        thresholds_file.check_config(data, path, measure=self.measure, batch_rule=self.batch_rule,
                                     min_exit_layer=self.min_exit_layer, check_every=self.check_every,
                                     decay=self.decay, classifier_path=self.classifier_path,
                                     decision_path=self.decision_path,
                                     decision_sha256=decision_sha256(self.decision_path))
        self.threshold = data["threshold"]
        self.threshold_file, self.calibration = path, data

    def check_model(self, model, adapters=None) -> None:
        """A thresholds file must have been calibrated on this model, with these exit adapters."""
        if self.calibration is not None:
            from eecore.exits import thresholds_file

            thresholds_file.check_model(self.calibration, self.threshold_file, model, adapters)

    def validate_for(self, num_layers: int) -> None:
        """Checks that depend on the model."""
        if not isinstance(self.threshold, (int, float)) and len(self.threshold) != num_layers:
            raise ValueError(f"EarlyExitConfig: a per-layer 'threshold' needs {num_layers} values (one per layer), "
                             f"got {len(self.threshold)}")
        if self.measure == "static" and self.exit_layer > num_layers:
            raise ValueError(f"EarlyExitConfig: 'exit_layer' {self.exit_layer} exceeds the model's {num_layers} layers")
