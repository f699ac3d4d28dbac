"""The exit classifier file: CALM's dedicated early-exit classifier, one small MLP per exit layer.

Format: a safetensors file whose metadata has `format = "eecore-exit-classifier"`,
`version = "1"`, `hidden_size = "<d>"`, and `input = "final_norm"` (the classifier reads the
hidden state after the model's final RMSNorm, the same input the LM head sees). Its tensors, per
exit layer E (layers 0..E-1 ran) it covers, or once under `shared` for every layer:

    layers.<E>.w1  [m, d]    layers.<E>.b1  [m]    layers.<E>.w2  [m]    layers.<E>.b2  [1]

confidence = sigmoid(w2 . relu(w1 h + b1) + b2). `eecore.train.calm_classifier` trains one.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

FORMAT = "eecore-exit-classifier"
_KEY = re.compile(r"^layers\.(\d+|shared)\.(w1|b1|w2|b2)$")


class ClassifierFileError(ValueError):
    """The exit classifier file is missing or malformed."""


@dataclass
class ExitClassifier:
    hidden_size: int
    layers: dict  # exit layer (int) or "shared" -> (w1, b1, w2, b2)

    def covers(self, exit_layer: int) -> bool:
        return exit_layer in self.layers or "shared" in self.layers

    def weights(self, exit_layer: int):
        return self.layers[exit_layer] if exit_layer in self.layers else self.layers["shared"]

    def to(self, device, dtype=None) -> "ExitClassifier":
        return ExitClassifier(self.hidden_size, {k: tuple(t.to(device=device, dtype=dtype) for t in v)
                                                 for k, v in self.layers.items()})

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        tensors = {f"layers.{k}.{n}": t.detach().cpu().contiguous()
                   for k, v in self.layers.items() for n, t in zip(("w1", "b1", "w2", "b2"), v)}
        save_file(tensors, path, metadata={"format": FORMAT, "version": "1", "hidden_size": str(self.hidden_size),
                                           "input": "final_norm"})

    @classmethod
    def load(cls, path: str, hidden_size: int, num_layers: int, dtype: torch.dtype) -> "ExitClassifier":
        from safetensors import safe_open

        if not os.path.isfile(path):
            raise ClassifierFileError(f"exit classifier file {path!r} does not exist")
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ClassifierFileError(f"exit classifier file {path!r} is not a readable safetensors file: {exc}") \
                from exc
        if meta.get("format") != FORMAT:
            raise ClassifierFileError(f"{path!r}: metadata 'format' must be {FORMAT!r}, got {meta.get('format')!r}")
        if meta.get("hidden_size") != str(hidden_size):
            raise ClassifierFileError(f"{path!r}: made for hidden size {meta.get('hidden_size')}, the model has "
                                      f"{hidden_size}")
        groups: dict = {}
        for key, t in tensors.items():
            m = _KEY.match(key)
            if not m:
                raise ClassifierFileError(f"{path!r}: unexpected tensor {key!r} (expected layers.<E>.w1/b1/w2/b2)")
            layer = "shared" if m.group(1) == "shared" else int(m.group(1))
            if layer != "shared" and not 1 <= layer <= num_layers:
                raise ClassifierFileError(f"{path!r}: exit layer {layer} outside 1..{num_layers}")
            groups.setdefault(layer, {})[m.group(2)] = t.to(dtype)
        if not groups:
            raise ClassifierFileError(f"{path!r}: holds no classifier weights")
        layers = {}
        for layer, g in groups.items():
            missing = {"w1", "b1", "w2", "b2"} - g.keys()
            if missing:
                raise ClassifierFileError(f"{path!r}: layer {layer} lacks {sorted(missing)}")
            w1, b1, w2, b2 = g["w1"], g["b1"], g["w2"], g["b2"]
            m = w1.shape[0] if w1.dim() == 2 else -1
            if w1.shape != (m, hidden_size) or b1.shape != (m,) or w2.shape != (m,) or b2.shape != (1,):
                raise ClassifierFileError(
                    f"{path!r}: layer {layer} has shapes w1 {tuple(w1.shape)}, b1 {tuple(b1.shape)}, "
                    f"w2 {tuple(w2.shape)}, b2 {tuple(b2.shape)}; expected [m, {hidden_size}], [m], [m], [1]")
            layers[layer] = (w1.contiguous(), b1.contiguous(), w2.contiguous(), b2.contiguous())
        return cls(hidden_size, layers)
