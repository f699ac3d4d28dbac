"""Exit adapters: small trained blocks that let a frozen model's layer-E state predict its last layer.

A model that was never trained for early exit reads nonsense off its middle layers (SmolLM2-135M's
layer 12 agrees with its last layer on 8% of tokens). Retraining the model changes what it says;
an exit adapter leaves every base weight alone, so full depth stays exactly the original model,
and only the draft / early-exit path changes:

    exit state h (residual stream after layer E-1)
    h' = h + W_down (silu(W_gate n) * W_up n),  n = rms_norm(h) * g        (one SwiGLU block)
    logits = LM_head[vocab] · final_norm(h')                               (the model's own head)

`vocab` is the draft vocabulary: the K most frequent token ids, counted once on local text. A draft
scores only those K rows of the LM head (FR-Spec's idea), which is most of a draft's cost on a
small model (SmolLM2's head is 21% of its bytes). Verification always uses the full head, so the
output never changes. A draft vocabulary also works with no adapter (`ExitAdapters(vocab=...)`).

An exit-ready model may also reshape the base itself (`eecore.train.exit_ready`: LayerSkip's recipe
on LoRA pairs, so the early layers learn to be read early). Its file then carries the LoRA pairs
too, and loading it merges them into the base weights before the model is built
(eecore.models.lora): full depth is then the trained model, and its quality is what the model card
measures against the original.

File format (safetensors, `save` / `load`):
    exit.{E}.norm [d], exit.{E}.gate_up [2m, d], exit.{E}.down [d, m]   one block per exit layer E
    draft_vocab int32 [K]                                                 optional
    lora.{module path}.a [r, in], lora.{module path}.b [out, r]          optional (formats 2 and 3)
    metadata: format, base (the model fingerprint, see `model_fingerprint`), info (JSON: training),
              lora_scale (with pairs)
Format 1 files have no LoRA pairs; a file with pairs is format 2, so that an eecore that predates
them refuses it instead of drafting for a base it would not have merged. Format 3 (`save(int8=True)`)
holds either, with every projection (gate_up, down, each pair's A and B) stored as weight-only int8
(eecore.models.int8_weights): its integers under the tensor's name, its per-row fp32 scales under
the name + ".scale". That halves a bf16 file, so a draft copy's pairs can have twice the rank in the
same bytes; the pairs' int8 error (~1% of a delta's norm) is below what the extra rank buys, and an
int8 draft copy quantizes the merged weights anyway. Loading widens them back to fp32.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from eecore import ops
from eecore.models.amx_weights import tiled
from eecore.models.int8_weights import Int8Weight, eight_bit, leading_rows, project
from eecore.models.draft_columns import DraftColumns
from eecore.models.lora import LoraDeltas

FORMAT = "eecore-exit-adapter-1"
FORMAT_LORA = "eecore-exit-adapter-2"  # with LoRA pairs merged into the base at load
FORMAT_INT8 = "eecore-exit-adapter-3"  # format 1 or 2's tensors, projections stored as int8
FORMATS = (FORMAT, FORMAT_LORA, FORMAT_INT8)
_SCALE = ".scale"  # format 3: the suffix of an int8 tensor's per-row scales
# The exit adapters trained by eecore for the default model, shipped inside the package.
_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
SHIPPED_FILE = os.path.join(_DATA, "smollm2-135m-instruct-exit-adapters.safetensors")
# The file for separate draft layers (eecore.speculative.draft_stack): an exit adapter and the LoRA
# pairs of the layers below it, trained together; full depth never sees the pairs.
SHIPPED_DRAFT_FILE = os.path.join(_DATA, "smollm2-135m-instruct-draft-layers.safetensors")


@dataclass
class AdapterBlock:
    """One exit's SwiGLU block (module doc): norm [d], gate_up [2m, d] (gate rows first), down [d, m]."""
    norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def hidden(self) -> int:
        return self.down.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.norm, self.gate_up, self.down

    def to(self, dtype: torch.dtype, device) -> "AdapterBlock":
        return AdapterBlock(*(t.to(device=device, dtype=dtype).contiguous() for t in self.tensors()))

    def eight_bit(self) -> "AdapterBlock":
        """Its projections in 8 bits (int8_weights.eight_bit; the norm as it is): for a draft copy in int8."""
        return AdapterBlock(self.norm, eight_bit(self.gate_up), eight_bit(self.down))


