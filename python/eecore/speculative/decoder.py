"""Self-speculative decoding (LayerSkip §4.3) with layer and prompt-lookup drafts, batched on the
paged engine.

One round per running sequence, all sequences together:
- draft, per sequence: a prompt-lookup draft (`draft="lookup"` or `"hybrid"`, when the sequence
  has an n-gram match; see eecore.speculative.drafters), or a layer draft (`"layer"`, or
  `"hybrid"` without a match): pass k (k = 0..d) runs the newest token (the pending one, then
  each draft) through layers 0..E-1 only, writing their K/V into the shared paged cache, and
  stores its layer-E hidden state in the exit-query cache; passes k < d also read a draft token
  off the draft head (the LM head, or the exit adapter and draft vocabulary);
- lookup drafts never ran layers 0..E-1: their pending token and drafts join pass 0 as one more
  varlen row each (all their d+1 positions at once), which writes their K/V in layers 0..E-1 and
  fills their exit-query cache rows. A round with no layer draft is a single varlen full-depth
  pass;
- verify: the cached layer-E states continue through layers E..L-1 in one varlen pass (query
  length d+1 per sequence); the first E layers never run again for these positions;
- accept: the longest prefix of drafts the full model agrees with, plus the full model's next
  token (greedy), or speculative rejection sampling when sampling, so the output law is the full
  model's (a lookup draft is a deterministic proposal: q is one-hot; eecore.speculative.rejection).
  Rejected positions are rolled back by shrinking the sequence (their K/V is simply overwritten
  later).
Sequences may draft different numbers of tokens, from different sources: every pass is varlen, so
nothing is padded.

With `draft_layers="separate"` (eecore.speculative.draft_stack) a copy of layers 0..E-1 with its own
KV cache makes the layer drafts: d passes (the pending token, then drafts 1..d-1; the copy first
catches up on tokens it has not run), and verification is the lookup rounds' single full-depth
varlen pass over every sequence's pending token and drafts. With `hybrid_switch="token"` a
sequence's draft mixes the sources: lookup continuations while it ends in an n-gram match, a copy
token where it does not (the copy's pass first runs the draft's lookup tokens), then lookup again.

With `accept="confident"` a layer-drafting sequence's leading drafts that are at least
`exit_threshold` sure (default `draft_threshold`) skip the accept step: they are emitted as early
exits at layer E, and only the rows after them are accepted as usual (the drafts that followed,
verified, then the full-depth token). The verify pass still runs over every drafted position, which
is what writes the exits' exact K/V in the later layers (deferred K/V, where the seed paper's early
exit fills it from the exit's state); only the rows after the exits go through the LM head.

With `long_draft_acceptance` (eecore.speculative.draft_length) a sequence whose first layer drafts
are accepted too rarely ends its round's chain after the first draft unless that draft is sure.

The guard (eecore.speculative.guard) gates layer drafts only. A lookup draft reads no weights: when
decoding is bound by reading weights, verifying d+1 tokens costs what decoding 1 costs, so its
bandwidth-bound break-even acceptance is 0 and a wrong lookup draft costs only the extra compute
of its rows.
"""
from __future__ import annotations

from typing import Optional

import torch

from eecore.engine.decoding import DecodeStrategy, FullDepthDecoder, Token
from eecore.engine.inputs import Row
from eecore.engine.sampler import Sampler, argmax_rows
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import DraftHead, ExitAdapters
from eecore.speculative.config import BREAK_EVEN, SelfSpeculativeConfig
from eecore.speculative.draft_length import DraftLength
from eecore.speculative.draft_stack import DraftStack
from eecore.speculative.drafters import PromptLookup
from eecore.speculative.guard import SpeculationGuard, break_even_acceptance
from eecore.speculative.rejection import rejection_sample
from eecore.speculative.token_tree import accept_greedy, tree_row


