"""Optional dependencies: a feature that needs one says which extra installs it, in one line."""
from __future__ import annotations

import importlib.util

EXTRAS = {"matplotlib": "plot", "transformers": "train", "peft": "train"}


class MissingExtraError(RuntimeError):
    pass


def require(module: str, feature: str) -> None:
    """Raises MissingExtraError ("--plot needs matplotlib: pip install 'eecore[plot]'") when
    `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        extra = EXTRAS.get(module)
        how = f"pip install 'eecore[{extra}]'" if extra else f"pip install {module}"
        raise MissingExtraError(f"{feature} needs {module}: {how}")


def require_or_exit(modules: list[str], feature: str) -> None:
    """`require` for command-line entry points: a one-line exit instead of a traceback."""
    try:
        for module in modules:
            require(module, feature)
    except MissingExtraError as exc:
        raise SystemExit(f"eecore: {exc}") from None
