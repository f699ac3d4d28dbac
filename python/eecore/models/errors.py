"""The errors model loading raises.

They subclass the builtin exceptions a caller would already catch (`FileNotFoundError` for a
missing file, `ValueError` for content that cannot be used), so `except ValueError` keeps working,
while `except ModelLoadError` catches every loading problem at once.
"""
from __future__ import annotations


class ModelLoadError(ValueError):
    """Base class: a model could not be loaded. The message names the path and what was expected."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The path does not exist, or a file the checkpoint needs is not there."""


class DefaultModelNotInstalledError(ModelNotFoundError):
    """`model=None` was asked for, but the package that ships the default model is not installed."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable, but describes a model eecore does not implement."""


class CorruptCheckpointError(ModelLoadError):
    """A file is truncated, malformed, or disagrees with the rest of the checkpoint."""