class SelfSpeculativeDecoder(DecodeStrategy):
    def __init__(self, runner, sampler: Sampler, config: SelfSpeculativeConfig,
                 adapters: Optional[ExitAdapters] = None, draft_model=None):
        """`draft_model`: with `config.draft_layers == "separate"`, the copy of layers 0..E-1 that
        drafts (eecore.speculative.draft_stack.build_draft_model)."""
        super().__init__(runner, sampler)
        self.config = config
        self.num_drafts = config.num_speculations
        self.layer_drafts = config.layer_draft_length
        self.lookahead = config.verify_width  # KV slots a round may write per sequence
        self.top_k = config.draft_top_k
        self._plain = FullDepthDecoder(runner, sampler)
        self.plain_above = config.disable_by_batch_size
        self.layers_above = config.layer_disable_by_batch_size  # more decoding: lookup drafts alone
        model = runner.model
        rows = runner.builder.max_seqs
        self.lookup = PromptLookup(config.lookup_min_ngram, config.lookup_max_ngram) if config.uses_lookup else None
        # lookup-only: no layer drafts, so no exit-query cache, draft head or guard
        self.exit_layer = config.exit_layer if config.uses_layers else None
        self.draft_head = self.guard = self._exit_states = self.draft_stack = self.draft_length = None
        if not config.uses_layers:
            return
        if config.long_draft_acceptance is not None:
            self.draft_length = DraftLength(config.long_draft_acceptance)
        if config.separate_draft_layers != (draft_model is not None):
            raise ValueError("SelfSpeculativeDecoder: a draft model goes with draft_layers='separate', and only there")
        if draft_model is not None:
            self.draft_stack = DraftStack(draft_model, runner, adapters, self.exit_layer)
            self.draft_head = self.draft_stack.head
        else:
            # the exit-query cache: layer-E hidden state of each drafted position, per sequence
            self._exit_states = torch.empty(rows, self.lookahead, model.config.hidden_size, dtype=model.dtype,
                                            device=model.device)
            # reads draft tokens off layer E: the exit adapter and draft vocabulary when there are any
            self.draft_head = DraftHead(model, self.exit_layer, adapters, rows)
        floor = config.min_acceptance
        if floor == BREAK_EVEN:
            floor = break_even_acceptance(
                model, self.exit_layer, self.layer_drafts, self.draft_head.weight_bytes(),
                None if self.draft_stack is None else self.draft_stack.weight_bytes())
        self.guard = None if floor is None else \
            SpeculationGuard(model, rows, floor, config.probe_every, self.draft_head)

    # ---- one round -------------------------------------------------------------------------
    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        budgets = [max(0, min(self.num_drafts, self._room(s) - 1)) for s in seqs]
        layers = self.draft_head is not None and (self.layers_above is None or len(seqs) <= self.layers_above)
        if self.config.switches_per_token:
            return self._decode_switching(seqs, budgets, layers)
        lookup = [self.lookup.propose(s, n) if self.lookup is not None and n else [] for s, n in zip(seqs, budgets)]
        # layer drafts: sequences without a lookup draft, as far as the guard allows; the guard
        # sees only the rounds in which a sequence could draft with the layers
        layer_budgets, shadowed = [0] * len(seqs), []
        if layers:
            for b, seq in enumerate(seqs):
                if lookup[b]:
                    continue
                if self.guard is None or self.guard.allows(seq):
                    layer_budgets[b] = min(budgets[b], self.layer_drafts)
                elif self.guard.wants_shadow(seq) and self.draft_stack is None:
                    shadowed.append(b)  # (separate draft layers have no layer-E state to check)
        if not any(layer_budgets) and not any(lookup):
            # nobody drafts this round (no match, the guard, or last tokens): a plain step
            self._count_plain(seqs)
            if not shadowed:
                return self._plain.decode(seqs)
            # the guard's shadow check wants layer-E states: tap them on the way through
            results, logits = self._plain.step(seqs, tap=(self.exit_layer, self._exit_states[: len(seqs), 0]))
            self._record_shadow(seqs, shadowed, shadowed, logits)
            return results
        alternatives = [[] for _ in seqs]
        if any(layer_budgets) and self.draft_stack is None:
            drafts, draft_probs, exits = self._draft(seqs, lookup, layer_budgets)
            widths = [len(d) + 1 for d in drafts]
            logits = self._verify(seqs, drafts, self._logit_rows(widths, exits))
        else:  # lookup drafts or a separate draft stack's: one varlen pass through every layer
            drafts, draft_probs, alternatives, exits = self._lookup_and_copy_drafts(seqs, lookup, layer_budgets)
            rows = [tree_row(s, d, a) for s, d, a in zip(seqs, drafts, alternatives)]
            widths = [len(row.tokens) for row in rows]
            logits = self._verify_all(rows, shadowed, self._logit_rows(widths, exits))
        from_lookup = [[bool(lk)] * len(d) for lk, d in zip(lookup, drafts)]
        copy_ran = [self.draft_stack is not None and n > 0 for n in layer_budgets]
        results, offsets = self._accept_all(seqs, drafts, draft_probs, alternatives, exits, widths, logits,
                                            from_lookup, copy_ran, [n > 0 for n in layer_budgets])
        self._record_shadow(seqs, shadowed, [offsets[b] for b in shadowed], logits)
        return results

    def _decode_switching(self, seqs: list[Sequence], budgets: list[int], layers: bool) -> list[list[Token]]:
        """A round of hybrid_switch="token": drafts from _switching_drafts (`layers`: whether the copy
        may draft this round), verified by one varlen full-depth pass."""
        drafts, draft_probs, from_lookup, copy_ran = self._switching_drafts(seqs, budgets, layers)
        if not any(drafts):  # no match, and no copy token sure enough: a plain step
            starts = [s.num_computed_tokens for s in seqs]
            results = self._plain.decode(seqs)
            for b, (seq, ran) in enumerate(zip(seqs, copy_ran)):
                self._count(seq, ran, [], 0)  # a copy pass that drafted nothing is a round at rate 0
                if ran:  # the copy's K/V of the pending token is right
                    self.draft_stack.settle(seq, starts[b] + 1)
            return results
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id] + d) for s, d in zip(seqs, drafts)]
        logits = self._verify_all(rows, [])
        nothing = [[] for _ in seqs]
        results, _ = self._accept_all(seqs, drafts, draft_probs, nothing, nothing, [len(r.tokens) for r in rows],
                                      logits, from_lookup, copy_ran, copy_ran)
        return results

    def _switching_drafts(self, seqs: list[Sequence], budgets: list[int], layers: bool):
        """hybrid_switch="token": each sequence's draft grows by lookup continuations while it ends
        in an n-gram match, and by one copy token where it does not (one copy pass for all such
        sequences at once, which first runs what the copy has not seen: its catch-up, the pending
        token and the draft's lookup tokens), until budgets[b] tokens, `layer_speculations` copy
        passes, or a doubtful copy token; without `layers` (more sequences decode than
        layer_disable_by_batch_size) the copy does not run and drafts are lookup runs alone. Returns the drafts, their q (None: a lookup token, or
        greedy), which tokens came from lookup, and whose copy ran (the rounds the guard judges:
        a round the lookup drafted alone tells nothing of the layers)."""
        B = len(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list] = [[] for _ in seqs]
        from_lookup: list[list[bool]] = [[] for _ in seqs]
        passes_left = [self.layer_drafts if layers and n and (self.guard is None or self.guard.allows(s)) else 0
                       for s, n in zip(seqs, budgets)]
        copy_ran = [False] * B

        def extend_by_lookup(b: int) -> None:
            while len(drafts[b]) < budgets[b]:
                more = self.lookup.propose(seqs[b], budgets[b] - len(drafts[b]), after=drafts[b])
                if not more:
                    return
                drafts[b] += more
                draft_probs[b] += [None] * len(more)
                from_lookup[b] += [True] * len(more)

        for b in range(B):
            extend_by_lookup(b)
        live = [b for b in range(B) if len(drafts[b]) < budgets[b] and passes_left[b]]
        first, exits = True, [[] for _ in seqs]
        while live:
            live_seqs, live_drafts = [seqs[b] for b in live], [drafts[b] for b in live]
            stack = self.draft_stack
            hidden = stack.first_pass(live_seqs, live_drafts) if first else stack.next_pass(live_seqs, live_drafts)
            first = False
            opening = [b for b in live if not copy_ran[b]]
            for b in live:
                copy_ran[b] = True
                passes_left[b] -= 1
            kept, ended = self._take_drafts(self.draft_head.columns(hidden), live, seqs, drafts, draft_probs, exits,
                                            opening=opening)
            for b in kept:
                from_lookup[b].append(False)
                if b in ended:
                    passes_left[b] = 0
                extend_by_lookup(b)
            live = [b for b in kept if len(drafts[b]) < budgets[b] and passes_left[b]]
        return drafts, draft_probs, from_lookup, copy_ran

    def _accept_all(self, seqs, drafts, draft_probs, alternatives, exits, widths, logits, from_lookup, copy_ran,
                    attempted) -> tuple[list[list[Token]], list[int]]:
        """Accepts each sequence's drafts against its rows of the verify pass's `logits`, advances
        it, and settles the copy's cache where the copy ran; returns the tokens and each
        sequence's first logits row."""
        results, offsets, offset, moves = [], [], 0, []
        # every greedy row's full-depth token in one op (per sequence, each op would cost tens of
        # microseconds here, right after the verify pass)
        top = argmax_rows(logits).tolist() if any(seq.params.greedy for seq in seqs) else None
        for b, (seq, n, probs) in enumerate(zip(seqs, widths, draft_probs)):
            chain = drafts[b]
            # accept="confident": the leading exits are emitted as they are (at layer E; their
            # logprobs are the exit's), and only the rows after them are accepted as usual
            k = len(exits[b])
            n -= k
            tokens, leaf, agreed = self._accept(seq, chain[k:], probs[k:], logits[offset: offset + n],
                                                alternatives[b][k:], None if top is None else top[offset: offset + n])
            tokens = [Token(t, self.exit_layer, lp) for t, lp in zip(chain[:k], exits[b])] + tokens
            agreed += k
            if leaf >= 0:  # (trees and exits never meet: draft_top_k > 1 is refused with them)
                leaf += k
            offsets.append(offset)
            offset += n
            start = seq.num_computed_tokens
            if leaf >= 0:  # an accepted alternative: its K/V moves from its leaf slot to its position
                moves.append((seq, start + leaf, start + agreed + 1))
            # positions up to the last accepted draft now hold valid K/V in every layer
            seq.num_computed_tokens += len(tokens)
            if copy_ran[b]:
                # the copy's K/V is right through the last chain draft the model agreed with
                self.draft_stack.settle(seq, start + agreed + 1)
            self._count(seq, attempted[b], from_lookup[b], len(tokens) - 1, sum(map(len, alternatives[b])),
                        leaf >= 0)
            results.append(tokens)
        if moves:
            self._move_kv(moves)
        return results, offsets

    # ---- plain steps: more sequences decode than disable_by_batch_size ----------------------
    def decode_plain(self, seqs: list[Sequence]) -> list[list[Token]]:
        self._count_plain(seqs)
        return self._plain.decode(seqs)

    def decode_mixed(self, seqs: list[Sequence], prefill_rows: list[Row]):
        self._count_plain(seqs)
        return self._plain.decode_mixed(seqs, prefill_rows)

    def _count_plain(self, seqs: list[Sequence]) -> None:
        """A round in which nobody drafted: one verify step of one token each."""
        for seq in seqs:
            self._count(seq, False, [], 0)

    def _record_shadow(self, seqs, rows: list[int], logit_rows: list[int], logits: torch.Tensor) -> None:
        """The shadow check for seqs[b], b in `rows` (sequences that drafted nothing, so slot 0
        of their exit-query cache row is the layer-E state of the position just decoded)."""
        if not rows:
            return
        states = self._exit_states[rows, 0]
        self.guard.record_shadow([seqs[b] for b in rows], states, logits[logit_rows])

    def release(self, seq: Sequence) -> None:
        if self.guard is not None:
            self.guard.release(seq)
        if self.draft_length is not None:
            self.draft_length.release(seq)
        if self.lookup is not None:
            self.lookup.release(seq)
        if self.draft_stack is not None:
            self.draft_stack.release(seq)

    def _room(self, seq: Sequence) -> int:
        """New tokens this sequence may still get (max_tokens and the context both bound it)."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.runner.max_model_len - seq.num_tokens)

    def _draft(self, seqs, lookup, budgets):
        """Layer drafts of up to budgets[b] tokens, their q (None: greedy, or a lookup draft) and
        the leading exits' logprobs (see _take_drafts). Pass 0 also runs every lookup draft (with
        its pending token) through layers 0..E-1, so the exit-query cache holds every position the
        verify pass needs."""
        E, states = self.exit_layer, self._exit_states
        width = self.lookahead
        drafts: list[list[int]] = [list(d) for d in lookup]
        draft_probs: list[list] = [[None] * len(d) for d in lookup]  # None: a lookup draft (q one-hot)
        exits: list[list] = [[] for _ in seqs]
        newest = [s.last_token_id for s in seqs]
        live = list(range(len(seqs)))  # rows whose newest token still needs its layer-E state
        for k in range(self.num_drafts + 1):
            if not live:
                break
            if k == 0:
                rows = [Row(s, s.num_computed_tokens, [s.last_token_id] + d) for s, d in zip(seqs, lookup)]
            else:
                rows = [Row(seqs[b], seqs[b].num_computed_tokens + k, [newest[b]]) for b in live]
            inputs = self.runner.prepare(rows)
            hidden = self.runner.embed(inputs)
            self.runner.run_layers(hidden, inputs.attn, 0, E)
            if k == 0 and inputs.num_tokens > len(seqs):  # lookup rows hold several positions
                index = [b * width + j for b, d in enumerate(lookup) for j in range(len(d) + 1)]
                states[: len(seqs)].view(len(seqs) * width, -1).index_copy_(
                    0, torch.tensor(index, device=hidden.device), hidden)
                starts = [0]
                for d in lookup:
                    starts.append(starts[-1] + len(d) + 1)
            elif len(live) == len(seqs):
                states[: len(seqs), k].copy_(hidden)
                starts = range(len(seqs))
            else:
                states[:, k].index_copy_(0, torch.tensor(live, device=hidden.device), hidden)
                starts = range(len(live))
            drafting = [j for j, b in enumerate(live) if len(drafts[b]) < budgets[b]]
            if not drafting:
                break
            picked = hidden if len(drafting) == len(live) == inputs.num_tokens else \
                hidden.index_select(0, torch.tensor([starts[j] for j in drafting], device=hidden.device))
            rows = [live[j] for j in drafting]
            kept, ended = self._take_drafts(self.draft_head.columns(picked), rows, seqs, drafts, draft_probs, exits,
                                            opening=rows if k == 0 else ())
            for b in kept:
                newest[b] = drafts[b][-1]
                if b in ended:
                    budgets[b] = len(drafts[b])  # its last pass writes the draft's layer-E state only
            live = kept
        return drafts, draft_probs, exits

    def _lookup_and_copy_drafts(self, seqs, lookup, budgets):
        """Lookup drafts as they are, and layer drafts of up to budgets[b] tokens from the separate
        draft stack: pass 0 runs what the copy has not seen through the pending token, pass k
        draft k; the last draft needs no pass (verification runs it through the model)."""
        drafts: list[list[int]] = [list(d) for d in lookup]
        draft_probs: list[list] = [[None] * len(d) for d in lookup]  # None: a lookup draft (q one-hot)
        alternatives: list[list[list[int]]] = [[] for _ in seqs]  # per sequence, per drafted position
        exits: list[list] = [[] for _ in seqs]
        live = [b for b, n in enumerate(budgets) if n]
        if not live:
            return drafts, draft_probs, alternatives, exits
        stack = self.draft_stack
        hidden = stack.first_pass([seqs[b] for b in live])
        for k in range(1, max(budgets[b] for b in live) + 1):
            logits = self.draft_head.columns(hidden)
            kept, ended = self._take_drafts(logits, live, seqs, drafts, draft_probs, exits, alternatives,
                                            opening=live if k == 1 else ())
            live = [b for b in kept if len(drafts[b]) < budgets[b] and b not in ended]
            if not live:
                break
            hidden = stack.next_pass([seqs[b] for b in live], [drafts[b] for b in live])
        return drafts, draft_probs, alternatives, exits

    def _take_drafts(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], drafts, draft_probs,
                     exits, alternatives=None, opening=()) -> tuple[list[int], set[int]]:
        """Draft tokens of seqs[b] for b in `rows` (one row each of `logits`, the draft head's
        column logits: DraftHead.columns) appended to drafts[b] and their q to draft_probs[b];
        a draft that leads the chain as an exit (accept="confident": every earlier draft of the
        round exited, and it is at least exit_confidence sure) adds its logprobs (None unless
        requested) to exits[b]; with `alternatives`, its tree alternatives too. A doubtful draft
        (below draft_threshold) is dropped and ends its sequence's drafting (adaptive draft
        length). Returns the rows that drafted, and those of them whose chain ends with this
        draft all the same: rows in `opening` (this is the round's first layer draft of seqs[b])
        that long_draft_acceptance stops (DraftLength)."""
        live_seqs = [seqs[b] for b in rows]
        for seq in live_seqs:  # every layer proposal costs a draft head (with a copy: a copy pass), kept or not
            seq.stats["layer_proposals"] = seq.stats.get("layer_proposals", 0) + 1
        tokens, probs, confident, exiting, logprobs, top1 = self._propose(logits, live_seqs)
        alts = self._alternatives(logits, live_seqs, tokens) if self.top_k > 1 else [[]] * len(rows)
        kept, ended = [], set()
        for i, (b, token, p, ok, exit_here, lp, alt) in enumerate(
                zip(rows, tokens, probs, confident, exiting, logprobs, alts)):
            if not ok:
                continue
            if self.draft_length is not None and b in opening and not self.draft_length.goes_on(seqs[b], top1[i]):
                ended.add(b)
            if exit_here and len(exits[b]) == len(drafts[b]):
                exits[b].append(lp)
            drafts[b].append(token)
            draft_probs[b].append(p)
            if alternatives is not None:
                alternatives[b].append(alt)
            kept.append(b)
        return kept, ended

    def _alternatives(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[list[int]]:
        """The draft's next most likely tokens after each greedy sequence's chain token (up to
        draft_top_k - 1, none outside the draft vocabulary); none for sampled sequences."""
        values, columns = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        values, indices = values.tolist(), self.draft_head.token_ids(columns).tolist()
        return [[t for t, v in zip(ids, vals) if t != token and v != float("-inf")][: self.top_k - 1]
                if seq.params.greedy else [] for seq, token, ids, vals in zip(seqs, tokens, indices, values)]

    def _move_kv(self, moves: list[tuple[Sequence, int, int]]) -> None:
        """Every layer's K/V of accepted alternatives, from their leaf slots to their positions."""
        bs = self.runner.kv.block_size

        def slot(seq, pos):
            return seq.block_table[pos // bs] * bs + pos % bs

        device = self.runner.kv.tensor.device
        src = torch.tensor([slot(seq, a) for seq, a, _ in moves], dtype=torch.int64, device=device)
        dst = torch.tensor([slot(seq, b) for seq, _, b in moves], dtype=torch.int64, device=device)
        self.runner.kv.copy_slots(src, dst)

    def _propose(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Draft tokens from the draft head's column logits `[n, K]` (DraftHead.columns): argmax,
        or a draw from the processed distribution q over the whole vocabulary (kept for
        rejection sampling). `confident` is False where the top-1 probability falls below the
        draft threshold; `exiting` is True where it reaches exit_confidence (accept="confident"),
        and `logprobs` holds what such an exit reports: its logprobs under the exit's
        distribution, where the request asks for them (else None); `top1` is each row's top-1
        probability (None when neither threshold nor long_draft_acceptance needs it). Greedy rows
        never leave the K columns (the rest of the vocabulary has logit -inf)."""
        head = self.draft_head
        draft_threshold, exit_threshold = self.config.draft_threshold, self.config.exit_confidence
        top1 = None
        if draft_threshold is None and exit_threshold is None and self.draft_length is None:
            columns = argmax_rows(logits).tolist()
        else:
            # the top-1 probability and its column in one softmax and one max: right after a
            # verify pass has streamed the weights through every cache, each torch op costs tens
            # of microseconds whatever its size, so a drafted token pays per op, not per element
            p, columns = torch.softmax(logits, dim=-1).max(dim=-1)
            top1, columns = p.tolist(), columns.tolist()
        tokens = head.token_id_list(columns)
        probs: list = [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            q = Sampler.probabilities(head.widen(logits[sampled]), [seqs[i].params for i in sampled])
            for j, i in enumerate(sampled):
                tokens[i] = Sampler.draw(q[j], self.sampler.generator_for(seqs[i]))
                probs[i] = q[j]
        confident = [True] * len(seqs) if draft_threshold is None else [p >= draft_threshold for p in top1]
        exiting = [False] * len(seqs) if exit_threshold is None else [p >= exit_threshold for p in top1]
        logprobs = [Sampler.logprobs(head.widen(logits[i: i + 1])[0], tokens[i], s.params.logprobs)
                    if exiting[i] and s.params.logprobs is not None else None for i, s in enumerate(seqs)]
        return tokens, probs, confident, exiting, logprobs, top1

    @staticmethod
    def _logit_rows(widths: list[int], exits: list[list]) -> Optional[list[int]]:
        """The rows of a full-depth pass (sequences' `widths` rows each, in order) whose logits a
        round reads: every row after a sequence's leading exits (accept="confident"), so all of a
        verified sequence's and the last of one whose drafts all exited; None: all."""
        if not any(exits):
            return None
        rows, start = [], 0
        for n, leading in zip(widths, exits):
            rows.extend(range(start + len(leading), start + n))
            start += n
        return rows

    def _logits(self, hidden: torch.Tensor, rows: Optional[list[int]]) -> torch.Tensor:
        if rows is not None and len(rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
        return self.runner.logits(hidden)

    def _verify(self, seqs, drafts, logit_rows: Optional[list[int]] = None) -> torch.Tensor:
        """Layers E..L-1 over every drafted position at once, from the exit-query cache; the
        logits of `logit_rows` (None: of every row)."""
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id] + d) for s, d in zip(seqs, drafts)]
        inputs = self.runner.prepare(rows)
        B, width = len(seqs), self.lookahead
        flat = self._exit_states[:B].view(B * width, -1)
        if all(len(d) + 1 == width for d in drafts):
            hidden = flat
        else:
            index = [b * width + k for b, d in enumerate(drafts) for k in range(len(d) + 1)]
            hidden = flat.index_select(0, torch.tensor(index, device=flat.device))
        self.runner.run_layers(hidden, inputs.attn, self.exit_layer, self.num_layers)
        return self._logits(hidden, logit_rows)

    def _verify_all(self, rows: list[Row], shadowed: list[int], logit_rows: Optional[list[int]] = None) -> torch.Tensor:
        """Every sequence's pending token and drafts (lookup drafts, or a separate draft stack's,
        with their alternatives as tree rows) through all layers in one varlen pass (layer-E
        states copied out only for the guard's shadow check); the logits of `logit_rows` (None:
        of every row)."""
        inputs = self.runner.prepare(rows)
        hidden = self.runner.embed(inputs)
        if shadowed:
            self.runner.run_layers(hidden, inputs.attn, 0, self.exit_layer)
            starts = inputs.attn.query_start_loc[:-1].tolist()
            rows_at = torch.tensor([starts[b] for b in shadowed], device=hidden.device)
            self._exit_states[:, 0].index_copy_(0, torch.tensor(shadowed, device=hidden.device),
                                                hidden.index_select(0, rows_at))
            self.runner.run_layers(hidden, inputs.attn, self.exit_layer, self.num_layers)
        else:
            self.runner.run_layers(hidden, inputs.attn, 0, self.num_layers)
        return self._logits(hidden, logit_rows)

    def _accept(self, seq: Sequence, drafts: list[int], draft_probs, logits: torch.Tensor,
                alternatives: list[list[int]], top: Optional[list[int]]) -> tuple[list[Token], int, int]:
        """The tokens this round adds (accepted drafts, then the full model's own token), the
        verify row of an accepted alternative (-1: none), and how many chain drafts the model
        agreed with. `top`: the argmax of each row of `logits` (greedy sequences)."""
        L, k = self.num_layers, seq.params.logprobs
        if seq.params.greedy:
            verdict = accept_greedy(drafts, alternatives, top)
            tokens, rows, leaf, agreed = verdict.tokens, verdict.rows, verdict.leaf_row, verdict.chain_accepted
        else:  # (sampled sequences draft no alternatives)
            p = Sampler.probabilities(logits, [seq.params] * logits.shape[0])
            tokens = rejection_sample(drafts, draft_probs, p, self.sampler.generator_for(seq))
            rows, leaf, agreed = list(range(len(tokens))), -1, len(tokens) - 1
        return [Token(t, L, Sampler.logprobs(logits[r], t, k) if k is not None else None)
                for r, t in zip(rows, tokens)], leaf, agreed

    # ---- metrics ---------------------------------------------------------------------------
    def _count(self, seq: Sequence, attempted: bool, from_lookup: list[bool], accepted: int,
               alternatives: int = 0, alternative_accepted: bool = False) -> None:
        """`attempted`: a layer draft was allowed (the guard's rounds); `from_lookup`: per drafted
        chain token, whether prompt lookup drafted it (else the layers); `accepted`: the leading
        chain tokens accepted; `alternatives`: tree leaves verified beside the chain, one of which
        was accepted if `alternative_accepted` (then counted among `accepted`)."""
        drafted = len(from_lookup)
        accepted = min(accepted, drafted)
        lookup_drafted, lookup_accepted = sum(from_lookup), sum(from_lookup[:accepted])
        if self.guard is not None and attempted:  # the guard judges the layer drafts alone
            self.guard.record_round(seq, drafted - lookup_drafted, accepted - lookup_accepted)
        if self.draft_length is not None and attempted:
            # the chain's first layer token (a hybrid draft may open with lookup tokens); none made:
            # the threshold dropped it, a rejected first draft
            first = next((i for i, lookup in enumerate(from_lookup) if not lookup), None)
            self.draft_length.record(seq, first is not None and accepted > first)
        st = seq.stats
        st["spec_drafted"] = st.get("spec_drafted", 0) + drafted
        st["spec_accepted"] = st.get("spec_accepted", 0) + accepted
        st["spec_steps"] = st.get("spec_steps", 0) + 1
        st["spec_emitted"] = st.get("spec_emitted", 0) + accepted + 1
        if alternatives:
            st["tree_alternatives"] = st.get("tree_alternatives", 0) + alternatives
            st["tree_alternatives_accepted"] = st.get("tree_alternatives_accepted", 0) + alternative_accepted
        if lookup_drafted:
            st["lookup_rounds"] = st.get("lookup_rounds", 0) + 1
            st["lookup_drafted"] = st.get("lookup_drafted", 0) + lookup_drafted
            st["lookup_accepted"] = st.get("lookup_accepted", 0) + lookup_accepted
        if drafted > lookup_drafted:
            st["layer_drafted"] = st.get("layer_drafted", 0) + drafted - lookup_drafted
            st["layer_accepted"] = st.get("layer_accepted", 0) + accepted - lookup_accepted

    def metrics(self, seq: Sequence) -> dict[str, float]:
        st = seq.stats
        if not st.get("spec_steps"):
            return {}
        m = {"acceptance_rate": st["spec_accepted"] / max(st["spec_drafted"], 1),
             "mean_accepted_tokens_per_step": st["spec_emitted"] / st["spec_steps"],
             "num_verify_steps": st["spec_steps"], "num_drafted_tokens": st["spec_drafted"],
             "num_accepted_tokens": st["spec_accepted"]}
        if self.lookup is not None:
            m.update(num_lookup_rounds=st.get("lookup_rounds", 0),
                     num_lookup_drafted_tokens=st.get("lookup_drafted", 0),
                     num_lookup_accepted_tokens=st.get("lookup_accepted", 0),
                     lookup_acceptance_rate=st.get("lookup_accepted", 0) / max(st.get("lookup_drafted", 0), 1))
        if self.draft_head is not None:
            m.update(num_layer_proposals=st.get("layer_proposals", 0),
                     num_layer_drafted_tokens=st.get("layer_drafted", 0),
                     num_layer_accepted_tokens=st.get("layer_accepted", 0),
                     layer_acceptance_rate=st.get("layer_accepted", 0) / max(st.get("layer_drafted", 0), 1))
        if self.top_k > 1:
            m.update(num_tree_alternatives=st.get("tree_alternatives", 0),
                     num_tree_alternatives_accepted=st.get("tree_alternatives_accepted", 0))
        return m
