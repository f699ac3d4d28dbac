"""Feature drafts (`SelfSpeculativeConfig(feature=FeatureDrafts(head=...))`): a feature head
(eecore.models.feature_head) drafts each sequence's tokens from the target's own hidden states at
its last verified position.

The states come from the passes the target runs anyway: every verify pass (and every plain step of
a round that drafted nothing) copies the streams after the head's tapped layers for each of its
tokens, and after acceptance each sequence keeps those of its last accepted position (the row whose
output is the token it emits last). A sequence without them (its first round after the prompt, or
after a step the strategy did not run) drafts nothing that round, which taps them.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

import torch

from eecore import envs
from eecore.engine.sequence import Sequence
from eecore.models.draft_columns import DraftColumns
from eecore.models.feature_head import SHIPPED_FILE, FeatureHead
from eecore.models.int8_weights import eight_bit, project
from eecore.speculative.draft import Budgets, Draft, DraftPicker
from eecore.speculative.proposers import Proposer
from eecore.speculative.state import SequenceStates
from eecore.speculative.static_passes import StaticFeatureSteps
from eecore.speculative.token_tree import most_likely_nodes


class FeatureDraftHead(DraftColumns):
    """The head at inference: its weights on the model's device, the target's LM head rows of its
    draft vocabulary and the target's embedding, read as a draft picker reads a draft head
    (DraftColumns: its logits' columns and their tokens).

    Its matrices multiply with eecore's own kernel (`project`), not F.linear: for one or a few rows
    PyTorch's CPU matmul reads the weights 1.5-4x slower (the draft vocabulary's rows 589 us
    against 138 on Zen 5), and a head step is only worth running while it costs a few percent of a
    target step. Its activations stay fp32 whatever the model's dtype (the head is small)."""

    def __init__(self, head: FeatureHead, model, max_rows: int, eight_bits: bool = True):
        super().__init__(head.vocab, model.config.vocab_size, max_rows, model.device)
        head = head.to(model.device)
        self.model = model
        d = model.config.hidden_size
        ids = self.vocab if self.vocab is not None else torch.arange(model.config.vocab_size, device=model.device)
        # the LM head's rows once, dense (they may be GGUF blocks), in fp32 as the head's activations
        rows = model.head_rows(torch.empty(ids.shape[0], d, dtype=model.dtype, device=model.device), ids).float()
        form = eight_bit if eight_bits else (lambda w: w)
        self.head_rows = form(rows)
        self.head = dataclasses.replace(head, weights={
            name: form(w) if w.dim() == 2 else w for name, w in head.weights.items()})
        self._embedded = torch.empty(max_rows, d, dtype=model.dtype, device=model.device)

    @staticmethod
    def linear(input: torch.Tensor, weight) -> torch.Tensor:
        """FeatureHead.step's `linear` at inference: eecore's kernel into a fresh output."""
        return project(input.new_empty(input.shape[0], weight.shape[0]), input.contiguous(), weight)

    def start(self, features: torch.Tensor) -> torch.Tensor:
        return self.head.start_state(features, self.linear)

    def step(self, state: torch.Tensor, tokens: torch.Tensor, window):
        """One draft for each row: (its state, its logits over the draft vocabulary, the window)."""
        return self.head.step(state, self.embed(tokens), self.head_rows, window, self.linear)

    @property
    def taps(self) -> tuple[int, ...]:
        return self.head.taps

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids, self._embedded[: token_ids.shape[0]])

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.head.weights.values()) + self.head_rows.nbytes


