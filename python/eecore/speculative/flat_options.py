"""Self-speculation options by flat name, the names of `eecore generate`'s flags: `draft_threshold`
is `--draft-threshold`, and sets `layer.stop_below`. The CLI builds its flags from this table, the
exit-ready presets take their overrides in it, and `SelfSpeculativeConfig`'s deprecated flat keyword
arguments are read through it. The table is derived from the fields' metadata
(eecore.speculative.options.option), so a new field gets its flag by being declared.

Three flat names choose parts rather than set a field:
    draft="layer" | "lookup" | "hybrid"     which of `layer` and `lookup` there are
    draft_layers="shared" | "separate"      whether `layer.copy` is there
    accept="confident"                      (deprecated) exits at `draft_threshold`: exit_threshold's
                                            default; accept="verified" means no exit_threshold
"""
from __future__ import annotations

from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Iterator, Optional

from eecore.speculative.options import DRAFT_MODES

PART_CHOICES = {"draft": DRAFT_MODES, "draft_layers": ("shared", "separate"),
                "accept": ("verified", "confident")}
# the parts a flat option needs, by the field that holds them, and what its absence means to a user
PART_NAMES = {"layer": "layer drafts (draft='layer' or 'hybrid', with exit_layer)",
              "lookup": "lookup drafts (draft='lookup' or 'hybrid')",
              "copy": "a draft copy (draft_layers='separate')",
              "guard": "the acceptance guard (min_acceptance)"}


def walk(cls, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Field]]:
    """(path, field) of every leaf option under `cls`, depth first in declaration order."""
    for f in fields(cls):
        nested = f.metadata.get("nested")
        if nested is not None:
            yield from walk(nested, path + (f.name,))
        elif f.metadata.get("flag"):
            yield path + (f.name,), f


def flat_name(f: Field) -> str:
    return f.metadata["flag"].lstrip("-").replace("-", "_")


def option_paths(config_cls) -> dict[str, tuple[tuple[str, ...], Field]]:
    """Flat name -> (path in a `config_cls` (SelfSpeculativeConfig), field)."""
    return {flat_name(f): (path, f) for path, f in walk(config_cls)}


def tree_of(config) -> dict:
    """A config as nested dicts (absent parts None), to edit before building it again."""
    return {f.name: tree_of(getattr(config, f.name)) if is_dataclass(getattr(config, f.name))
            else getattr(config, f.name) for f in fields(config)}


def from_flat(config_cls, options: dict, base=None):
    """The `config_cls` (SelfSpeculativeConfig) of `options` (flat names; see the module doc)
    applied on `base` (None: a config with layer drafts, unless `draft` says otherwise). An option
    given as None is unset. ValueError names the option."""
    options = dict(options)
    paths = option_paths(config_cls)
    unknown = sorted(set(options) - set(paths) - set(PART_CHOICES))
    if unknown:
        raise TypeError(f"SelfSpeculativeConfig: unknown option(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(set(paths) | set(PART_CHOICES)))}")
    for name, choices in PART_CHOICES.items():
        if name in options and options[name] not in choices:
            raise ValueError(f"SelfSpeculativeConfig: '{name}' must be one of {', '.join(choices)}, "
                             f"got {options[name]!r}")
    tree = {"layer": None, "lookup": None} if base is None else tree_of(base)
    _choose_parts(tree, options, base is None)
    accept = options.pop("accept", None)
    if tree["layer"] is None:
        options.pop("exit_layer", None)  # lookup drafts only: the depth of layer drafts has no use
    for name, value in options.items():
        if name not in PART_CHOICES:
            _set(tree, paths[name][0], value, name)
    _apply_accept(tree, accept, options)
    return _build(config_cls, tree)


def _choose_parts(tree: dict, options: dict, fresh: bool) -> None:
    draft = options.get("draft", "layer" if fresh else None)
    if draft is not None:
        tree["layer"] = (tree["layer"] or {}) if draft in ("layer", "hybrid") else None
        tree["lookup"] = (tree["lookup"] or {}) if draft in ("lookup", "hybrid") else None
    if tree["layer"] is not None and tree["layer"].get("exit_layer") is None and options.get("exit_layer") is None:
        raise ValueError(f"SelfSpeculativeConfig: 'exit_layer' is required with draft={draft or 'layer'!r} "
                         f"(only draft='lookup' runs without one)")
    layers = options.get("draft_layers")
    if layers is not None:
        if tree["layer"] is None:
            raise ValueError(f"SelfSpeculativeConfig: draft_layers={layers!r} applies to "
                             f"{PART_NAMES['layer']}, and this config has none")
        tree["layer"]["copy"] = (tree["layer"].get("copy") or {}) if layers == "separate" else None
    if "min_acceptance" in options and tree["layer"] is not None:
        if options["min_acceptance"] is None:  # no floor: no guard
            tree["layer"]["guard"] = None
            del options["min_acceptance"]
        elif not tree["layer"].get("guard"):
            tree["layer"]["guard"] = {}


def _set(tree: dict, path: tuple[str, ...], value, name: str) -> None:
    node = tree
    for part in path[:-1]:
        if node.get(part) is None:
            if value is None:
                return  # unsetting an option of a part that is not there
            raise ValueError(f"SelfSpeculativeConfig: '{name}' applies to {PART_NAMES[part]}, and this config "
                             f"has none")
        node = node[part]
    node[path[-1]] = value


def _apply_accept(tree: dict, accept: Optional[str], options: dict) -> None:
    layer = tree["layer"]
    if accept == "confident":
        if layer is None:
            raise ValueError(f"SelfSpeculativeConfig: accept='confident' applies to {PART_NAMES['layer']}")
        if layer.get("stop_below") is None:
            raise ValueError("SelfSpeculativeConfig: accept='confident' needs 'draft_threshold' (the exit "
                             "confidence: a draft's top-1 probability at layer E)")
        if layer.get("exit_threshold") is None:
            layer["exit_threshold"] = layer["stop_below"]
    elif accept == "verified" and options.get("exit_threshold") is not None:
        raise ValueError("SelfSpeculativeConfig: 'exit_threshold' makes sure drafts exit unverified, and "
                         "accept='verified' asks for every draft to be verified")
    elif accept == "verified" and layer is not None:
        layer["exit_threshold"] = None


def _build(cls, tree: dict):
    kwargs = {}
    for f in fields(cls):
        value = tree.get(f.name, MISSING)
        nested = f.metadata.get("nested")
        if nested is not None and value is not None and value is not MISSING:
            value = _build(nested, value)
        if value is not MISSING:
            kwargs[f.name] = value
    return cls(**kwargs)


def from_deprecated_keywords(config_cls, options: dict):
    """`SelfSpeculativeConfig(**flat)` of earlier releases, with their meaning: options they took
    and ignored stay ignored, and an exit threshold still needs accept='confident'."""
    options = dict(options)
    if options.get("min_acceptance") is None:
        options.pop("probe_every", None)  # the guard's, and there was no guard
    if options.get("draft_top_k") == 1 and options.get("draft_layers") != "separate":
        options.pop("draft_top_k")
    if options.get("exit_threshold") is not None and options.get("accept") != "confident":
        raise ValueError(f"SelfSpeculativeConfig: 'exit_threshold' applies to accept='confident' only, "
                         f"got {options['exit_threshold']!r} with accept={options.get('accept', 'verified')!r}")
    return from_flat(config_cls, options)

