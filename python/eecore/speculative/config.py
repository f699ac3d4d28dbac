"""`SelfSpeculativeConfig`: where a self-speculation round's drafts come from, and how many.

    SelfSpeculativeConfig(layer=LayerDrafts(exit_layer=8))                       LayerSkip
    SelfSpeculativeConfig(lookup=LookupDrafts())                                 prompt lookup
    SelfSpeculativeConfig(layer=LayerDrafts(8, copy=DraftCopy("int8")), lookup=LookupDrafts(),
                          hybrid_switch="token")                                 both, per token
    SelfSpeculativeConfig(feature=FeatureDrafts(head="head.safetensors"))        a feature head
    SelfSpeculativeConfig(feature=FeatureDrafts(), lookup=LookupDrafts())         lookup, else the head
    SelfSpeculativeConfig.exit_ready("hybrid")                                   the tuned presets

The parts are in eecore.speculative.options; `exit_layer=E` is the short form of
`layer=LayerDrafts(exit_layer=E)`, the form docs/architecture.md gives. A config is changed with
`dataclasses.replace` (a preset too); the `eecore` command's flags name the same fields by flat
names (eecore.cli.speculative_flags).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eecore.engine.inputs import MAX_TREE_TOKENS
from eecore.models.exit_adapter import ExitAdapters
from eecore.speculative.options import (BREAK_EVEN, DRAFT_MODES, AcceptanceGuard, DraftCopy, FeatureDrafts,
                                        LayerDrafts, LookupDrafts, invalid, is_int, option)
from eecore.speculative.presets import exit_ready_preset

HYBRID_SWITCHES = ("round", "token")


@dataclass(init=False)
class SelfSpeculativeConfig:
    """Draft up to `num_speculations` tokens per sequence and round, from layer E (`layer`), from
    prompt lookup (`lookup`) or both, then verify them all with the full model in one pass. Greedy
    outputs are exactly the full model's and sampled outputs keep its law (speculative rejection
    sampling), unless `layer.exit_threshold` lets sure drafts exit unverified.

    hybrid_switch: with both sources, how a draft picks one.
      - "round": per sequence and round, a lookup draft when the sequence has a match, a layer
        draft (or a feature head's) otherwise.
      - "token": per drafted position. While the draft so far ends in an n-gram the sequence has
        seen, the draft goes on with that occurrence's continuation; where it does not, the copy
        drafts one token (at most `layer.max_length` copy passes a round), after which the lookup
        is tried again. Needs `layer.copy` (the copy runs the lookup tokens as rows of its next
        pass); not with draft trees or exits.

    disable_by_batch_size: speculation is off in any step that decodes more than this many
        sequences (vLLM's speculative_disable_by_batch_size). Verifying d + 1 rows costs what decoding
        one costs only while decoding is bound by reading the weights; in a large batch it is bound
        by arithmetic and every drafted row is paid in full. Such steps are plain full-depth steps,
        and may carry prompt chunks beside the decodes, as full depth does.

    adaptive: the lengths above are caps; each round, each sequence drafts as many tokens of each
        kind as pay at the pass costs measured while decoding and its running acceptance, none
        where drafts do not pay (eecore.speculative.draft_planner). What a verify row costs differs
        tenfold between weights and machines (an exact 4-bit kernel on a CPU is bound by arithmetic
        from the second row on; a GPU verifies a few rows for the price of one). Greedy outputs stay
        full depth's; a seeded sampled request does not draft (with drafts its tokens would follow
        the timings too), so its seed reproduces full depth's output. Layer drafts need a copy
        (LayerDrafts.copy: every round is then one full-depth verify pass), and exits
        (LayerDrafts.exit_threshold), whose output depends on the lengths, are refused.
    """

    num_speculations: int = option(4, "--num-speculations", "the most tokens a sequence drafts a round")
    layer: Optional[LayerDrafts] = option(None, "", "", nested=LayerDrafts)
    lookup: Optional[LookupDrafts] = option(None, "", "", nested=LookupDrafts)
    feature: Optional[FeatureDrafts] = option(None, "", "", nested=FeatureDrafts)
    hybrid_switch: str = option(
        "round", "--hybrid-switch", "--draft hybrid: pick the draft's source per round, or per drafted position "
        "(token: lookup while the draft ends in a match, layer E where it does not; --draft-layers separate)",
        choices=HYBRID_SWITCHES)
    disable_by_batch_size: Optional[int] = option(
        None, "--disable-by-batch-size", "run plain full-depth steps while more than N sequences decode: in a "
        "large batch verifying drafts costs arithmetic, not only weight reads (default: never)")
    adaptive: bool = option(
        False, "--adaptive-drafts", "choose each sequence's draft lengths per round from the passes' costs measured "
        "while decoding and its running acceptance, down to none where drafts do not pay "
        "(eecore.speculative.draft_planner)")

    def __init__(self, num_speculations: int = 4, layer: Optional[LayerDrafts] = None,
                 lookup: Optional[LookupDrafts] = None, hybrid_switch: str = "round",
                 disable_by_batch_size: Optional[int] = None, adaptive: bool = False,
                 feature: Optional[FeatureDrafts] = None, *, exit_layer: Optional[int] = None):
        if exit_layer is not None:
            if layer is not None:
                raise ValueError("SelfSpeculativeConfig: give 'exit_layer' (the short form) or 'layer', not both")
            layer = LayerDrafts(exit_layer=exit_layer)
        self.num_speculations, self.layer, self.lookup, self.feature = num_speculations, layer, lookup, feature
        self.hybrid_switch, self.disable_by_batch_size = hybrid_switch, disable_by_batch_size
        self.adaptive = adaptive
        self._check()

    @classmethod
    def exit_ready(cls, preset: str = "layer", device=None) -> "SelfSpeculativeConfig":
        """The embedded model's exit-ready self-speculation (eecore.speculative.presets): "layer"
        drafts with the shipped draft layers alone, "hybrid" with prompt lookup first. Use it with
        `LLM(exit_adapter=True)`, which loads those layers (CLI: `--exit-ready [layer|hybrid]`, whose
        other flags change the preset). `device`: the LLM's (None: LLM's default); the CPU presets
        draft with an int8 copy and stop at small batches, the GPU ones do not. Change a preset with
        `dataclasses.replace`, e.g. `replace(preset, layer=replace(preset.layer, stop_below=0.3))`."""
        return exit_ready_preset(cls, preset, device)

    def _check(self) -> None:
        if not is_int(self.num_speculations) or self.num_speculations < 1:
            raise invalid(SelfSpeculativeConfig, "num_speculations", "an int >= 1", self.num_speculations)
        if self.layer is not None and not isinstance(self.layer, LayerDrafts):
            raise invalid(SelfSpeculativeConfig, "layer", "a LayerDrafts or None", self.layer)
        if self.lookup is not None and not isinstance(self.lookup, LookupDrafts):
            raise invalid(SelfSpeculativeConfig, "lookup", "a LookupDrafts or None", self.lookup)
        if self.feature is not None:
            if not isinstance(self.feature, FeatureDrafts):
                raise invalid(SelfSpeculativeConfig, "feature", "a FeatureDrafts or None", self.feature)
            if self.layer is not None and (self.layer.copy is None or not self.adaptive or self.layer.guard is not None
                                           or self.layer.exit_threshold is not None):
                raise ValueError("SelfSpeculativeConfig: feature drafts beside layer drafts need the layers' copy "
                                 "(LayerDrafts.copy) and adaptive=True, which picks one source per sequence and "
                                 "round by their measured costs and acceptance, and no guard or exit_threshold "
                                 "(to change the exit-ready layer preset so, leave its head out: feature=None)")
            if self.feature.max_length is not None and self.feature.max_length > self.num_speculations:
                raise invalid(FeatureDrafts, "max_length", f"at most num_speculations ({self.num_speculations})",
                              self.feature.max_length)
            self._check_tree_width()
        elif self.layer is None and self.lookup is None:
            raise ValueError("SelfSpeculativeConfig: drafts need a source: layer=LayerDrafts(exit_layer=E) (or "
                             "exit_layer=E), lookup=LookupDrafts(), both, or feature=FeatureDrafts(head=...)")
        limit = self.disable_by_batch_size
        if limit is not None and (not is_int(limit) or limit < 1):
            raise invalid(SelfSpeculativeConfig, "disable_by_batch_size", "an int >= 1 or None", limit)
        if not isinstance(self.adaptive, bool):
            raise invalid(SelfSpeculativeConfig, "adaptive", "a bool", self.adaptive)
        if self.adaptive and self.layer is not None and self.layer.copy is None:
            raise ValueError("SelfSpeculativeConfig: 'adaptive' prices rounds of full-depth verify passes; layer drafts "
                             "from the model's own layers verify from the exit-query cache, which it does not model: "
                             "give LayerDrafts a copy (DraftCopy()), or use lookup drafts alone")
        if self.adaptive and self.trusts_drafts:
            raise ValueError("SelfSpeculativeConfig: 'adaptive' does not combine with LayerDrafts 'exit_threshold': "
                             "which drafts exit depends on the chain lengths, and the output would then depend on "
                             "the machine's timings (--adaptive-drafts off)")
        if self.layer is not None:
            self._check_layer_drafts(self.layer)
        if self.hybrid_switch not in HYBRID_SWITCHES:
            raise invalid(SelfSpeculativeConfig, "hybrid_switch", f"one of {', '.join(HYBRID_SWITCHES)}",
                          self.hybrid_switch)
        if self.hybrid_switch != "round" and self.draft != "hybrid":
            raise ValueError(f"SelfSpeculativeConfig: hybrid_switch={self.hybrid_switch!r} picks between layer and "
                             f"lookup drafts, and this config has {self.draft} drafts only")
        if self.switches_per_token:
            if self.layer.copy is None:
                raise ValueError("SelfSpeculativeConfig: hybrid_switch='token' needs layer.copy=DraftCopy() (the "
                                 "copy runs a draft's lookup tokens before drafting after them)")
            if self.top_k > 1 or self.trusts_drafts:
                raise ValueError("SelfSpeculativeConfig: hybrid_switch='token' does not combine with DraftCopy "
                                 "'top_k' > 1 or LayerDrafts 'exit_threshold'")

    def _check_layer_drafts(self, layer: LayerDrafts) -> None:
        """What a LayerDrafts can only check against the rest of the config."""
        if layer.max_length is not None and layer.max_length > self.num_speculations:
            raise invalid(LayerDrafts, "max_length", f"at most num_speculations ({self.num_speculations})",
                          layer.max_length)
        limit = self.disable_by_batch_size
        if layer.disable_by_batch_size is not None and limit is not None and layer.disable_by_batch_size > limit:
            raise invalid(LayerDrafts, "disable_by_batch_size",
                          f"at most the config's disable_by_batch_size ({limit})", layer.disable_by_batch_size)
        self._check_tree_width()

    def _check_tree_width(self) -> None:
        if max(self.top_k, self.feature_top_k) > 1 and self.verify_width > MAX_TREE_TOKENS:
            raise ValueError(f"SelfSpeculativeConfig: a round verifies 1 + draft length x top_k = "
                             f"{self.verify_width} tokens per sequence; at most {MAX_TREE_TOKENS} fit a token tree")

    @property
    def draft(self) -> str:
        """The draft sources by name: "layer", "lookup", "hybrid" or "feature" (a feature head alone;
        beside layer drafts, "layer")."""
        if self.feature is not None and self.layer is None:
            return "feature"
        if self.layer is not None and self.lookup is not None:
            return "hybrid"
        return "layer" if self.layer is not None else "lookup"

    @property
    def uses_layers(self) -> bool:
        return self.layer is not None

    @property
    def uses_lookup(self) -> bool:
        return self.lookup is not None

    @property
    def uses_feature(self) -> bool:
        return self.feature is not None

    @property
    def exit_layer(self) -> Optional[int]:
        """The draft depth E (None: lookup drafts only)."""
        return None if self.layer is None else self.layer.exit_layer

    @property
    def switches_per_token(self) -> bool:
        return self.hybrid_switch == "token"

    @property
    def separate_draft_layers(self) -> bool:
        return self.layer is not None and self.layer.copy is not None

    @property
    def top_k(self) -> int:
        """Tokens verified per layer-drafted position (DraftCopy.top_k; 1 without a copy)."""
        return self.layer.copy.top_k if self.separate_draft_layers else 1

    @property
    def feature_top_k(self) -> int:
        """Tokens verified per feature-drafted position (FeatureDrafts.top_k; 1 without a head)."""
        return self.feature.top_k if self.feature is not None else 1

    @property
    def trusts_drafts(self) -> bool:
        """Whether sure layer drafts are emitted unverified (LayerDrafts.exit_threshold)."""
        return self.layer is not None and self.layer.exit_threshold is not None

    @property
    def layer_draft_length(self) -> int:
        """The longest draft layer E makes."""
        return self._length(self.layer)

    @property
    def feature_draft_length(self) -> int:
        """The longest draft the feature head makes."""
        return self._length(self.feature)

    def _length(self, drafts) -> int:
        return min(drafts.max_length or self.num_speculations, self.num_speculations) if drafts else 0

    @property
    def plain_above(self) -> Optional[int]:
        """The batch size above which steps are plain full-depth steps (None: never)."""
        layer_limit = None if self.layer is None else self.layer.disable_by_batch_size
        if self.lookup is None and layer_limit is not None:  # no other drafts to go on with
            return layer_limit if self.disable_by_batch_size is None else min(layer_limit, self.disable_by_batch_size)
        return self.disable_by_batch_size

    @property
    def layers_above(self) -> Optional[int]:
        """The batch size above which lookup drafts go on alone (None: layer drafts never stop first)."""
        return self.layer.disable_by_batch_size if self.draft == "hybrid" else None

    @property
    def verify_width(self) -> int:
        """The most tokens a sequence's verify pass holds: its pending token and the drafts (with
        draft trees, the alternatives of each drafted position too)."""
        return 1 + max(self.num_speculations if self.lookup else 0, self.layer_draft_length * self.top_k,
                       self.feature_tree_nodes(self.feature_draft_length))

    def feature_tree_nodes(self, positions: int) -> int:
        """The most tokens a feature draft of `positions` positions verifies: positions x
        FeatureDrafts.top_k, at most FeatureDrafts.tree_nodes."""
        nodes = positions * self.feature_top_k
        cap = self.feature.tree_nodes if self.feature is not None else None
        return nodes if cap is None else min(nodes, cap)

    def validate_for(self, num_layers: int, adapters: Optional[ExitAdapters] = None) -> None:
        if self.layer is None:
            return
        if self.exit_layer >= num_layers:
            raise ValueError(f"LayerDrafts: 'exit_layer' must be below the model's {num_layers} layers, "
                             f"got {self.exit_layer}")
        if adapters is not None and adapters.blocks and self.exit_layer not in adapters.blocks:
            raise ValueError(f"LayerDrafts: 'exit_layer' {self.exit_layer} has no exit adapter; the loaded "
                             f"adapters cover exit layers {adapters.exit_layers()}")


__all__ = ["SelfSpeculativeConfig", "LayerDrafts", "LookupDrafts", "DraftCopy", "AcceptanceGuard", "FeatureDrafts",
           "BREAK_EVEN", "DRAFT_MODES"]