class FeatureProposer(Proposer):
    """Each drafting sequence's chain from the feature head: the first draft from its kept target
    states and pending token, each later one from the head's own state and the draft before; the
    draft picker turns each step's logits into tokens (greedy, or drawn, for rejection sampling),
    and with FeatureDrafts.top_k > 1 each position's runners-up too (a token tree). A greedy tree
    of d positions then keeps the d x top_k nodes most likely under the head among its chain and
    top_k runners-up a position (token_tree.most_likely_nodes): the head's probabilities say where
    a row is worth more, beside a doubtful position or deeper along a sure chain."""

    kind = "feature"

    def __init__(self, head: FeatureDraftHead, picker: DraftPicker, states: SequenceStates, max_tokens: int,
                 static: Optional[StaticFeatureSteps] = None,
                 tree_nodes: Optional[Callable[[int], int]] = None):
        self.head = head
        self.picker = picker
        # the most tokens a tree of d positions verifies (SelfSpeculativeConfig.feature_tree_nodes)
        self.tree_nodes = tree_nodes or (lambda positions: positions * picker.top_k)
        self.states = states
        self.static = static  # the head's steps as CUDA graphs (EECORE_FEATURE_GRAPHS), else op by op
        self.passes = 0  # head steps run (the draft planner's clock)
        model = head.model
        # every pass's tapped streams, for up to a step's tokens (`keep` copies out what it keeps)
        self._tapped = torch.empty(max_tokens, len(head.taps) * model.config.hidden_size, dtype=model.dtype,
                                   device=model.device)

    def tap(self, num_tokens: int) -> tuple[tuple[int, ...], torch.Tensor]:
        """A pass's tap for `num_tokens` tokens: the head's layers, and where their streams go."""
        return self.head.taps, self._tapped[:num_tokens]

    def keep(self, seqs: list[Sequence], rows: list[int], tapped: torch.Tensor) -> None:
        """After a pass that tapped `tapped` (one row a token) and advanced `seqs`: seqs[i]'s last
        verified position is row rows[i]. Kept with that position: a step that did not tap (a plain
        step above the drafting batch limit, one beside prompt chunks) leaves them stale, and stale
        states are not drafted from."""
        kept = tapped.index_select(0, torch.tensor(rows, device=tapped.device))
        for seq, features in zip(seqs, kept):
            self.states.of(seq).features = (features, seq.num_computed_tokens - 1)

    def features_of(self, seq: Sequence) -> Optional[torch.Tensor]:
        """`seq`'s tapped streams at its last verified position; None where none were kept there."""
        kept = self.states.slot(seq, "features")
        return kept[0] if kept is not None and kept[1] == seq.num_computed_tokens - 1 else None

    def propose(self, seqs: list[Sequence], drafts: list[Draft], budgets: Budgets, verify_ahead=None) -> None:
        budgets = budgets.tokens
        features = [self.features_of(seq) if n else None for seq, n in zip(seqs, budgets)]
        live = [b for b, f in enumerate(features) if f is not None]
        if not live:
            return
        for b in live:
            drafts[b].source = "feature"
        static = self.static
        if static is not None and len(live) <= static.max_batch and max(budgets[b] for b in live) <= static.max_steps:
            self._propose_static(seqs, drafts, budgets, live, features)
        else:
            self._propose_eager(seqs, drafts, budgets, live, features)
        if self.picker.keeps_tree_probs:
            for b in live:
                self._keep_most_likely(drafts[b])

    def _keep_most_likely(self, draft: Draft) -> None:
        """A greedy tree's d x top_k most likely nodes (token_tree.most_likely_nodes) among its chain
        and top_k runners-up a position, at most tree_nodes: its chain may end sooner, its rows shift
        between positions. A sampled tree (independent draws, top_k - 1 a position) over tree_nodes
        drops its deepest draws first."""
        budget = self.tree_nodes(len(draft.tokens))
        if len(draft.tree_probs) == len(draft.tokens):
            keep, draft.alternatives = most_likely_nodes(draft.tokens, draft.alternatives, draft.tree_probs, budget)
            del draft.tokens[keep:], draft.probs[keep:], draft.from_lookup[keep:]
            draft.tree_probs = []
            return
        while len(draft.tokens) + sum(map(len, draft.alternatives)) > budget:
            deepest = max((j for j, alts in enumerate(draft.alternatives) if alts), default=None)
            if deepest is None:  # (budget >= top_k >= 2 keeps the first draft)
                del draft.tokens[budget:], draft.probs[budget:], draft.from_lookup[budget:], draft.alternatives[budget:]
                break
            draft.alternatives[deepest].pop()

    def _propose_eager(self, seqs: list[Sequence], drafts: list[Draft], budgets: list[int], live: list[int],
                       features: list[Optional[torch.Tensor]]) -> None:
        """`propose` op by op: each step runs the rows whose chains go on."""
        head = self.head
        state = head.start(torch.stack([features[b] for b in live]))
        tokens = torch.tensor([seqs[b].last_token_id for b in live], device=state.device)
        window: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        for step in range(max(budgets[b] for b in live)):
            state, logits, window = head.step(state, tokens, window)
            self.passes += 1
            rows = self._pick(logits, step, live, seqs, drafts, budgets)
            if not rows:
                return
            if len(rows) < len(live):
                index = torch.tensor(rows, device=state.device)
                state, window = state.index_select(0, index), (window[0].index_select(0, index),
                                                               window[1].index_select(0, index))
                live = [live[i] for i in rows]
            tokens = torch.tensor([drafts[b].tokens[-1] for b in live], device=state.device)

    def _propose_static(self, seqs: list[Sequence], drafts: list[Draft], budgets: list[int], live: list[int],
                        features: list[Optional[torch.Tensor]]) -> None:
        """`propose` on the head's static steps: every live row steps on to the longest budget's
        end (what it drafts past its own end is not read), the picker reads the rows still going."""
        static, n = self.static, len(live)
        device = static.tokens.device
        torch.stack([features[b] for b in live], out=static.features[:n])
        static.tokens[0, :n].copy_(torch.tensor([seqs[b].last_token_id for b in live]))
        rows = list(range(n))  # each live sequence's row of the padded batch
        for step in range(max(budgets[b] for b in live)):
            logits = static.run(n, step)
            self.passes += 1
            if len(rows) < n:
                logits = logits.index_select(0, torch.tensor(rows, device=device))
            still = self._pick(logits, step, live, seqs, drafts, budgets)
            if not still:
                return
            rows, live = [rows[i] for i in still], [live[i] for i in still]
            static.tokens[step + 1].index_copy_(0, torch.tensor(rows, device=device),
                                                torch.tensor([drafts[b].tokens[-1] for b in live], device=device))

    def _pick(self, logits: torch.Tensor, step: int, live: list[int], seqs: list[Sequence], drafts: list[Draft],
              budgets: list[int]) -> list[int]:
        """The drafts of step `step` picked from `logits` (a row for each of `live`) into `drafts`;
        returns the places in `live` of the sequences whose chains go on."""
        kept, ended = self.picker.take(logits, live, seqs, drafts, with_alternatives=True,
                                       opening=live if step == 0 else ())
        going = set(b for b in kept if len(drafts[b]) < budgets[b] and b not in ended)
        return [i for i, b in enumerate(live) if b in going]

    def release(self, seq: Sequence) -> None:
        self.states.clear_slot(seq, "features")