def _widen_int8(tensors: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """A format-3 file's tensors with each int8 projection and its scales replaced by the fp32 weight."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(_SCALE):
            if name[:-len(_SCALE)] not in tensors:
                raise ValueError(f"{path}: scales {name!r} belong to no tensor")
            continue
        scale = tensors.get(name + _SCALE)
        if name.startswith("lora.") or name.endswith((".gate_up", ".down")):
            if t.dtype != torch.int8 or t.dim() != 2 or scale is None:
                raise ValueError(f"{path}: format {FORMAT_INT8!r} stores {name!r} as 2-D int8 with its scales "
                                 f"{name + _SCALE!r}; found {t.dtype} {tuple(t.shape)}"
                                 + ("" if scale is not None else " and no scales"))
            if scale.dtype != torch.float32 or scale.shape != (t.shape[0],) or not bool(torch.isfinite(scale).all()):
                raise ValueError(f"{path}: {name + _SCALE!r} must be {t.shape[0]} finite float32 scales, "
                                 f"found {scale.dtype} {tuple(scale.shape)}")
            t = Int8Weight(t, scale).dequantize(torch.float32)
        elif scale is not None:
            raise ValueError(f"{path}: {name!r} is not a projection, so it has no int8 scales")
        out[name] = t
    return out


def adapter_reference(block: AdapterBlock, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """h + block(h) in plain PyTorch, differentiable: the training forward and the test oracle."""
    x = hidden.float()
    normed = F.rms_norm(x, (x.shape[-1],), block.norm.float(), eps)
    gate, up = (normed @ block.gate_up.float().t()).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ block.down.float().t()


def leading_embedding_rows(model, n: int = 256) -> torch.Tensor:
    """The embedding's first `n` rows (under tensor parallelism gathered from the ranks holding them:
    every rank must call this)."""
    if getattr(model, "vocab_parallel", None) is None:
        return leading_rows(model.embed, n)
    ids = torch.arange(min(n, model.config.vocab_size), device=model.device)
    out = torch.empty(ids.shape[0], model.config.hidden_size, dtype=model.dtype, device=model.device)
    return model.embed_tokens(ids, out)


def model_fingerprint(model) -> dict:
    """What an adapter file must match: the model's shape, and a checksum of its embedding that does
    not depend on the dtype it was loaded in (compared with a relative tolerance)."""
    c = model.config
    return {"num_layers": c.num_layers, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
            "embed_abs_sum": float(leading_embedding_rows(model).double().abs().sum())}


def check_fingerprint(expected: dict, model, source: str) -> None:
    found = model_fingerprint(model)
    for key in ("num_layers", "hidden_size", "vocab_size"):
        if expected.get(key) != found[key]:
            raise ValueError(f"{source}: made for a model with {key}={expected.get(key)}, "
                             f"but this model has {key}={found[key]}")
    ref, got = expected.get("embed_abs_sum"), found["embed_abs_sum"]
    if ref is None or abs(got - ref) > 1e-3 * abs(ref):
        raise ValueError(f"{source}: made for another model of the same shape (embedding checksum "
                         f"{ref} here, {got} for this model)")


@dataclass
class ExitAdapters:
    """Adapter blocks by exit layer, plus an optional draft vocabulary, for one base model."""
    blocks: dict[int, AdapterBlock] = field(default_factory=dict)
    vocab: Optional[torch.Tensor] = None     # int64 [K], sorted token ids
    base: dict = field(default_factory=dict)  # model_fingerprint of the model they were trained for
    info: dict = field(default_factory=dict)  # how they were made (data, tokens, steps, losses)
    lora: Optional[LoraDeltas] = None         # base-weight deltas, merged at load (module doc)
    source: str = field(default="exit adapter", compare=False)  # the file, for error messages

    def exit_layers(self) -> list[int]:
        return sorted(self.blocks)

    def save(self, path: str, int8: bool = False) -> None:
        """Writes the file (module doc); `int8=True` stores the projections as int8 (format 3)."""
        from safetensors.torch import save_file

        tensors, projections = {}, {}
        for E, block in self.blocks.items():
            tensors[f"exit.{E}.norm"] = block.norm.detach().contiguous().cpu()
            projections.update({f"exit.{E}.gate_up": block.gate_up, f"exit.{E}.down": block.down})
        if self.vocab is not None:
            tensors["draft_vocab"] = self.vocab.to(torch.int32).contiguous().cpu()
        metadata = {"format": FORMAT, "base": json.dumps(self.base), "info": json.dumps(self.info)}
        if self.lora is not None:
            projections.update(self.lora.tensors())
            metadata.update(format=FORMAT_LORA, lora_scale=repr(float(self.lora.scale)))
        for name, t in projections.items():
            t = t.detach().cpu()
            if int8:
                q = Int8Weight.quantize(t)
                tensors[name], tensors[name + _SCALE] = q.data, q.scale
            else:
                tensors[name] = t.contiguous()
        if int8:
            metadata["format"] = FORMAT_INT8
        save_file(tensors, path, metadata=metadata)

    @classmethod
    def load(cls, path: str) -> "ExitAdapters":
        from safetensors import safe_open

        if not os.path.isfile(path):
            raise FileNotFoundError(f"exit adapter file {path!r} does not exist")
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for a malformed header
            raise ValueError(f"{path}: not a safetensors exit adapter file ({exc})") from exc
        if meta.get("format") not in FORMATS:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected one of {', '.join(map(repr, FORMATS))}")
        if meta["format"] == FORMAT_INT8:
            tensors = _widen_int8(tensors, path)
        lora = None
        has_pairs = any(name.startswith("lora.") for name in tensors)
        if meta["format"] == FORMAT_LORA or (meta["format"] == FORMAT_INT8 and has_pairs):
            try:
                scale = float(meta.get("lora_scale", "nan"))
            except ValueError:
                scale = float("nan")
            lora = LoraDeltas.from_tensors(tensors, scale, path)
            if not lora.pairs:
                raise ValueError(f"{path}: format {FORMAT_LORA!r} but no lora.* tensors")
        elif has_pairs:
            raise ValueError(f"{path}: format {FORMAT!r} cannot hold lora.* tensors (they need {FORMAT_LORA!r})")
        blocks = {}
        for name in tensors:
            if name.startswith("exit."):
                parts = name.split(".")
                if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in ("norm", "gate_up", "down"):
                    raise ValueError(f"{path}: tensor {name!r} is not named exit.<layer>.norm|gate_up|down")
                E = int(parts[1])
                if E not in blocks:
                    try:
                        blocks[E] = AdapterBlock(*(tensors[f"exit.{E}.{n}"] for n in ("norm", "gate_up", "down")))
                    except KeyError as exc:
                        raise ValueError(f"{path}: exit {E} lacks tensor {exc}") from None
        vocab = tensors.get("draft_vocab")
        out = cls(blocks, None if vocab is None else vocab.long(), json.loads(meta.get("base", "{}")),
                  json.loads(meta.get("info", "{}")), lora, path)
        out.validate(path)
        return out

    def validate(self, source: str = "ExitAdapters") -> None:
        for E, b in self.blocks.items():
            ranks_ok = b.norm.dim() == 1 and b.gate_up.dim() == 2 and b.down.dim() == 2
            d = b.norm.shape[0] if ranks_ok else -1
            if not ranks_ok or b.gate_up.shape != (2 * b.hidden, d) or b.down.shape != (d, b.hidden):
                raise ValueError(f"{source}: exit {E} has inconsistent shapes norm {tuple(b.norm.shape)}, "
                                 f"gate_up {tuple(b.gate_up.shape)}, down {tuple(b.down.shape)}")
        if self.vocab is not None:
            v = self.vocab
            if v.dim() != 1 or v.numel() == 0 or bool((v[1:] <= v[:-1]).any()):
                raise ValueError(f"{source}: draft_vocab must be a non-empty, strictly increasing list of token ids")

    def check_model(self, model, source: Optional[str] = None) -> None:
        """Raises unless these adapters fit `model` (shape, fingerprint, layer and token ranges)."""
        source = source or self.source
        if self.base:
            check_fingerprint(self.base, model, source)
        c = model.config
        for E, b in self.blocks.items():
            if not 1 <= E < c.num_layers:
                raise ValueError(f"{source}: exit layer {E} outside 1..{c.num_layers - 1}")
            if b.norm.shape[0] != c.hidden_size:
                raise ValueError(f"{source}: exit {E} is for hidden size {b.norm.shape[0]}, the model has {c.hidden_size}")
        if self.vocab is not None and (int(self.vocab[0]) < 0 or int(self.vocab[-1]) >= c.vocab_size):
            raise ValueError(f"{source}: draft_vocab holds ids outside the model's vocabulary 0..{c.vocab_size - 1}")


class DraftHead(DraftColumns):
    """Reads draft logits off layer-E residual states at inference, with preallocated buffers:
    the exit's adapter block (if any), the final norm, and the LM head rows of the draft
    vocabulary (all of them without one). `logits` returns fp32 `[n, K]`; `token_ids` maps a
    column to its token id. A model with 8-bit projections (a draft copy: int8_weights.eight_bit)
    gets an 8-bit adapter and head too."""

    def __init__(self, model, exit_layer: int, adapters: Optional[ExitAdapters], max_rows: int):
        self.model = model
        self.exit_layer = exit_layer
        dtype, device, d = model.dtype, model.device, model.config.hidden_size
        block = adapters.blocks.get(exit_layer) if adapters is not None else None
        self.block = None if block is None else block.to(dtype, device)
        if self.block is not None and model.weight_dtype == torch.int8:
            self.block = self.block.eight_bit()
        vocab = adapters.vocab if adapters is not None else None
        super().__init__(vocab, model.config.vocab_size, max_rows, device)
        head = model.lm_head
        if getattr(model, "vocab_parallel", None) is not None:  # the head split over ranks: its rows gathered
            ids = self.vocab if self.vocab is not None else torch.arange(model.config.vocab_size, device=device)
            head = model.head_rows(torch.empty(ids.shape[0], d, dtype=dtype, device=device), ids)
        elif self.vocab is not None:
            head = head.index_select(0, self.vocab).contiguous() if isinstance(head, torch.Tensor) \
                else head.rows(self.vocab)
        self.head = head
        if isinstance(head, Int8Weight) and model.device.type == "cpu":  # an int8 copy: AMX-INT8 tiles where it runs
            self.head = tiled(head)
            if self.block is not None:
                self.block = AdapterBlock(self.block.norm, tiled(self.block.gate_up), tiled(self.block.down))
        width = self.head.shape[0]
        self._state = torch.empty(max_rows, d, dtype=dtype, device=device)
        self._normed_buf = torch.empty(max_rows, d, dtype=dtype, device=device)
        if self.block is not None:
            self._gate_up = torch.empty(max_rows, 2 * self.block.hidden, dtype=dtype, device=device)
            self._act = torch.empty(max_rows, self.block.hidden, dtype=dtype, device=device)
        self._logits = torch.empty(max_rows, width, dtype=dtype, device=device)
        self._logits_f32 = self._logits if dtype == torch.float32 else \
            torch.empty(max_rows, width, dtype=torch.float32, device=device)

    @property
    def vocab_size(self) -> int:
        return self.head.shape[0]

    def weight_bytes(self) -> int:
        """Bytes a draft token reads past layer E: the adapter, the final norm and the head rows."""
        tensors = (self.head, self.model.final_norm) + (self.block.tensors() if self.block is not None else ())
        return sum(t.nbytes for t in tensors)

    def adapted(self, hidden: torch.Tensor) -> torch.Tensor:
        """h + block(h) for rows `[n, d]` into an internal buffer (the input is left untouched: it is
        the exit-query cache, which verification continues from)."""
        n = hidden.shape[0]
        state = self._state[:n].copy_(hidden)
        if self.block is None:
            return state
        b, eps = self.block, self.model.eps
        normed = ops.rms_norm(self._normed_buf[:n], state, b.norm, eps)
        gate_up = project(self._gate_up[:n], normed, b.gate_up)
        act = ops.silu_and_mul(self._act[:n], gate_up)
        return project(state, act, b.down, accumulate=True)

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.final_norm_(self.adapted(hidden), self._normed_buf[: hidden.shape[0]])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 draft logits `[n, V]` of layer-E states `[n, d]` (-inf outside the draft vocabulary)."""
        return self.widen(self.columns(hidden))

    def columns(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[n, K]` of the head's K columns only (`token_ids` maps a column to its
        token). Greedy drafting needs no more: the argmax and the top-1 probability over the draft
        vocabulary are those over the whole vocabulary, whose other logits are -inf. With an
        8,192-token draft vocabulary that spares a softmax and an argmax over 49,152 columns per
        drafted token (SmolLM2: 0.25 ms of a ~3 ms copy pass on a Zen 3)."""
        n = hidden.shape[0]
        logits = project(self._logits[:n], self._normed(hidden), self.head)
        if logits.dtype != torch.float32:
            logits = self._logits_f32[:n].copy_(logits)
        return logits

    def top2_gap(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(p1 - p2 over the draft vocabulary, the top-1 token id) per row, fused: no logits (an
        int8 or GGUF head computes them, then takes the gap)."""
        if not isinstance(self.head, torch.Tensor):
            n = hidden.shape[0]
            gap, top1 = ops.softmax_top2_gap(project(self._logits[:n], self._normed(hidden), self.head))
        else:
            gap, top1 = ops.lm_head_top2_gap(self._normed(hidden), self.head)
        return gap, self.token_ids(top1)


def _adapter_path(spec, model_path, is_encoder_decoder: bool, separate_draft_layers: bool = False) -> Optional[str]:
    """The adapter file `LLM(exit_adapter=spec)` names: None for None or False, the shipped file for
    True (the one for separate draft layers when they are on), else the path given."""
    if spec is None or spec is False:
        return None
    if is_encoder_decoder:
        raise ValueError("LLM: 'exit_adapter' is for decoder-only models; exit adapters are not trained for "
                         "encoder-decoders such as T5 (use early_exit, or a CALM classifier)")
    if spec is True:
        if model_path is not None:
            raise ValueError("LLM: exit_adapter=True loads the adapters shipped for the default model "
                             f"(SmolLM2-135M-Instruct), not for {model_path!r}; pass an adapter file instead")
        shipped = SHIPPED_DRAFT_FILE if separate_draft_layers else SHIPPED_FILE
        if not os.path.isfile(shipped):
            raise FileNotFoundError(f"the shipped exit adapter file {shipped} is missing; reinstall eecore")
        return shipped
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"LLM: 'exit_adapter' must be None, True or a file path, got {type(spec).__name__}")
    return os.fspath(spec)


def load_exit_adapters(spec, model_path, loaded, merge_lora: bool = True) -> Optional[ExitAdapters]:
    """`LLM(exit_adapter=spec)` before the model is built, from `loaded` (an
    eecore.models.loader.LoadedModel): loads the file and merges its LoRA pairs, if any, into
    `loaded.state_dict` (unless `merge_lora` is False: separate draft layers take them instead, see
    eecore.speculative.draft_stack, and `spec=True` then means the shipped file for them). Check the
    built model with `check_model` next."""
    from eecore.models.t5_config import T5Config

    path = _adapter_path(spec, model_path, isinstance(loaded.config, T5Config), not merge_lora)
    if path is None:
        return None
    adapters = ExitAdapters.load(path)
    if adapters.lora is not None:
        if merge_lora:
            adapters.lora.merge_into(loaded.state_dict, path)
        else:
            adapters.lora.check_state_dict(loaded.state_dict, path)
    return adapters

