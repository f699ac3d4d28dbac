"""`SelfSpeculativeConfig` and its parts (eecore.speculative.options): the nested form, the flat
(flag) names of the `eecore` command that build it (eecore.cli.speculative_flags), the flags derived
from the fields, the error messages (class, field and flag) and the checks that span parts."""
from __future__ import annotations

import re
import warnings
from dataclasses import fields, is_dataclass
from re import escape

import pytest

import eecore
from eecore import AcceptanceGuard, DraftCopy, FeatureDrafts, LayerDrafts, LookupDrafts, SelfSpeculativeConfig
from eecore.cli.speculative_flags import flat_name, from_flat, preset_with, walk

PARTS = (SelfSpeculativeConfig, LayerDrafts, DraftCopy, AcceptanceGuard, LookupDrafts, FeatureDrafts)


def test_the_parts_are_exported():
    assert (eecore.LayerDrafts, eecore.LookupDrafts, eecore.DraftCopy, eecore.AcceptanceGuard) == \
        (LayerDrafts, LookupDrafts, DraftCopy, AcceptanceGuard)
    for name in ("SelfSpeculativeConfig", "LayerDrafts", "LookupDrafts", "DraftCopy", "AcceptanceGuard"):
        assert name in eecore.__all__


# ---- the flat (flag) names -------------------------------------------------------------------------

FLAT_AND_NESTED = {
    "layer-threshold": (
        dict(exit_layer=2, num_speculations=3, draft_threshold=0.3),
        SelfSpeculativeConfig(num_speculations=3, layer=LayerDrafts(exit_layer=2, stop_below=0.3))),
    "lookup-ngrams": (
        dict(draft="lookup", num_speculations=3, lookup_min_ngram=2, lookup_max_ngram=4),
        SelfSpeculativeConfig(num_speculations=3, lookup=LookupDrafts(min_ngram=2, max_ngram=4))),
    "lookup-ignores-exit-layer": (  # draft="lookup": the exit layer has no use, even one deeper than any model
        dict(draft="lookup", exit_layer=99, lookup_max_ngram=5),
        SelfSpeculativeConfig(lookup=LookupDrafts(max_ngram=5))),
    "hybrid-token-int8-copy": (
        dict(draft="hybrid", hybrid_switch="token", exit_layer=8, num_speculations=4, layer_speculations=3,
             lookup_min_ngram=2, draft_layers="separate", draft_dtype="int8", layer_disable_by_batch_size=2,
             disable_by_batch_size=4),
        SelfSpeculativeConfig(
            num_speculations=4, hybrid_switch="token", disable_by_batch_size=4, lookup=LookupDrafts(min_ngram=2),
            layer=LayerDrafts(exit_layer=8, max_length=3, copy=DraftCopy(dtype="int8"), disable_by_batch_size=2))),
    "exits": (
        dict(exit_layer=2, num_speculations=3, draft_threshold=0.2, exit_threshold=0.2),
        SelfSpeculativeConfig(num_speculations=3, layer=LayerDrafts(exit_layer=2, stop_below=0.2, exit_threshold=0.2))),
    "exits-through-a-copy": (
        dict(exit_layer=2, draft_threshold=0.2, exit_threshold=0.6, draft_layers="separate"),
        SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, stop_below=0.2, exit_threshold=0.6, copy=DraftCopy()))),
    "shared": (
        dict(exit_layer=2, draft_threshold=0.2, draft_layers="shared"),
        SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, stop_below=0.2))),
    "break-even-guard": (
        dict(exit_layer=3, num_speculations=2, min_acceptance="break-even", probe_every=16),
        SelfSpeculativeConfig(num_speculations=2, layer=LayerDrafts(
            exit_layer=3, guard=AcceptanceGuard(min_acceptance="break-even", probe_every=16)))),
    "guard-and-draft-length": (
        dict(exit_layer=1, min_acceptance=0.4, long_draft_acceptance=0.5),
        SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=1, long_draft_acceptance=0.5,
                                                guard=AcceptanceGuard(min_acceptance=0.4)))),
    "token-tree": (
        dict(exit_layer=2, num_speculations=3, draft_layers="separate", draft_top_k=3),
        SelfSpeculativeConfig(num_speculations=3, layer=LayerDrafts(exit_layer=2, copy=DraftCopy(top_k=3)))),
    "hybrid-round": (
        dict(draft="hybrid", exit_layer=1, num_speculations=3),
        SelfSpeculativeConfig(num_speculations=3, layer=LayerDrafts(exit_layer=1), lookup=LookupDrafts())),
}


