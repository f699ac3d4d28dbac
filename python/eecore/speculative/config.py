"""`SelfSpeculativeConfig`: what a self-speculation round drafts, and how much of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from eecore.engine.inputs import MAX_TREE_TOKENS
from eecore.models.exit_adapter import ExitAdapters
from eecore.speculative.presets import exit_ready_settings

BREAK_EVEN = "break-even"  # min_acceptance: the model's bandwidth-bound break-even for E and d
DRAFT_MODES = ("layer", "lookup", "hybrid")
DRAFT_LAYERS = ("shared", "separate")
DRAFT_DTYPES = ("float32", "bfloat16", "float16", "int8")
ACCEPT_MODES = ("verified", "confident")
HYBRID_SWITCHES = ("round", "token")


@dataclass
class SelfSpeculativeConfig:
    """Draft up to `num_speculations` tokens per sequence and round, then verify them all with the
    full model in one pass. Greedy outputs are exactly the full model's; sampled outputs keep its
    law (speculative rejection sampling).

    draft: where drafts come from.
      - "layer" (LayerSkip): layers 0..exit_layer-1 and the LM head (or the exit adapter and draft
        vocabulary, see eecore.models.exit_adapter). Verification continues from the exit-query
        cache through layers exit_layer..L-1.
      - "lookup" (prompt lookup, vLLM's `ngram`): a sequence drafts the tokens that followed the most
        recent earlier occurrence of its last n tokens in its prompt and output so far, trying n
        from lookup_max_ngram down to lookup_min_ngram. No layer runs for a draft; a sequence with
        no match decodes one token at full depth. `exit_layer` is not used and may be None (any
        valid value is accepted and ignored).
      - "hybrid": lookup drafts where there is a match, layer-E drafts elsewhere (so `exit_layer` is
        required), switched as `hybrid_switch` says.

    hybrid_switch: how a hybrid draft picks its source.
      - "round" (the default): per sequence and round, a lookup draft when the sequence has a
        match, a layer-E draft otherwise.
      - "token": per drafted position. While the draft so far (appended to the sequence) ends in
        an n-gram the sequence has seen, the draft goes on with that occurrence's continuation;
        where it does not, the copy drafts one token (at most `layer_speculations` copy passes a
        round, each stopped by `draft_threshold`), after which the lookup is tried again. A layer
        token can so open a match that the round's start had none of, and a lookup run can be
        continued by the layers. draft_layers="separate" only (the copy runs the lookup tokens as
        rows of its next pass); not with draft_top_k > 1 or accept="confident". Pays with
        lookup_min_ngram=2: one-token matches are right too rarely to take the place of a layer
        draft (the exit-ready "hybrid" preset).

    layer_speculations: hybrid only: the longest layer-E draft (default: num_speculations, which
        then bounds the lookup drafts alone). The two kinds pay at different lengths: a wrong
        lookup token costs one verify row, a wrong layer token E layers and a draft head. On
        SmolLM2-135M with its shipped exit adapters, lookup drafts pay at d=4 and layer-8 drafts
        only at d=1 (bench/prompt_lookup_vs_economize.py --layer-speculations).

    lookup_min_ngram, lookup_max_ngram: the n-gram sizes the lookup tries (1 <= min <= max). The
    defaults (1, 3) come from `bench/prompt_lookup_vs_economize.py --sweep-ngrams` (SmolLM2-135M,
    8 held-out code prompts, 64 greedy tokens, d=4): min 1 emits 2.13 tokens per verify round,
    min 2 1.90 and min 3 1.67: single-token matches are right often enough (39% of all drafted
    tokens are accepted) and a wrong draft costs only verify rows; max 2, 3 and 4 are within 0.01
    of each other at d=4, and 3 and 4 gain a little over 2 at d >= 6.

    disable_by_batch_size: speculation is off in any step that decodes more than this many
    sequences (vLLM's speculative_disable_by_batch_size; None: never off). Verifying d + 1 rows
    costs what decoding 1 costs only while decoding is bound by reading the weights; in a large
    batch it is bound by arithmetic, and every drafted row, accepted or not, is paid in full, so
    rounds that draft run slower than plain steps (SmolLM2-135M on 2 CPU cores: lookup drafts ran
    1.44x / 1.27x / 1.10x / 0.88x full depth at batch 1 / 2 / 4 / 8). Such steps are plain full-depth steps, and they may carry prompt
    chunks beside the decodes (mixed steps), as full depth does.

    layer_disable_by_batch_size: hybrid only: layer drafts stop in any step that decodes more than
    this many sequences, while lookup drafts go on (up to disable_by_batch_size). A layer draft
    costs passes of E layers; a lookup draft costs only its verify rows, which on a CPU with AMX
    are nearly free in bf16: lookup drafts alone ran 1.15-1.17x full depth at batch 8 there (bf16
    SmolLM2, continuous batching), 0.98-1.00x in fp32 (bench/self_speculation.py --requests).

    draft_threshold: adaptive draft length for layer drafts (off by default). A sequence stops
    drafting early once the top-1 probability of its draft falls below this value.

    long_draft_acceptance: adaptive draft length per sequence, for layer drafts (off by default).
    While the running rate at which a sequence's first layer draft of a round is accepted is below
    this value, its chain goes past that first draft only when the draft is at least this sure
    (top-1 probability); else the round verifies the one draft. Where a draft's confidence cannot be
    trusted (the exit-ready copy of SmolLM2, trained on code, on chat) long chains cost more copy
    passes than they bring; one draft a round still pays. See eecore.speculative.draft_length; the
    exit-ready presets use 0.5.

    draft_layers: how layer drafts run layers 0..exit_layer-1.
      - "shared" (LayerSkip, the default): they are the model's own layers, writing the shared KV
        cache, and verification continues from the exit-query cache through layers E..L-1.
      - "separate": a copy of layers 0..E-1 of their own, with a KV cache of their own (E more
        layers of the same paged blocks), drafts; verification runs all L layers of the model
        over the drafted positions in one varlen pass, as for lookup drafts. Two things follow:
        the copy may differ from the model, and only the drafts see the difference. An exit-ready
        file's LoRA pairs (eecore.train.exit_ready) then change the copy alone, so full depth stays
        the original model bit for bit while the drafts get the trained early layers; and the copy
        may run in a cheaper dtype (`draft_dtype`). A round reads the same weight bytes as a shared
        one at equal dtype (d draft passes of E layers plus L layers, against d + 1 passes of E
        layers plus L - E), and the copy's cache must catch up on tokens it has not seen (the
        prompt, at a sequence's first layer-draft round: E/L of a prefill). The guard has no
        shadow check here: its probes draft for real.
    draft_dtype: "separate" only: the dtype of the draft copy (default: the model's). "bfloat16"
        halves a float32 model's draft bytes; "int8" stores its projections, exit adapter and draft
        head as weight-only int8 (one fp32 scale per output row, activations in the model's dtype:
        eecore.models.int8_weights), half of bf16's bytes. Verification keeps the model's dtype, so
        outputs are unchanged; only how often the drafts are accepted moves.

    draft_top_k: "separate" only: a layer draft proposes, at each drafted position, its top-1 token
        (the chain the next draft pass continues from) and draft_top_k - 1 alternatives, the next
        most likely tokens; the verify pass checks this token tree at once (1 + d x draft_top_k
        rows per sequence, siblings masked from each other). When the model disagrees with the
        chain at position i, an alternative at i that it agrees with is accepted too (its verify
        row gives the next token), so a round emits up to one more token. Worth it where verify
        rows are nearly free (a bandwidth-bound batch of one or a few): SmolLM2's earlier, rank-8
        draft file at exit 8 has top-1 / top-3 agreement 0.50 / 0.69 with the model on held-out code,
        but on 2 CPU cores verify rows are not free (4 rows cost 1.05x a one-row step, 9 rows
        1.36x: bench/verify_row_cost.py), and k = 3 ran at the speed of k = 1 (1.2x full depth).
        Greedy requests only: a sampled request's round verifies its chain alone (rejection
        sampling keeps the model's law for one proposal per position).

    accept: what becomes of a layer draft.
      - "verified" (the default): the full model checks it, as above; the output is the model's.
      - "confident": dynamic early exit with deferred K/V (FREE, Bae et al. 2023: "synchronized
        parallel decoding"). A layer draft whose top-1 probability is at least `draft_threshold`
        is emitted as it is: the token exits at layer E, and its output entry says so
        (`exit_layers`). The first doubtful draft ends the run of exits, and that position is
        decoded at full depth by the round's full-depth pass, which also computes the exact K/V
        of the exited positions in every layer (one varlen pass, as verification does). So later
        tokens attend to the states the full model would have written for the emitted tokens,
        not to a KV fill's copies, and an exited token costs E layers (of the draft copy, with
        `draft_layers="separate"`) plus a row of the next full-depth pass. Only the last row of
        that pass goes through the LM head. The output is no longer the full model's: `eecore eval
        --speculate --accept confident` (or bench/self_speculation.py --accept confident)
        measures how far it moves, as ROUGE-L to full depth and the early-exit rate. Needs
        `draft_threshold`; lookup drafts (hybrid) are still verified; not with
        `min_acceptance` or `draft_top_k` > 1.

    exit_threshold: accept="confident" only; default `draft_threshold`. Splits the two jobs of that
        threshold: a layer draft at least `exit_threshold` sure is emitted unchecked (an early exit at
        layer E) while it leads the round's chain; drafting goes on while drafts are at least
        `draft_threshold` sure, and the drafts after the leading exits are verified by the same
        full-depth pass (accepted while the model agrees, then the model's own token). Every token is
        then an exit at least `exit_threshold` sure or the full model's, and a round carries more
        tokens than exits alone give (where the seed's early exit decodes the doubtful token at full
        depth by itself, speculative verification does it for several at once).

    min_acceptance: the speculation guard for layer drafts (off by default): a sequence whose
    running acceptance rate falls below this value stops drafting with the layers, so its rounds
    cost what a full-depth step costs, and drafts again only in probe rounds, at most one per
    `probe_every` rounds (the wait doubling while they fail, up to 128) and only when a near-free
    check says the probe could pass. "break-even" sets it to the acceptance below which drafting
    loses when decoding is bound by reading weights, computed from the model's sizes, E and d. See
    eecore.speculative.guard. Lookup drafts are not gated by it: they read no weights of their
    own, so their bandwidth-bound break-even is 0 (see SelfSpeculativeDecoder).
    """

    exit_layer: Optional[int] = None
    num_speculations: int = 4
    draft_threshold: Optional[float] = None
    long_draft_acceptance: Optional[float] = None
    min_acceptance: Optional[Union[float, str]] = None
    probe_every: int = 8
    draft: str = "layer"
    layer_speculations: Optional[int] = None
    lookup_min_ngram: int = 1
    lookup_max_ngram: int = 3
    disable_by_batch_size: Optional[int] = None
    layer_disable_by_batch_size: Optional[int] = None
    draft_layers: str = "shared"
    draft_dtype: Optional[str] = None
    draft_top_k: int = 1
    accept: str = "verified"
    exit_threshold: Optional[float] = None
    hybrid_switch: str = "round"

    @classmethod
    def exit_ready(cls, preset: str = "layer", **overrides) -> "SelfSpeculativeConfig":
        """The embedded model's exit-ready self-speculation (eecore.speculative.presets): "layer" drafts with
        the shipped draft layers alone, "hybrid" with prompt lookup first. Use it with
        `LLM(exit_adapter=True)`, which loads those layers (CLI: `--exit-ready [layer|hybrid]`).
        `overrides` replace any of its fields."""
        settings = exit_ready_settings(preset, overrides)
        return cls(**{**settings, **overrides})

    def __post_init__(self):
        # in this order, so that the first problem named is the same whatever else is wrong
        self._check_draft_source()
        self._check_draft_stops()
        self._check_batch_limits()
        self._check_draft_layers()
        self._check_acceptance()
        self._check_hybrid()

    def _check_draft_source(self) -> None:
        """The draft source, the exit layer and the draft lengths."""
        if self.draft not in DRAFT_MODES:
            raise ValueError(f"SelfSpeculativeConfig: 'draft' must be one of {', '.join(DRAFT_MODES)}, "
                             f"got {self.draft!r}")
        if self.exit_layer is None:
            if self.uses_layers:
                raise ValueError(f"SelfSpeculativeConfig: 'exit_layer' is required with draft={self.draft!r} "
                                 f"(only draft='lookup' runs without one)")
        elif not _is_int(self.exit_layer) or self.exit_layer < 1:
            raise ValueError(f"SelfSpeculativeConfig: 'exit_layer' must be an int >= 1, got {self.exit_layer!r}")
        if not _is_int(self.num_speculations) or self.num_speculations < 1:
            raise ValueError(f"SelfSpeculativeConfig: 'num_speculations' must be an int >= 1, "
                             f"got {self.num_speculations!r}")
        if self.layer_speculations is not None:
            if self.draft != "hybrid":
                raise ValueError(f"SelfSpeculativeConfig: 'layer_speculations' applies to draft='hybrid' only "
                                 f"(draft={self.draft!r} drafts num_speculations tokens), got {self.layer_speculations!r}")
            if not _is_int(self.layer_speculations) or not 1 <= self.layer_speculations <= self.num_speculations:
                raise ValueError(f"SelfSpeculativeConfig: 'layer_speculations' must be an int in [1, num_speculations="
                                 f"{self.num_speculations}], got {self.layer_speculations!r}")

    def _check_draft_stops(self) -> None:
        """What ends or gates a layer draft: the thresholds and the guard."""
        if self.draft_threshold is not None and not 0.0 <= self.draft_threshold <= 1.0:
            raise ValueError(f"SelfSpeculativeConfig: 'draft_threshold' must be in [0, 1], got {self.draft_threshold!r}")
        if self.long_draft_acceptance is not None and (
                not isinstance(self.long_draft_acceptance, (int, float)) or isinstance(self.long_draft_acceptance, bool)
                or not 0.0 <= self.long_draft_acceptance <= 1.0):
            raise ValueError(f"SelfSpeculativeConfig: 'long_draft_acceptance' must be a number in [0, 1], "
                             f"got {self.long_draft_acceptance!r}")
        if self.min_acceptance is not None and self.min_acceptance != BREAK_EVEN and not (
                isinstance(self.min_acceptance, (int, float)) and not isinstance(self.min_acceptance, bool)
                and 0.0 <= self.min_acceptance <= 1.0):
            raise ValueError(f"SelfSpeculativeConfig: 'min_acceptance' must be a number in [0, 1] or "
                             f"{BREAK_EVEN!r}, got {self.min_acceptance!r}")
        if not _is_int(self.probe_every) or self.probe_every < 1:
            raise ValueError(f"SelfSpeculativeConfig: 'probe_every' must be an int >= 1, got {self.probe_every!r}")
        if not self.uses_layers:
            for name in ("draft_threshold", "long_draft_acceptance", "min_acceptance"):
                if getattr(self, name) is not None:
                    raise ValueError(f"SelfSpeculativeConfig: '{name}' applies to layer drafts, and "
                                     f"draft='lookup' makes none (use draft='hybrid')")

    def _check_batch_limits(self) -> None:
        """The batch sizes above which drafting stops."""
        if self.disable_by_batch_size is not None and (not _is_int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"SelfSpeculativeConfig: 'disable_by_batch_size' must be an int >= 1 or None, "
                             f"got {self.disable_by_batch_size!r}")
        if self.layer_disable_by_batch_size is not None:
            if self.draft != "hybrid":
                raise ValueError(f"SelfSpeculativeConfig: 'layer_disable_by_batch_size' applies to draft='hybrid' only "
                                 f"(with draft={self.draft!r} use disable_by_batch_size), got "
                                 f"{self.layer_disable_by_batch_size!r}")
            value, limit = self.layer_disable_by_batch_size, self.disable_by_batch_size
            if not _is_int(value) or value < 1 or (limit is not None and value > limit):
                bound = "" if limit is None else f" and at most disable_by_batch_size ({limit})"
                raise ValueError(f"SelfSpeculativeConfig: 'layer_disable_by_batch_size' must be an int >= 1{bound}, "
                                 f"got {value!r}")

    def _check_draft_layers(self) -> None:
        """Shared or separate draft layers, the copy's dtype and token trees."""
        if self.draft_layers not in DRAFT_LAYERS:
            raise ValueError(f"SelfSpeculativeConfig: 'draft_layers' must be one of {', '.join(DRAFT_LAYERS)}, "
                             f"got {self.draft_layers!r}")
        if self.draft_layers == "separate" and not self.uses_layers:
            raise ValueError("SelfSpeculativeConfig: draft_layers='separate' applies to layer drafts, and "
                             "draft='lookup' makes none")
        if self.draft_dtype is not None:
            if self.draft_layers != "separate":
                raise ValueError(f"SelfSpeculativeConfig: 'draft_dtype' applies to draft_layers='separate' only "
                                 f"(shared draft layers are the model's), got {self.draft_dtype!r}")
            if self.draft_dtype not in DRAFT_DTYPES:
                raise ValueError(f"SelfSpeculativeConfig: 'draft_dtype' must be one of {', '.join(DRAFT_DTYPES)} "
                                 f"or None, got {self.draft_dtype!r}")
        if not _is_int(self.draft_top_k) or self.draft_top_k < 1:
            raise ValueError(f"SelfSpeculativeConfig: 'draft_top_k' must be an int >= 1, got {self.draft_top_k!r}")
        if self.draft_top_k > 1 and self.draft_layers != "separate":
            raise ValueError(f"SelfSpeculativeConfig: 'draft_top_k' > 1 needs draft_layers='separate' (shared "
                             f"layers verify from the drafts' layer-E states, which alternatives do not have), "
                             f"got draft_top_k={self.draft_top_k}")
        if self.draft_top_k > 1 and self.verify_width > MAX_TREE_TOKENS:
            raise ValueError(f"SelfSpeculativeConfig: a round verifies 1 + num_speculations x draft_top_k = "
                             f"{self.verify_width} tokens per sequence; at most {MAX_TREE_TOKENS} fit a token tree")

    def _check_acceptance(self) -> None:
        """Verified or confident drafts, and the exit threshold of the latter."""
        if self.accept not in ACCEPT_MODES:
            raise ValueError(f"SelfSpeculativeConfig: 'accept' must be one of {', '.join(ACCEPT_MODES)}, "
                             f"got {self.accept!r}")
        if self.trusts_drafts:
            if not self.uses_layers:
                raise ValueError("SelfSpeculativeConfig: accept='confident' applies to layer drafts, and "
                                 "draft='lookup' makes none")
            if self.draft_threshold is None:
                raise ValueError("SelfSpeculativeConfig: accept='confident' needs 'draft_threshold' (the exit "
                                 "confidence: a draft's top-1 probability at layer E)")
            if self.min_acceptance is not None:
                raise ValueError("SelfSpeculativeConfig: 'min_acceptance' does not apply with accept='confident' "
                                 "(no draft is rejected, so there is no acceptance to guard)")
            if self.draft_top_k > 1:
                raise ValueError("SelfSpeculativeConfig: 'draft_top_k' > 1 does not apply with accept='confident' "
                                 "(the chain is emitted as drafted; no alternative is chosen)")
        if self.exit_threshold is not None:
            if not self.trusts_drafts:
                raise ValueError(f"SelfSpeculativeConfig: 'exit_threshold' applies to accept='confident' only, "
                                 f"got {self.exit_threshold!r} with accept={self.accept!r}")
            if not isinstance(self.exit_threshold, (int, float)) or isinstance(self.exit_threshold, bool) or \
                    not self.draft_threshold <= self.exit_threshold <= 1.0:
                raise ValueError(f"SelfSpeculativeConfig: 'exit_threshold' must be a number in [draft_threshold="
                                 f"{self.draft_threshold}, 1], got {self.exit_threshold!r}")

    def _check_hybrid(self) -> None:
        """How a hybrid draft switches source, and the lookup's n-gram sizes."""
        if self.hybrid_switch not in HYBRID_SWITCHES:
            raise ValueError(f"SelfSpeculativeConfig: 'hybrid_switch' must be one of {', '.join(HYBRID_SWITCHES)}, "
                             f"got {self.hybrid_switch!r}")
        if self.switches_per_token:
            if self.draft != "hybrid":
                raise ValueError(f"SelfSpeculativeConfig: hybrid_switch='token' applies to draft='hybrid' only, "
                                 f"got draft={self.draft!r}")
            if self.draft_layers != "separate":
                raise ValueError("SelfSpeculativeConfig: hybrid_switch='token' needs draft_layers='separate' (the "
                                 "copy runs a draft's lookup tokens before drafting after them)")
            if self.draft_top_k > 1 or self.trusts_drafts:
                raise ValueError("SelfSpeculativeConfig: hybrid_switch='token' does not combine with draft_top_k > 1 "
                                 "or accept='confident'")
        if not _is_int(self.lookup_min_ngram) or self.lookup_min_ngram < 1:
            raise ValueError(f"SelfSpeculativeConfig: 'lookup_min_ngram' must be an int >= 1, "
                             f"got {self.lookup_min_ngram!r}")
        if not _is_int(self.lookup_max_ngram) or self.lookup_max_ngram < self.lookup_min_ngram:
            raise ValueError(f"SelfSpeculativeConfig: 'lookup_max_ngram' must be an int >= lookup_min_ngram "
                             f"({self.lookup_min_ngram}), got {self.lookup_max_ngram!r}")

    @property
    def uses_layers(self) -> bool:
        """Whether drafts may come from layer E (draft "layer" or "hybrid")."""
        return self.draft != "lookup"

    @property
    def uses_lookup(self) -> bool:
        return self.draft != "layer"

    @property
    def switches_per_token(self) -> bool:
        """Whether a hybrid draft picks its source per drafted position (hybrid_switch="token")."""
        return self.hybrid_switch == "token"

    @property
    def separate_draft_layers(self) -> bool:
        return self.draft_layers == "separate"

    @property
    def trusts_drafts(self) -> bool:
        """Whether confident layer drafts are emitted unverified (accept="confident")."""
        return self.accept == "confident"

    @property
    def exit_confidence(self) -> Optional[float]:
        """The top-1 probability at which a layer draft exits unchecked (None: none do)."""
        if not self.trusts_drafts:
            return None
        return self.draft_threshold if self.exit_threshold is None else self.exit_threshold

    @property
    def layer_draft_length(self) -> int:
        """The longest draft layer E makes."""
        return self.layer_speculations or self.num_speculations

    @property
    def verify_width(self) -> int:
        """The most tokens a sequence's verify pass holds: its pending token and the drafts (with
        draft_top_k, the alternatives of each layer-drafted position too)."""
        layer = self.layer_draft_length * self.draft_top_k if self.uses_layers else 0
        return 1 + max(self.num_speculations, layer)

    def validate_for(self, num_layers: int, adapters: Optional[ExitAdapters] = None) -> None:
        if not self.uses_layers:
            return  # exit_layer is not used
        if self.exit_layer >= num_layers:
            raise ValueError(f"SelfSpeculativeConfig: 'exit_layer' must be below the model's {num_layers} layers, "
                             f"got {self.exit_layer}")
        if adapters is not None and adapters.blocks and self.exit_layer not in adapters.blocks:
            raise ValueError(f"SelfSpeculativeConfig: 'exit_layer' {self.exit_layer} has no exit adapter; the loaded "
                             f"adapters cover exit layers {adapters.exit_layers()}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
