"""Self-speculation options by flat name, the names of the `eecore` command's flags: `draft_threshold`
is `--draft-threshold`, and sets `layer.stop_below`. The CLI builds its flags from this table and
applies them to a fresh config or to an exit-ready preset (`preset_with`); in Python a config is
built from its parts (eecore.speculative.options) and changed with `dataclasses.replace`. The table
is derived from the fields' metadata (eecore.speculative.options.option), so a new field gets its
flag by being declared.

Two flat names choose parts rather than set a field:
    draft="layer" | "lookup" | "hybrid" | "feature"   which of `layer`, `lookup` and `feature` there are
    draft_layers="shared" | "separate"      whether `layer.copy` is there
"""
from __future__ import annotations

from dataclasses import MISSING, Field, fields, is_dataclass, replace
from typing import Iterator

from eecore.speculative.options import DRAFT_MODES

PART_CHOICES = {"draft": DRAFT_MODES, "draft_layers": ("shared", "separate")}
# the parts a flat option needs, by the field that holds them, and what its absence means to a user
PART_NAMES = {"layer": "layer drafts (draft='layer' or 'hybrid', with exit_layer)",
              "lookup": "lookup drafts (draft='lookup' or 'hybrid')",
              "copy": "a draft copy (draft_layers='separate')",
              "guard": "the acceptance guard (min_acceptance)",
              "feature": "feature drafts (draft='feature', with feature_head)"}


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
    tree = {"layer": None, "lookup": None, "feature": None} if base is None else tree_of(base)
    _choose_parts(tree, options, base is None)
    if tree["layer"] is None:
        options.pop("exit_layer", None)  # lookup drafts only: the depth of layer drafts has no use
    for name, value in options.items():
        if name not in PART_CHOICES:
            _set(tree, paths[name][0], value, name)
    return _build(config_cls, tree)


def _choose_parts(tree: dict, options: dict, fresh: bool) -> None:
    draft = options.get("draft", "layer" if fresh else None)
    if draft is not None:
        tree["layer"] = (tree["layer"] or {}) if draft in ("layer", "hybrid") else None
        tree["lookup"] = (tree["lookup"] or {}) if draft in ("lookup", "hybrid") else None
        tree["feature"] = (tree.get("feature") or {}) if draft == "feature" else None
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


def preset_with(preset, options: dict):
    """An exit-ready preset (`SelfSpeculativeConfig.exit_ready`) with the flags `options` (flat
    names) applied, as `--exit-ready` and its flags build it: exits (`exit_threshold`) turn the
    planner off unless `adaptive_drafts` is given (exits need fixed lengths:
    SelfSpeculativeConfig.adaptive), and a lower overall batch limit given alone lowers the layer
    drafts' with it. Flags that a feature head beside the copy does not combine with (no planner, a
    guard, exits, shared layers) leave the layer preset's head and prompt lookup out."""
    options = dict(options)
    if options.get("exit_threshold") is not None and options.get("adaptive_drafts") is None:
        options["adaptive_drafts"] = False
    if preset.feature is not None and (options.get("adaptive_drafts") is False or options.get("draft_layers") == "shared"
                                       or options.get("exit_threshold") is not None
                                       or options.get("min_acceptance") is not None):
        # a feature head beside the copy needs the planner's choice and none of these: the copy goes on
        # alone (without the lookup that comes with the head, as the layer preset was before it)
        preset = replace(preset, feature=None, lookup=None)
    limit = options.get("disable_by_batch_size")
    if limit is not None and preset.layer is not None and preset.layer.disable_by_batch_size is not None \
            and "layer_disable_by_batch_size" not in options:
        options["layer_disable_by_batch_size"] = min(preset.layer.disable_by_batch_size, limit)
    return from_flat(type(preset), options, preset)
