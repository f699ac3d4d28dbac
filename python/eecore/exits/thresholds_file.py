"""The calibrated thresholds file (`eecore calibrate --out thresholds.json`), read by
`EarlyExitConfig(threshold="thresholds.json")` and the CLI's `--threshold FILE`.

A JSON object:
    format          "eecore-thresholds-1"
    model           the calibrated model: eecore.models.exit_adapter.model_fingerprint + embed_sum
    measure         softmax | cosine | classifier | agreement
    batch_rule, min_exit_layer, check_every, checked_layers
    decay           CALM's tau the thresholds were calibrated with, or null (constant)
    max_tokens      the generation length N of calibration (the decay's N; the risk's token count)
    exit_adapter    null, or {"exit_layers": [...], "sha256": ...} of the exit adapters used
    classifier      null, or {"sha256": ...} of the classifier file (measure "classifier")
    decision        null, or {"sha256": ...} of the decision file (measure "agreement"; absent in
                    files written before that measure)
    consistency     "token" or "text" (and "text_loss": "rouge-l" | "exact")
    family          "global" (one threshold) or "per-layer" (a 1-D family; see eecore.exits.calibrator)
    tolerance, epsilon, p_value   delta, epsilon and the p-value method of Learn-then-Test
    prompts         {"file", "sha256", "count"} ; tokens: calibration tokens that could exit
    threshold       the chosen threshold: a number, or one value per layer (index E - 1)
    candidates      [{"threshold", "risk", "p_value", "passed", "mean_exit_layer"}], in testing order

Only files that passed calibration are written: a file always holds a valid threshold.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Optional

FORMAT = "eecore-thresholds-1"
# the measures whose thresholds calibration chooses (EarlyExitConfig's others: "static", which has none)
CALIBRATED_MEASURES = ("softmax", "cosine", "classifier", "agreement")
_REQUIRED = ("format", "model", "measure", "batch_rule", "min_exit_layer", "check_every", "decay",
             "exit_adapter", "tolerance", "epsilon", "p_value", "threshold")


class ThresholdsFileError(ValueError):
    """The thresholds file is missing, malformed, or made for another model or setting."""


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def adapter_identity(adapters) -> Optional[dict]:
    """What identifies a set of exit adapters: their exit layers and a hash of every tensor's bytes
    (as stored, so it does not depend on the dtype the model runs in)."""
    if adapters is None:
        return None
    import torch

    h = hashlib.sha256()
    for E in adapters.exit_layers():
        for t in adapters.blocks[E].tensors():
            h.update(str(E).encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    if adapters.vocab is not None:
        h.update(adapters.vocab.cpu().to(torch.int64).numpy().tobytes())
    return {"exit_layers": adapters.exit_layers(), "sha256": h.hexdigest()}


def save(data: dict, path: str) -> None:
    data = dict(data, format=FORMAT)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # never leave a half-written file that looks like a calibration


def read_json_object(path: str, kind: str, error: type = ThresholdsFileError) -> dict:
    """The JSON object in the file `path`, or `error` naming the file as `kind` and what is wrong."""
    if not os.path.isfile(path):
        raise error(f"{kind} {path!r} does not exist")
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{kind} {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{kind} {path!r}: expected a JSON object, got {type(data).__name__}")
    return data


def load(path) -> dict:
    """Reads and validates the file's structure and value ranges (not the model: see check_model)."""
    path = os.fspath(path)
    data = read_json_object(path, "thresholds file")
    if data.get("format") != FORMAT:
        raise ThresholdsFileError(f"thresholds file {path!r}: 'format' must be {FORMAT!r}, got {data.get('format')!r}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ThresholdsFileError(f"thresholds file {path!r}: missing {missing}")
    for key, allowed in (("measure", CALIBRATED_MEASURES), ("batch_rule", ("all", "compact"))):
        if data[key] not in allowed:
            raise ThresholdsFileError(f"thresholds file {path!r}: {key!r} must be one of {allowed}, got {data[key]!r}")
    t = data["threshold"]
    values = [t] if _is_number(t) else t if isinstance(t, list) else None
    if not values or not all(_is_number(v) and 0.0 <= v <= 1.0 for v in values):
        raise ThresholdsFileError(f"thresholds file {path!r}: 'threshold' must be a number or a list of numbers "
                                  f"in [0, 1], got {t!r}")
    for key in ("tolerance", "epsilon"):
        if not (_is_number(data[key]) and 0.0 < data[key] < 1.0):
            raise ThresholdsFileError(f"thresholds file {path!r}: {key!r} must be in (0, 1), got {data[key]!r}")
    for key in ("min_exit_layer", "check_every"):
        if not (isinstance(data[key], int) and data[key] >= 1):
            raise ThresholdsFileError(f"thresholds file {path!r}: {key!r} must be an int >= 1, got {data[key]!r}")
    if data["decay"] is not None and not (_is_number(data["decay"]) and data["decay"] >= 0):
        raise ThresholdsFileError(f"thresholds file {path!r}: 'decay' must be >= 0 or null, got {data['decay']!r}")
    model = data["model"]
    if not isinstance(model, dict) or not all(k in model for k in ("num_layers", "hidden_size", "vocab_size")):
        raise ThresholdsFileError(f"thresholds file {path!r}: 'model' must be a model fingerprint "
                                  f"(num_layers, hidden_size, vocab_size, embed_abs_sum), got {model!r}")
    if isinstance(t, list) and len(t) != model["num_layers"]:
        raise ThresholdsFileError(f"thresholds file {path!r}: a per-layer 'threshold' needs {model['num_layers']} "
                                  f"values (the model's layers), got {len(t)}")
    return data


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_config(data: dict, path: str, *, measure, batch_rule, min_exit_layer, check_every, decay,
                 classifier_path, decision_path=None, decision_sha256=None) -> None:
    """Raises unless the early-exit settings are the ones the file was calibrated for: the
    guarantee holds only for that measure, those checked layers, that decay and batch rule."""
    for name, mine in (("measure", measure), ("batch_rule", batch_rule), ("min_exit_layer", min_exit_layer),
                       ("check_every", check_every), ("decay", decay)):
        if mine != data[name]:
            raise ThresholdsFileError(f"thresholds file {path!r} was calibrated with {name}={data[name]!r}, "
                                      f"but the early-exit config has {name}={mine!r}")
    if data["measure"] == "classifier":
        ident = data.get("classifier") or {}
        if classifier_path and os.path.isfile(classifier_path) and ident.get("sha256") != file_sha256(classifier_path):
            raise ThresholdsFileError(f"thresholds file {path!r} was calibrated with another exit classifier "
                                      f"than {classifier_path!r}")
    if data["measure"] == "agreement" and (data.get("decision") or {}).get("sha256") != decision_sha256:
        raise ThresholdsFileError(f"thresholds file {path!r} was calibrated with another decision file than "
                                  f"{decision_path or 'the shipped one'!r}")


def model_identity(model) -> dict:
    """eecore.models.exit_adapter.model_fingerprint, plus the signed sum of the same embedding rows:
    the absolute sum alone tells two random models of one shape apart only to ~1e-3 (its
    tolerance), while signed sums of different weights differ by far more than that tolerance."""
    from eecore.models.exit_adapter import leading_embedding_rows, model_fingerprint

    return dict(model_fingerprint(model), embed_sum=float(leading_embedding_rows(model).double().sum()))


def check_model(data: dict, path: str, model, adapters, kind: str = "thresholds file", made: str = "calibrated"
                ) -> None:
    """Raises unless the file was calibrated (`made`) on this model, with these exit adapters (or
    none). `kind` names the file in the message (another file made for one model uses it too)."""
    from eecore.models.exit_adapter import check_fingerprint

    source = f"{kind} {path!r}"
    try:
        check_fingerprint(data["model"], model, source)
    except ValueError as exc:
        raise ThresholdsFileError(str(exc)) from None
    found, ref = model_identity(model), data["model"].get("embed_sum")
    if ref is not None and abs(found["embed_sum"] - ref) > 1e-3 * found["embed_abs_sum"]:
        raise ThresholdsFileError(f"{source}: made for another model of the same shape (embedding checksum "
                                  f"{ref} here, {found['embed_sum']} for this model)")
    mine, theirs = adapter_identity(adapters), data["exit_adapter"]
    if (mine is None) != (theirs is None):
        have = "with exit adapters" if theirs is not None else "without exit adapters"
        raise ThresholdsFileError(f"{source} was {made} {have}, but this LLM runs "
                                  f"{'with' if mine is not None else 'without'} them")
    if mine is not None and mine["sha256"] != theirs.get("sha256"):
        raise ThresholdsFileError(f"{source} was {made} with other exit adapters (layers "
                                  f"{theirs.get('exit_layers')}) than this LLM's (layers {mine['exit_layers']})")