def build_feature_drafts(config, runner, sampler, states: SequenceStates) -> tuple[FeatureDraftHead, FeatureProposer]:
    """The head of `config.feature` (checked to fit the runner's model) and its proposer."""
    model = runner.model
    path = config.feature.head if config.feature.head is not None else SHIPPED_FILE
    head = FeatureDraftHead(FeatureHead.load(path, model), model, runner.max_seqs,
                            eight_bits=(config.feature.dtype or ("int8" if model.device.type == "cpu" else
                                                                 "float32")) == "int8")
    picker = DraftPicker(config.feature, config.feature_top_k, head, sampler)
    # a greedy tree's rows go to its most likely nodes (token_tree.most_likely_nodes)
    picker.keeps_tree_probs = config.feature_top_k > 1
    static = None
    if runner.graph_capture is not None and envs.flag("EECORE_FEATURE_GRAPHS"):
        static = StaticFeatureSteps(runner, head, runner.max_seqs, config.feature_draft_length,
                                    capture=runner.graph_capture)
    return head, FeatureProposer(head, picker, states, runner.max_tokens, static, config.feature_tree_nodes)


def without_unfit_shipped_head(config, model):
    """`config` without its feature drafts where they would be the shipped head's beside layer
    drafts (the exit-ready layer preset) and the shipped head was not made for `model`: another
    model's exit-ready file then drafts with its copy (and lookup, where configured) without it (a
    warning says so). A head named by file, or feature drafts alone, must fit (loading raises)."""
    if not (config.uses_feature and config.uses_layers and config.feature.head is None):
        return config
    try:
        FeatureHead.load(SHIPPED_FILE).check_fits(model, SHIPPED_FILE)
    except ValueError as exc:
        warnings.warn(f"the shipped feature head does not fit this model ({exc}); the other drafts go on without it",
                      stacklevel=3)
        return dataclasses.replace(config, feature=None)
    return config