@pytest.mark.parametrize("flat, nested", list(FLAT_AND_NESTED.values()), ids=list(FLAT_AND_NESTED))
def test_flat_names_build_the_nested_config(flat, nested):
    config = from_flat(SelfSpeculativeConfig, flat)
    assert config == nested
    assert (config.draft, config.exit_layer, config.verify_width) == (nested.draft, nested.exit_layer,
                                                                       nested.verify_width)


def test_the_flat_keyword_arguments_are_gone():
    """One way to build a config in Python: its parts (the flat names are the command line's)."""
    with pytest.raises(TypeError, match="draft_threshold"):
        SelfSpeculativeConfig(exit_layer=2, draft_threshold=0.3)
    with pytest.raises(TypeError):
        SelfSpeculativeConfig.exit_ready("layer", draft_threshold=0.3)
    with pytest.raises(ValueError, match="'draft' must be one of layer, lookup, hybrid"):
        from_flat(SelfSpeculativeConfig, dict(exit_layer=2, draft="ngram"))
    with pytest.raises(TypeError, match="unknown option\\(s\\) accept"):  # accept="confident" is exit_threshold now
        from_flat(SelfSpeculativeConfig, dict(exit_layer=2, accept="confident"))


@pytest.mark.parametrize("kwargs, nested", [
    (dict(exit_layer=3), SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=3))),
    (dict(exit_layer=2, num_speculations=5), SelfSpeculativeConfig(num_speculations=5, layer=LayerDrafts(exit_layer=2))),
    (dict(exit_layer=12, num_speculations=3, disable_by_batch_size=4),
     SelfSpeculativeConfig(num_speculations=3, layer=LayerDrafts(exit_layer=12), disable_by_batch_size=4)),
    (dict(exit_layer=2, lookup=LookupDrafts(), hybrid_switch="round"),
     SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2), lookup=LookupDrafts())),
], ids=["E", "E-d", "E-d-batch", "E-lookup"])
def test_the_exit_layer_short_form(kwargs, nested):
    """SelfSpeculativeConfig(exit_layer=E, num_speculations=d), the form docs/architecture.md gives: the
    short form of layer=LayerDrafts(exit_layer=E), with no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SelfSpeculativeConfig(**kwargs) == nested
    with pytest.raises(ValueError, match="give 'exit_layer' \\(the short form\\) or 'layer', not both"):
        SelfSpeculativeConfig(exit_layer=2, layer=LayerDrafts(exit_layer=3))


# Flag combinations that name an option of a part the config does not have: refused, saying which
# part is missing.
FLAT_ONLY_ERRORS = {
    "dtype-without-copy": (dict(exit_layer=2, draft_dtype="bfloat16"),
                           "SelfSpeculativeConfig: 'draft_dtype' applies to a draft copy (draft_layers='separate'), "
                           "and this config has none"),
    "tree-without-copy": (dict(exit_layer=2, draft_top_k=2),
                          "SelfSpeculativeConfig: 'draft_top_k' applies to a draft copy (draft_layers='separate'), "
                          "and this config has none"),
    "lookup-copy": (dict(draft="lookup", draft_layers="separate"),
                    "SelfSpeculativeConfig: draft_layers='separate' applies to layer drafts"),
    "lookup-guard": (dict(draft="lookup", min_acceptance="break-even"),
                     "SelfSpeculativeConfig: 'min_acceptance' applies to layer drafts"),
    "lookup-threshold": (dict(draft="lookup", draft_threshold=0.5),
                         "SelfSpeculativeConfig: 'draft_threshold' applies to layer drafts"),
    "lookup-draft-length": (dict(draft="lookup", long_draft_acceptance=0.5),
                            "SelfSpeculativeConfig: 'long_draft_acceptance' applies to layer drafts"),
    "unknown-draft-layers": (dict(exit_layer=2, draft_layers="own"),
                             "SelfSpeculativeConfig: 'draft_layers' must be one of shared, separate, got 'own'"),
    "unknown-draft": (dict(exit_layer=2, draft="ngram"),
                      "SelfSpeculativeConfig: 'draft' must be one of layer, lookup, hybrid, feature, got 'ngram'"),
    "hybrid-without-exit-layer": (dict(draft="hybrid"),
                                  "SelfSpeculativeConfig: 'exit_layer' is required with draft='hybrid'"),
}


@pytest.mark.parametrize("flat, message", list(FLAT_ONLY_ERRORS.values()), ids=list(FLAT_ONLY_ERRORS))
def test_flags_of_a_missing_part_are_refused(flat, message):
    with pytest.raises(ValueError, match=escape(message)):
        from_flat(SelfSpeculativeConfig, flat)


def test_preset_flags_can_unset_options():
    layer = SelfSpeculativeConfig.exit_ready("layer")
    config = preset_with(layer, dict(draft_threshold=None, long_draft_acceptance=None, disable_by_batch_size=None,
                                     min_acceptance=None))
    assert config.layer.stop_below is None and config.layer.long_draft_acceptance is None
    assert config.disable_by_batch_size is None and config.layer.guard is None
    assert preset_with(layer, dict(min_acceptance=0.4)).layer.guard == AcceptanceGuard(0.4)
    assert preset_with(layer, dict(min_acceptance=None)) == layer
    hybrid = preset_with(SelfSpeculativeConfig.exit_ready("hybrid"), dict(draft_threshold=0.3, lookup_max_ngram=5))
    assert (hybrid.layer.stop_below, hybrid.lookup.max_ngram) == (0.3, 5)


# ---- the command line ---------------------------------------------------------------------------

def _generate_flags(capsys) -> set[str]:
    from eecore.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out))


def test_every_field_with_a_flag_is_a_generate_flag(capsys):
    flags = _generate_flags(capsys)
    leaves = list(walk(SelfSpeculativeConfig))
    # the walk reaches every part, and every field of every part is a leaf with a flag or a part
    reached = {SelfSpeculativeConfig} | {f.metadata["nested"] for part in PARTS for f in fields(part)
                                         if f.metadata.get("nested")}
    assert reached == set(PARTS)
    for part in PARTS:
        for f in fields(part):
            assert f.metadata.get("nested") or f.metadata.get("flag"), (part.__name__, f.name)
    assert len(leaves) == sum(1 for part in PARTS for f in fields(part) if not f.metadata.get("nested"))
    missing = [(".".join(path), f.metadata["flag"]) for path, f in leaves if f.metadata["flag"] not in flags]
    assert not missing
    # each flag's value lands where speculative_config reads it: under the field's flat name
    from eecore.cli import parse_args

    args = parse_args(["generate", "hello"])
    assert all(hasattr(args, flat_name(f)) for _, f in leaves)
    assert {"--probe-every", "--exit-threshold", "--draft", "--draft-layers"} <= flags
    assert "--accept" not in flags  # --exit-threshold turns exits on


def _parsed_config(*flags):
    from eecore.cli import parse_args
    from eecore.cli.args import speculative_config

    return speculative_config(parse_args(["generate", "hello", "--speculate", *flags]))


FLAG_CONFIGS = {
    "hybrid-guard-tree": (
        ["--draft", "hybrid", "--exit-layer", "3", "--num-speculations", "5", "--layer-speculations", "3",
         "--draft-threshold", "0.2", "--long-draft-acceptance", "0.4", "--min-acceptance", "0.3",
         "--probe-every", "16", "--draft-layers", "separate", "--draft-dtype", "bfloat16", "--draft-top-k", "2",
         "--layer-disable-by-batch-size", "2", "--disable-by-batch-size", "6", "--lookup-min-ngram", "2",
         "--lookup-max-ngram", "4", "--hybrid-switch", "round"],
        SelfSpeculativeConfig(
            num_speculations=5, hybrid_switch="round", disable_by_batch_size=6,
            layer=LayerDrafts(exit_layer=3, max_length=3, stop_below=0.2, long_draft_acceptance=0.4,
                              guard=AcceptanceGuard(min_acceptance=0.3, probe_every=16),
                              copy=DraftCopy(dtype="bfloat16", top_k=2), disable_by_batch_size=2),
            lookup=LookupDrafts(min_ngram=2, max_ngram=4))),
    "exits": (
        ["--exit-layer", "2", "--draft-threshold", "0.3", "--exit-threshold", "0.7", "--exit-measure", "agreement"],
        SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, stop_below=0.3, exit_threshold=0.7,
                                                exit_measure="agreement"))),
    "confident-as-before": (  # what --accept confident --draft-threshold 0.3 meant
        ["--exit-layer", "2", "--draft-threshold", "0.3", "--exit-threshold", "0.3"],
        SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, stop_below=0.3, exit_threshold=0.3))),
    "token-switch": (
        ["--draft", "hybrid", "--hybrid-switch", "token", "--exit-layer", "2", "--draft-layers", "separate",
         "--draft-dtype", "int8"],
        SelfSpeculativeConfig(hybrid_switch="token", layer=LayerDrafts(exit_layer=2, copy=DraftCopy(dtype="int8")),
                              lookup=LookupDrafts())),
    "break-even": (
        ["--exit-layer", "4", "--min-acceptance", "break-even"],
        SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=4, guard=AcceptanceGuard(min_acceptance="break-even")))),
    "lookup": (
        ["--draft", "lookup", "--num-speculations", "6", "--lookup-max-ngram", "5", "--disable-by-batch-size", "3",
         "--adaptive-drafts"],
        SelfSpeculativeConfig(num_speculations=6, lookup=LookupDrafts(max_ngram=5), disable_by_batch_size=3,
                              adaptive=True)),
    "short": (["--exit-layer", "3"], SelfSpeculativeConfig(exit_layer=3)),
    "feature": (
        ["--draft", "feature", "--feature-head", "head.safetensors", "--num-speculations", "3",
         "--feature-max-length", "2", "--feature-stop-below", "0.1", "--feature-top-k", "2",
         "--feature-tree-nodes", "3", "--feature-dtype", "float32"],
        SelfSpeculativeConfig(num_speculations=3, feature=FeatureDrafts(head="head.safetensors", max_length=2,
                                                                         stop_below=0.1, top_k=2, tree_nodes=3,
                                                                         dtype="float32"))),
}


@pytest.mark.parametrize("flags, expected", list(FLAG_CONFIGS.values()), ids=list(FLAG_CONFIGS))
def test_flags_build_the_nested_config(flags, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CLI reads flat names without the deprecated keywords
        assert _parsed_config(*flags) == expected


def test_the_flag_sets_above_use_every_flag():
    used = {word for flags, _ in FLAG_CONFIGS.values() for word in flags if word.startswith("--")}
    assert {f.metadata["flag"] for _, f in walk(SelfSpeculativeConfig)} <= used


def test_each_flag_lands_on_its_field():
    """Every leaf's flag sets that field and nothing else (against the config the same flags build
    without it)."""
    from eecore.cli.speculative_flags import tree_of

    base = ["--draft", "hybrid", "--exit-layer", "2", "--num-speculations", "5", "--draft-layers", "separate",
            "--min-acceptance", "0.5"]
    values = {"--exit-layer": "3", "--num-speculations": "6", "--layer-speculations": "2",
              "--draft-threshold": "0.25", "--long-draft-acceptance": "0.75", "--exit-threshold": None,
              "--exit-measure": None,  # (a None default: FLAG_CONFIGS["exits"] sets it)
              "--min-acceptance": "0.125", "--probe-every": "32", "--draft-dtype": "float16", "--draft-top-k": "2",
              "--layer-disable-by-batch-size": "3", "--disable-by-batch-size": "7", "--lookup-min-ngram": "2",
              "--lookup-max-ngram": "6", "--hybrid-switch": "token", "--adaptive-drafts": "on",
              # feature drafts run alone, not beside `base`'s: FLAG_CONFIGS["feature"] sets these
              "--feature-head": None, "--feature-max-length": None, "--feature-stop-below": None,
              "--feature-top-k": None, "--feature-tree-nodes": None, "--feature-dtype": None}
    before = tree_of(_parsed_config(*base))
    for path, f in walk(SelfSpeculativeConfig):
        flag = f.metadata["flag"]
        assert flag in values, flag
        if values[flag] is None:  # set by FLAG_CONFIGS instead (exits, feature drafts)
            continue
        value = values[flag]
        after = tree_of(_parsed_config(*base, flag, value))
        node, want = after, before
        for part in path[:-1]:
            node, want = node[part], want[part]
        expected = value if f.metadata["choices"] else type(node[path[-1]])(value)
        assert node[path[-1]] == expected and node[path[-1]] != want[path[-1]], (flag, node, want)
        node[path[-1]] = want[path[-1]]
        assert after == before, flag  # nothing else moved


# ---- error messages: the class, the field and its flag -------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: SelfSpeculativeConfig(exit_layer=2, num_speculations=0),
     "SelfSpeculativeConfig: 'num_speculations' (--num-speculations) must be an int >= 1, got 0"),
    (lambda: SelfSpeculativeConfig(exit_layer=2, disable_by_batch_size=0),
     "SelfSpeculativeConfig: 'disable_by_batch_size' (--disable-by-batch-size) must be an int >= 1 or None, got 0"),
    (lambda: SelfSpeculativeConfig(exit_layer=2, lookup=LookupDrafts(), hybrid_switch="both"),
     "SelfSpeculativeConfig: 'hybrid_switch' (--hybrid-switch) must be one of round, token, got 'both'"),
    (lambda: SelfSpeculativeConfig(layer="E=2"), "SelfSpeculativeConfig: 'layer' must be a LayerDrafts or None, got 'E=2'"),
    (lambda: SelfSpeculativeConfig(lookup=True), "SelfSpeculativeConfig: 'lookup' must be a LookupDrafts or None, got True"),
    (lambda: LayerDrafts(exit_layer=0), "LayerDrafts: 'exit_layer' (--exit-layer) must be an int >= 1, got 0"),
    (lambda: LayerDrafts(exit_layer=2, max_length=0),
     "LayerDrafts: 'max_length' (--layer-speculations) must be an int >= 1 or None, got 0"),
    (lambda: LayerDrafts(exit_layer=2, stop_below=1.5),
     "LayerDrafts: 'stop_below' (--draft-threshold) must be a number in [0, 1] or None, got 1.5"),
    (lambda: LayerDrafts(exit_layer=2, long_draft_acceptance=-0.5),
     "LayerDrafts: 'long_draft_acceptance' (--long-draft-acceptance) must be a number in [0, 1] or None, got -0.5"),
    (lambda: LayerDrafts(exit_layer=2, exit_threshold=True),
     "LayerDrafts: 'exit_threshold' (--exit-threshold) must be a number in [0, 1] or None, got True"),
    (lambda: LayerDrafts(exit_layer=2, disable_by_batch_size=2.5),
     "LayerDrafts: 'disable_by_batch_size' (--layer-disable-by-batch-size) must be an int >= 1 or None, got 2.5"),
    (lambda: LayerDrafts(exit_layer=2, guard=0.5), "LayerDrafts: 'guard' must be an AcceptanceGuard or None, got 0.5"),
    (lambda: LayerDrafts(exit_layer=2, copy="int8"), "LayerDrafts: 'copy' must be a DraftCopy or None, got 'int8'"),
    (lambda: DraftCopy(dtype="int4"),
     "DraftCopy: 'dtype' (--draft-dtype) must be one of float32, bfloat16, float16, int8 or None, got 'int4'"),
    (lambda: DraftCopy(top_k=0), "DraftCopy: 'top_k' (--draft-top-k) must be an int >= 1, got 0"),
    (lambda: AcceptanceGuard(min_acceptance="auto"),
     "AcceptanceGuard: 'min_acceptance' (--min-acceptance) must be a number in [0, 1] or 'break-even', got 'auto'"),
    (lambda: AcceptanceGuard(probe_every=0), "AcceptanceGuard: 'probe_every' (--probe-every) must be an int >= 1, got 0"),
    (lambda: LookupDrafts(min_ngram=0), "LookupDrafts: 'min_ngram' (--lookup-min-ngram) must be an int >= 1, got 0"),
    (lambda: LookupDrafts(min_ngram=3, max_ngram=2),
     "LookupDrafts: 'max_ngram' (--lookup-max-ngram) must be an int >= min_ngram (3), got 2"),
])
def test_errors_name_the_class_field_and_flag(make, message):
    with pytest.raises(ValueError, match=escape(message)):
        make()


@pytest.mark.parametrize("flags, message", [
    (["--exit-layer", "2", "--draft-threshold", "1.5"],
     "LayerDrafts: 'stop_below' (--draft-threshold) must be a number in [0, 1] or None, got 1.5"),
    (["--exit-layer", "2", "--draft-layers", "separate", "--draft-top-k", "0"],
     "DraftCopy: 'top_k' (--draft-top-k) must be an int >= 1, got 0"),
    (["--exit-layer", "2", "--min-acceptance", "0.5", "--probe-every", "0"],
     "AcceptanceGuard: 'probe_every' (--probe-every) must be an int >= 1, got 0"),
    (["--exit-layer", "2", "--min-acceptance", "1.5"],
     "AcceptanceGuard: 'min_acceptance' (--min-acceptance) must be a number in [0, 1] or 'break-even', got 1.5"),
    (["--exit-layer", "0"], "LayerDrafts: 'exit_layer' (--exit-layer) must be an int >= 1, got 0"),
    (["--exit-layer", "2", "--exit-threshold", "2"],
     "LayerDrafts: 'exit_threshold' (--exit-threshold) must be a number in [0, 1] or None, got 2.0"),
    (["--draft", "lookup", "--lookup-min-ngram", "0"],
     "LookupDrafts: 'min_ngram' (--lookup-min-ngram) must be an int >= 1, got 0"),
    (["--exit-layer", "2", "--num-speculations", "0"],
     "SelfSpeculativeConfig: 'num_speculations' (--num-speculations) must be an int >= 1, got 0"),
    (["--exit-layer", "2", "--layer-disable-by-batch-size", "0"],
     "LayerDrafts: 'disable_by_batch_size' (--layer-disable-by-batch-size) must be an int >= 1 or None, got 0"),
    (["--exit-layer", "2", "--draft-dtype", "int8"],
     "SelfSpeculativeConfig: 'draft_dtype' applies to a draft copy (draft_layers='separate'), and this config has "
     "none"),
    (["--draft", "lookup", "--exit-threshold", "0.5"],
     "SelfSpeculativeConfig: 'exit_threshold' applies to layer drafts"),
    (["--exit-layer", "2", "--probe-every", "4"],
     "SelfSpeculativeConfig: 'probe_every' applies to the acceptance guard (min_acceptance), and this config has "
     "none"),
])
def test_flag_errors_are_messages_naming_the_field_and_flag(flags, message):
    with pytest.raises(SystemExit, match=escape(f"eecore: {message}")):
        _parsed_config(*flags)


# ---- the checks that span parts ------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: SelfSpeculativeConfig(num_speculations=4, layer=LayerDrafts(exit_layer=2, max_length=5)),
     "LayerDrafts: 'max_length' (--layer-speculations) must be at most num_speculations (4), got 5"),
    (lambda: SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, disable_by_batch_size=6), lookup=LookupDrafts(),
                                   disable_by_batch_size=4),
     "LayerDrafts: 'disable_by_batch_size' (--layer-disable-by-batch-size) must be at most the config's "
     "disable_by_batch_size (4), got 6"),
    (lambda: SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2), lookup=LookupDrafts(), hybrid_switch="token"),
     "SelfSpeculativeConfig: hybrid_switch='token' needs layer.copy=DraftCopy()"),
    (lambda: SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, copy=DraftCopy()), hybrid_switch="token"),
     "SelfSpeculativeConfig: hybrid_switch='token' picks between layer and lookup drafts, and this config has layer "
     "drafts only"),
    (lambda: SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, copy=DraftCopy(top_k=2)), lookup=LookupDrafts(),
                                   hybrid_switch="token"),
     "SelfSpeculativeConfig: hybrid_switch='token' does not combine with DraftCopy 'top_k' > 1 or LayerDrafts "
     "'exit_threshold'"),
    (lambda: SelfSpeculativeConfig(), "SelfSpeculativeConfig: drafts need a source"),
    (lambda: SelfSpeculativeConfig(num_speculations=6), "SelfSpeculativeConfig: drafts need a source"),
    (lambda: LayerDrafts(exit_layer=2, stop_below=0.5, exit_threshold=0.4),
     "LayerDrafts: 'exit_threshold' (--exit-threshold) must be at least stop_below (0.5)"),
    (lambda: LayerDrafts(exit_layer=2, exit_threshold=0.9, guard=AcceptanceGuard()),
     "LayerDrafts: 'guard' does not apply with 'exit_threshold'"),
    (lambda: LayerDrafts(exit_layer=2, exit_threshold=0.9, copy=DraftCopy(top_k=2)),
     "LayerDrafts: DraftCopy 'top_k' > 1 does not apply with 'exit_threshold'"),
    (lambda: SelfSpeculativeConfig(num_speculations=8, layer=LayerDrafts(exit_layer=2, copy=DraftCopy(top_k=8))),
     "fit a token tree"),
], ids=["max-length", "layer-batch-limit", "token-without-copy", "token-without-lookup", "token-tree",
        "no-source", "no-source-d", "exit-below-stop", "guard-with-exits", "tree-with-exits", "tree-too-wide"])
def test_cross_checks(make, message):
    with pytest.raises(ValueError, match=escape(message)):
        make()


def test_what_the_cross_checks_allow():
    """The boundaries of the checks above are valid configs."""
    SelfSpeculativeConfig(num_speculations=4, layer=LayerDrafts(exit_layer=2, max_length=4))
    SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, disable_by_batch_size=4), lookup=LookupDrafts(),
                          disable_by_batch_size=4)
    LayerDrafts(exit_layer=2, stop_below=0.5, exit_threshold=0.5)
    LayerDrafts(exit_layer=2, exit_threshold=0.9)  # exits with no stop threshold: drafts go to full length
    LayerDrafts(exit_layer=2, exit_threshold=0.9, copy=DraftCopy(dtype="int8"))


def test_properties():
    layer = SelfSpeculativeConfig(num_speculations=3, layer=LayerDrafts(exit_layer=2))
    assert (layer.draft, layer.exit_layer, layer.uses_layers, layer.uses_lookup, layer.separate_draft_layers,
            layer.top_k, layer.trusts_drafts, layer.layer_draft_length, layer.verify_width) == \
        ("layer", 2, True, False, False, 1, False, 3, 4)
    lookup = SelfSpeculativeConfig(num_speculations=5, lookup=LookupDrafts())
    assert (lookup.draft, lookup.exit_layer, lookup.uses_layers, lookup.uses_lookup, lookup.separate_draft_layers,
            lookup.top_k, lookup.trusts_drafts, lookup.layer_draft_length, lookup.verify_width) == \
        ("lookup", None, False, True, False, 1, False, 0, 6)
    tree = SelfSpeculativeConfig(num_speculations=5, lookup=LookupDrafts(),
                                 layer=LayerDrafts(exit_layer=2, max_length=2, copy=DraftCopy(top_k=4)))
    assert (tree.draft, tree.separate_draft_layers, tree.top_k, tree.layer_draft_length, tree.verify_width) == \
        ("hybrid", True, 4, 2, 1 + 2 * 4)
    exits = SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, stop_below=0.3, exit_threshold=0.8))
    assert exits.trusts_drafts and not layer.trusts_drafts


def test_batch_limits():
    """plain_above: the batch above which steps are plain full depth; layers_above: the batch above
    which only lookup drafts go on (hybrid only). A layer-only config's layer limit is a plain limit."""
    def limits(layer_limit=None, overall=None, lookup=False):
        config = SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, disable_by_batch_size=layer_limit),
                                       lookup=LookupDrafts() if lookup else None, disable_by_batch_size=overall)
        return config.plain_above, config.layers_above

    assert limits() == (None, None)
    assert limits(overall=4) == (4, None)
    assert limits(layer_limit=2) == (2, None)
    assert limits(layer_limit=2, overall=3) == (2, None)
    assert limits(lookup=True, overall=4) == (4, None)
    assert limits(layer_limit=2, overall=4, lookup=True) == (4, 2)
    assert limits(layer_limit=2, lookup=True) == (None, 2)
    lookup_only = SelfSpeculativeConfig(lookup=LookupDrafts(), disable_by_batch_size=3)
    assert (lookup_only.plain_above, lookup_only.layers_above) == (3, None)


def test_the_parts_are_plain_dataclasses():
    """Configs compare, copy and print by value, their parts included."""
    import copy

    config = SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=2, guard=AcceptanceGuard(), copy=DraftCopy()),
                                   lookup=LookupDrafts())
    assert all(is_dataclass(part) for part in (config, config.layer, config.layer.guard, config.layer.copy,
                                               config.lookup))
    twin = copy.deepcopy(config)
    assert twin == config and twin.layer is not config.layer
    twin.layer.guard.probe_every = 16
    assert twin != config
    assert "LayerDrafts(exit_layer=2" in repr(config) and "AcceptanceGuard(min_acceptance='break-even'" in repr(config)
