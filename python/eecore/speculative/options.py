"""The parts of a `SelfSpeculativeConfig`, one small dataclass per topic:

    LayerDrafts      drafts from layers 0..E-1 (LayerSkip): their depth, length, stops and batch limit
      DraftCopy      ... run by a copy of those layers with a KV cache of its own
      AcceptanceGuard ... switched off for sequences whose drafts are rejected too often
    LookupDrafts     drafts from prompt lookup (n-gram matches in the sequence itself)

Each field is meaningful wherever it can be set: an option that only applies to a copy lives in
`DraftCopy`, one that only applies to layer drafts in `LayerDrafts`, and so on. Every field names
its command-line flag in its metadata (`option`), from which the `eecore` command's flags are derived
(eecore.cli.speculative_flags).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Optional, Union

BREAK_EVEN = "break-even"  # AcceptanceGuard.min_acceptance: the bandwidth-bound break-even for E and d
DRAFT_DTYPES = ("float32", "bfloat16", "float16", "int8")
FEATURE_DTYPES = ("int8", "float32")
DRAFT_MODES = ("layer", "lookup", "hybrid", "feature")  # which of SelfSpeculativeConfig's draft sources there are


def option(default, flag: str, help: str, nested: Optional[type] = None, choices=None):
    """A config field with its command-line flag (`--flag`, whose underscored name is also the
    field's name in eecore.cli.speculative_flags) and help; `nested`: the field holds that dataclass."""
    return field(default=default, metadata={"flag": flag, "help": help, "nested": nested, "choices": choices})


def flag_of(cls, name: str) -> str:
    for f in fields(cls):
        if f.name == name and f.metadata.get("flag"):
            return f" ({f.metadata['flag']})"
    return ""


def invalid(cls, name: str, expected: str, got) -> ValueError:
    """The error for a bad field: the class, the field and its flag, what was expected, what came."""
    return ValueError(f"{cls.__name__}: '{name}'{flag_of(cls, name)} must be {expected}, got {got!r}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_probability(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0


@dataclass
class DraftCopy:
    """Layer drafts run a copy of layers 0..E-1 with a KV cache of its own (E more layers of the same
    paged blocks), and verification runs all L layers over the drafted positions in one varlen pass.
    The copy may differ from the model and only the drafts see it: an exit-ready file's LoRA pairs
    change the copy alone (full depth stays the original model bit for bit), and the copy may run in
    a cheaper dtype. Without a copy, drafts run the model's own layers and write the shared KV cache,
    and verification continues from the exit-query cache through layers E..L-1 (LayerSkip)."""

    dtype: Optional[str] = option(
        None, "--draft-dtype", "the copy's dtype (default: the model's); int8: 8-bit projections, exit adapter "
        "and draft head (per-row int8, or Q8_0 blocks with 8-bit activations where that kernel is "
        "vectorized: eecore.models.int8_weights.eight_bit), activations in the model's dtype", choices=DRAFT_DTYPES)
    top_k: int = option(
        1, "--draft-top-k", "verify K tokens at each drafted position at once (the chain and K-1 alternatives, "
        "a token tree): a greedy request's K most likely, a sampled request's K independent draws from the "
        "copy's distribution, tried in turn by rejection sampling; a round may emit one more token")

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in DRAFT_DTYPES:
            raise invalid(DraftCopy, "dtype", f"one of {', '.join(DRAFT_DTYPES)} or None", self.dtype)
        if not is_int(self.top_k) or self.top_k < 1:
            raise invalid(DraftCopy, "top_k", "an int >= 1", self.top_k)


@dataclass
class AcceptanceGuard:
    """A sequence whose running acceptance rate falls below `min_acceptance` stops drafting with the
    layers, so its rounds cost what a full-depth step costs; it drafts again only in probe rounds, at
    most one per `probe_every` rounds (the wait doubling while they fail, up to 128) and only when a
    near-free check says the probe could pass (eecore.speculative.guard)."""

    min_acceptance: Union[float, str] = option(
        BREAK_EVEN, "--min-acceptance", "stop drafting for a sequence whose running acceptance rate falls below "
        "this (a number, or 'break-even': the model's bandwidth-bound break-even for E and d)")
    probe_every: int = option(8, "--probe-every", "the fewest rounds between a guarded sequence's probe rounds")

    def __post_init__(self):
        if self.min_acceptance != BREAK_EVEN and not is_probability(self.min_acceptance):
            raise invalid(AcceptanceGuard, "min_acceptance", f"a number in [0, 1] or {BREAK_EVEN!r}",
                          self.min_acceptance)
        if not is_int(self.probe_every) or self.probe_every < 1:
            raise invalid(AcceptanceGuard, "probe_every", "an int >= 1", self.probe_every)


@dataclass
class LayerDrafts:
    """Drafts from layers 0..exit_layer-1 and the LM head (or the exit adapter and draft vocabulary,
    eecore.models.exit_adapter), verified by the full model (LayerSkip §4.3).

    max_length: the longest layer draft (default: the config's num_speculations). With prompt lookup
        too, the two kinds pay at different lengths: a wrong lookup token costs one verify row, a
        wrong layer token E layers and a draft head.
    stop_below: a sequence stops drafting once its draft's top-1 probability falls below this.
    long_draft_acceptance: while the running rate at which a sequence's first layer draft of a round
        is accepted is below this value, its chain goes past that draft only when the draft is at
        least this sure (eecore.speculative.draft_length).
    exit_threshold: dynamic early exit with deferred K/V (FREE, Bae et al. 2023). A round's leading
        drafts at least this sure are emitted unverified, as exits at layer E; the round's full-depth
        pass decodes the first doubtful position and computes the exact K/V of the exited positions in
        every layer, so later tokens attend to what the full model would have written. Drafts after
        the exits are verified as usual. The output is no longer exactly the full model's (`eecore
        eval` measures how far it moves). Not with a guard or draft trees; lookup drafts stay verified.
    exit_measure: what stop_below, exit_threshold and long_draft_acceptance compare with: None, the
        draft's top-1 probability; "agreement" (or a model file's path), the probability that full
        depth emits the draft's token, from the draft's distribution and whether prompt lookup agrees
        (eecore.speculative.exit_decision).
    guard: stop drafting for sequences whose drafts are rejected too often (AcceptanceGuard).
    copy: draft with a copy of the layers (DraftCopy) instead of the model's own.
    disable_by_batch_size: layer drafts stop in any step that decodes more than this many sequences
        (lookup drafts go on): a layer draft costs passes of E layers, a lookup draft only its verify
        rows.
    """

    exit_layer: int = option(MISSING, "--exit-layer", "the draft depth E: drafts run layers 0..E-1")
    max_length: Optional[int] = option(
        None, "--layer-speculations", "the longest layer draft (default: --num-speculations)")
    stop_below: Optional[float] = option(
        None, "--draft-threshold", "a sequence stops drafting once its draft's top-1 probability falls below this")
    long_draft_acceptance: Optional[float] = option(
        None, "--long-draft-acceptance", "while a sequence's first layer drafts are accepted less often than A, "
        "its chain goes past the first draft only if that draft is at least A sure (0 turns it off)")
    exit_threshold: Optional[float] = option(
        None, "--exit-threshold", "emit a round's leading drafts at least this sure unverified, as exits at layer E "
        "(dynamic early exit; the next full-depth pass computes their exact K/V; lossy)")
    exit_measure: Optional[str] = option(
        None, "--exit-measure", "what --draft-threshold, --exit-threshold and --long-draft-acceptance compare with: "
        "the draft's top-1 probability (default), or 'agreement': the probability that full depth agrees, "
        "learned from the draft's distribution and prompt lookup (eecore.speculative.exit_decision; the "
        "shipped model, for the shipped draft layers), or the path of such a model's file")
    guard: Optional[AcceptanceGuard] = option(None, "", "", nested=AcceptanceGuard)
    copy: Optional[DraftCopy] = option(None, "", "", nested=DraftCopy)
    disable_by_batch_size: Optional[int] = option(
        None, "--layer-disable-by-batch-size", "layer drafts stop while more than N sequences decode (lookup "
        "drafts go on, up to --disable-by-batch-size)")

    def __post_init__(self):
        if not is_int(self.exit_layer) or self.exit_layer < 1:
            raise invalid(LayerDrafts, "exit_layer", "an int >= 1", self.exit_layer)
        if self.max_length is not None and (not is_int(self.max_length) or self.max_length < 1):
            raise invalid(LayerDrafts, "max_length", "an int >= 1 or None", self.max_length)
        for name in ("stop_below", "long_draft_acceptance", "exit_threshold"):
            value = getattr(self, name)
            if value is not None and not is_probability(value):
                raise invalid(LayerDrafts, name, "a number in [0, 1] or None", value)
        if self.exit_threshold is not None and self.stop_below is not None and self.exit_threshold < self.stop_below:
            raise invalid(LayerDrafts, "exit_threshold", f"at least stop_below ({self.stop_below}): a draft below "
                          f"stop_below is dropped before it could exit", self.exit_threshold)
        if self.exit_measure is not None and (not isinstance(self.exit_measure, str) or not (
                self.exit_measure == "agreement" or self.exit_measure.endswith(".json"))):
            raise invalid(LayerDrafts, "exit_measure", "None, 'agreement' or the path of an exit decision file "
                          "(.json)", self.exit_measure)
        if self.guard is not None and not isinstance(self.guard, AcceptanceGuard):
            raise invalid(LayerDrafts, "guard", "an AcceptanceGuard or None", self.guard)
        if self.copy is not None and not isinstance(self.copy, DraftCopy):
            raise invalid(LayerDrafts, "copy", "a DraftCopy or None", self.copy)
        if self.exit_threshold is not None and self.guard is not None:
            raise ValueError("LayerDrafts: 'guard' does not apply with 'exit_threshold' (exits are never rejected, "
                             "so there is no acceptance to guard)")
        if self.exit_threshold is not None and self.copy is not None and self.copy.top_k > 1:
            raise ValueError("LayerDrafts: DraftCopy 'top_k' > 1 does not apply with 'exit_threshold' (exits are "
                             "emitted as drafted; no alternative is chosen)")
        if self.disable_by_batch_size is not None and (not is_int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 1):
            raise invalid(LayerDrafts, "disable_by_batch_size", "an int >= 1 or None", self.disable_by_batch_size)


@dataclass
class LookupDrafts:
    """Prompt lookup (vLLM's `ngram`): a sequence drafts the tokens that followed the most recent
    earlier occurrence of its last n tokens in its prompt and output so far, trying n from max_ngram
    down to min_ngram. No layer runs for a draft, so a wrong one costs only its verify rows."""

    min_ngram: int = option(1, "--lookup-min-ngram", "the shortest n-gram prompt lookup matches")
    max_ngram: int = option(3, "--lookup-max-ngram", "the longest n-gram prompt lookup matches, tried first")

    def __post_init__(self):
        if not is_int(self.min_ngram) or self.min_ngram < 1:
            raise invalid(LookupDrafts, "min_ngram", "an int >= 1", self.min_ngram)
        if not is_int(self.max_ngram) or self.max_ngram < self.min_ngram:
            raise invalid(LookupDrafts, "max_ngram", f"an int >= min_ngram ({self.min_ngram})", self.max_ngram)


@dataclass
class FeatureDrafts:
    """Drafts from a feature head (eecore.models.feature_head, trained with eecore.train.feature_head):
    one decoder layer that reads the target's own hidden states at the last verified position and
    drafts from there, each draft from its own state. The verify pass runs every layer and keeps
    the tapped states of each sequence's last accepted position for the next round."""

    head: Optional[str] = option(None, "--feature-head", "the feature head file (.safetensors, made by "
                                 "python -m eecore.train.feature_head for this model; default: the head "
                                 "shipped for the embedded SmolLM2-135M-Instruct)")
    max_length: Optional[int] = option(None, "--feature-max-length",
                                       "the most tokens a feature draft holds (default: --num-speculations)")
    stop_below: Optional[float] = option(None, "--feature-stop-below",
                                         "end a feature draft at a token whose top-1 probability is below this")
    top_k: int = option(1, "--feature-top-k", "a token tree of K tokens a drafted position (d positions "
                        "verify d x K): for a greedy request the d x K most likely of the chain and each "
                        "position's K runners-up by the head's probabilities, for a sampled one the chain and "
                        "K-1 more draws a position, as DraftCopy.top_k")
    tree_nodes: Optional[int] = option(None, "--feature-tree-nodes",
                                       "with top_k > 1, the most tokens a tree verifies (default: drafted "
                                       "positions x top_k); below max_length x top_k, a sure chain drafts "
                                       "deeper on the same rows")
    dtype: Optional[str] = option(None, "--feature-dtype", "the head's weights and LM head rows as it drafts: "
                                  "int8 (8-bit, a quarter of fp32's bytes: eecore.models.int8_weights.eight_bit) or "
                                  "float32 (as trained); default: int8 on a CPU, float32 on a GPU (where int8 weights "
                                  "are widened on every call); its activations are fp32 either way",
                                  choices=FEATURE_DTYPES)
    exit_threshold = None  # (what DraftPicker reads of a draft source: feature drafts never exit unverified)

    def __post_init__(self):
        if self.head is not None and (not isinstance(self.head, str) or not self.head):
            raise invalid(FeatureDrafts, "head", "the path of a feature head file, or None (the shipped head)",
                          self.head)
        if self.max_length is not None and (not is_int(self.max_length) or self.max_length < 1):
            raise invalid(FeatureDrafts, "max_length", "an int >= 1 or None", self.max_length)
        if self.stop_below is not None and not is_probability(self.stop_below):
            raise invalid(FeatureDrafts, "stop_below", "a probability in [0, 1] or None", self.stop_below)
        if not is_int(self.top_k) or self.top_k < 1:
            raise invalid(FeatureDrafts, "top_k", "an int >= 1", self.top_k)
        if self.tree_nodes is not None and (not is_int(self.tree_nodes) or self.tree_nodes < self.top_k or
                                            self.top_k == 1):
            raise invalid(FeatureDrafts, "tree_nodes", "None, or with 'top_k' > 1 an int >= top_k", self.tree_nodes)
        if self.dtype is not None and self.dtype not in FEATURE_DTYPES:
            raise invalid(FeatureDrafts, "dtype", f"one of {', '.join(FEATURE_DTYPES)} or None", self.dtype)
