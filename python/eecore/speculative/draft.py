"""What a sequence drafts in a round (`Draft`), and how layer drafts turn draft-head logits into
tokens (`DraftPicker`): the argmax or a draw from the draft distribution, the thresholds that end a
chain, exits that skip verification (LayerDrafts.exit_threshold), token-tree alternatives."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from eecore.engine.sampler import Sampler, argmax_rows, invert_cdf
from eecore.engine.sequence import Sequence
from eecore.engine.transfer import read_back


@dataclass
class Draft:
    """One sequence's draft in one round, token by token."""
    tokens: list[int] = field(default_factory=list)
    # each token's proposal distribution q (None: greedy, or a lookup token, whose q is one-hot)
    probs: list = field(default_factory=list)
    from_lookup: list[bool] = field(default_factory=list)  # per token: prompt lookup drafted it, else `source`
    source: str = "layer"     # what drafted its other tokens: "layer" (layer E or the copy) or "feature" (a head)
    # per drafted position (token trees, DraftCopy.top_k or FeatureDrafts.top_k > 1): the runners-up verified beside it
    alternatives: list[list[int]] = field(default_factory=list)
    # per drafted position of a greedy tree whose nodes follow the draft probabilities
    # (token_tree.most_likely_nodes): the probabilities of its chain token and of its alternatives
    tree_probs: list[list[float]] = field(default_factory=list)
    # the logprobs (None unless asked) of the leading tokens emitted as exits (LayerDrafts.exit_threshold)
    exits: list = field(default_factory=list)
    layer_turn: bool = False  # a layer draft was allowed this round: the rounds the guard judges
    copy_ran: bool = False    # the separate draft copy ran for this sequence this round

    def __len__(self) -> int:
        return len(self.tokens)

    def add_lookup(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.probs += [None] * len(tokens)
        self.from_lookup += [True] * len(tokens)


@dataclass
class Budgets:
    """What a round lets a proposer draft (eecore.speculative.policy): up to `tokens[b]` tokens for
    sequence b; `copy_passes[b]`, for a source that mixes lookup and copy tokens (token switch), the
    most copy passes among them; `shadowed`: sequences the acceptance guard shadow-checks instead of
    letting them draft."""
    tokens: list[int]
    copy_passes: Optional[list[int]] = None
    shadowed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(self.tokens)


@dataclass
class Proposal:
    """Draft tokens for a batch of rows of draft-head logits (DraftPicker.propose)."""
    tokens: list[int]
    probs: list                 # q per row (None: greedy)
    confident: list[bool]       # confidence at least LayerDrafts.stop_below
    exiting: list[bool]         # confidence at least LayerDrafts.exit_threshold
    logprobs: list              # what an exiting row reports (None unless the request asks)
    # the draft rules' confidence per row (None when no rule needs it): the top-1 probability, or
    # with LayerDrafts.exit_measure the probability that full depth agrees (exit_decision)
    confidence: Optional[list[float]]


class DraftPicker:
    """Layer drafts from the draft head's column logits `[n, K]` (DraftHead.columns). `measure`: an
    exit_decision.AgreementMeasure whose probability the rules read instead of the top-1 probability."""

    def __init__(self, rules, top_k: int, draft_head, sampler: Sampler, draft_length=None, measure=None):
        """`rules`: the draft source's options (LayerDrafts, FeatureDrafts: stop_below, exit_threshold);
        `top_k`: tokens verified per drafted position (token trees)."""
        self.head = draft_head
        self.sampler = sampler
        self.stop_below = rules.stop_below
        self.exit_threshold = rules.exit_threshold
        self.top_k = top_k
        self.draft_length = draft_length
        self.measure = measure
        # whether `take` keeps each greedy tree position's probabilities (Draft.tree_probs)
        self.keeps_tree_probs = False

    def top1(self, logits: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
        """(the probabilities `[n, K]`, the top-1 probability `[n]`, the top-1 column `[n]`) of draft
        head logits, on their device; the probabilities only where a draft rule reads them (None:
        the argmax alone)."""
        if self.stop_below is None and self.exit_threshold is None and self.draft_length is None:
            return None, None, argmax_rows(logits)
        # the top-1 probability and its column in one softmax and one max: right after a verify pass
        # has streamed the weights through every cache, each torch op costs tens of microseconds
        # whatever its size, so a drafted token pays per op, not per element
        probs = torch.softmax(logits, dim=-1)
        p, columns = probs.max(dim=-1)
        return probs, p, columns

    def propose(self, logits: torch.Tensor, seqs: list[Sequence], drafted: Optional[list[list[int]]] = None
                ) -> Proposal:
        """Draft tokens: argmax, or a draw from the processed distribution q over the whole
        vocabulary (kept for rejection sampling). Greedy rows never leave the K columns (the rest of
        the vocabulary has logit -inf). `drafted[i]`: what seqs[i] drafted before this round's row
        (the measure's lookup reads it)."""
        head = self.head
        probs, p, columns = self.top1(logits)
        top1, columns = read_back(p, columns) if p is not None else (None, columns.tolist())
        tokens = head.token_id_list(columns)
        draws: list = [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            q = Sampler.probabilities(head.widen(logits[sampled]), [seqs[i].params for i in sampled])
            drawn = invert_cdf(q, self.sampler.uniforms([seqs[i] for i in sampled])).tolist()
            for j, i in enumerate(sampled):
                tokens[i] = drawn[j]
                draws[i] = q[j]
        n = len(seqs)
        confidence = top1
        if self.measure is not None and probs is not None:
            confidence = self.measure.confidence(probs, tokens, seqs, drafted or [[] for _ in seqs])
        confident = [True] * n if self.stop_below is None else [p >= self.stop_below for p in confidence]
        exiting = [False] * n if self.exit_threshold is None else [p >= self.exit_threshold for p in confidence]
        logprobs = [None] * n if self.exit_threshold is None else \
            [Sampler.logprobs(head.widen(logits[i: i + 1])[0], tokens[i], s.params.logprobs)
             if exiting[i] and s.params.logprobs is not None else None for i, s in enumerate(seqs)]
        return Proposal(tokens, draws, confident, exiting, logprobs, confidence)

    def alternatives(self, logits: torch.Tensor, seqs: list[Sequence], proposal: Proposal,
                     probabilities: Optional[list] = None) -> list[list[int]]:
        """Up to DraftCopy.top_k - 1 token-tree alternatives for each row's chain token: for a greedy
        sequence the draft's next most likely tokens (none outside the draft vocabulary); for a
        sampled one, more draws from the distribution q the chain token was drawn from, independent
        of it (multi-step speculative sampling needs independent draws, so they may repeat it).
        `probabilities`: a list with a place per row, where greedy rows get the draft probabilities
        of their chain token and of its alternatives, of which they then get one more (top_k: the
        candidates token_tree.most_likely_nodes ranks, so that rows can move between positions)."""
        out: list[list[int]] = [[] for _ in seqs]
        greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
        if greedy:
            rows = logits if len(greedy) == len(seqs) else logits[greedy]
            wanted = self.top_k + (probabilities is not None)
            values, columns = rows.topk(min(wanted, logits.shape[-1]), dim=-1)
            if probabilities is not None:  # (log-probabilities of the top tokens, in the same read back)
                values = values - rows.logsumexp(dim=-1, keepdim=True)
            values, indices = values.tolist(), self.head.token_ids(columns).tolist()
            for i, ids, vals in zip(greedy, indices, values):
                token = proposal.tokens[i]
                kept = [(t, v) for t, v in zip(ids, vals) if t != token and v != float("-inf")][: wanted - 1]
                out[i] = [t for t, _ in kept]
                if probabilities is not None:  # (the chain token is the argmax: the first value)
                    probabilities[i] = [math.exp(v) for v in [vals[0]] + [v for _, v in kept]]
        sampled = [i for i, q in enumerate(proposal.probs) if q is not None]
        if sampled:
            q = torch.stack([proposal.probs[i] for i in sampled])
            for _ in range(self.top_k - 1):
                drawn = invert_cdf(q, self.sampler.uniforms([seqs[i] for i in sampled])).tolist()
                for j, i in enumerate(sampled):
                    out[i].append(drawn[j])
        return out

    def take(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], drafts: list[Draft],
             with_alternatives: bool = False, opening=()) -> tuple[list[int], set[int]]:
        """Draft tokens of seqs[b] for b in `rows` (one row each of `logits`) added to drafts[b]. A
        draft that leads the chain as an exit (LayerDrafts.exit_threshold: every earlier draft of the round
        exited, and it is at least exit_threshold sure) adds its logprobs to the exits; with
        `with_alternatives`, its tree alternatives are kept too. A doubtful draft (below
        stop_below) is dropped and ends its sequence's drafting. Returns the rows that drafted,
        and those of them whose chain ends with this draft all the same: rows in `opening` (the
        round's first layer draft of seqs[b]) that long_draft_acceptance stops (DraftLength)."""
        live_seqs = [seqs[b] for b in rows]
        for seq in live_seqs:  # every layer proposal costs a draft head (with a copy: a copy pass), kept or not
            seq.stats["layer_proposals"] += 1
        proposal = self.propose(logits, live_seqs, [drafts[b].tokens for b in rows])
        with_alternatives = with_alternatives and self.top_k > 1  # (no tree: Draft.alternatives stays empty)
        probs = [None] * len(rows) if with_alternatives and self.keeps_tree_probs else None
        alts = self.alternatives(logits, live_seqs, proposal, probs) if with_alternatives else None
        kept, ended = [], set()
        opening = set(opening) if self.draft_length is not None else ()
        for i, b in enumerate(rows):
            if not proposal.confident[i]:
                continue
            draft = drafts[b]
            if self.draft_length is not None and b in opening and \
                    not self.draft_length.goes_on(seqs[b], proposal.confidence[i]):
                ended.add(b)
            if proposal.exiting[i] and len(draft.exits) == len(draft.tokens):
                draft.exits.append(proposal.logprobs[i])
            draft.tokens.append(proposal.tokens[i])
            draft.probs.append(proposal.probs[i])
            draft.from_lookup.append(False)
            if with_alternatives:
                draft.alternatives.append(alts[i])
                if probs is not None and probs[i] is not None:
                    draft.tree_probs.append(probs[i])
            kept.append(b)
        return kept, ended
