"""Llama-family models: configs, checkpoint loading (HF safetensors directories, GGUF) and tokenizers."""
from eecore.models.config import ModelConfig
from eecore.models.errors import (CorruptCheckpointError, DefaultModelNotInstalledError, ModelLoadError,
                                  ModelNotFoundError, UnsupportedModelError)
from eecore.models.loader import LoadedModel, default_model_path, load_model
from eecore.models.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "ModelConfig", "LoadedModel", "load_model", "default_model_path", "Tokenizer",
    "ModelLoadError", "ModelNotFoundError", "DefaultModelNotInstalledError", "UnsupportedModelError",
    "CorruptCheckpointError", "ChatTemplateError",
]
