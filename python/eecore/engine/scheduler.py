"""Iteration-level (Orca-style) scheduling over the paged KV cache. No tensor code here.

One step is planned under a token budget (`max_num_batched_tokens`) and a bound on the running
batch (`max_num_seqs`), in first-come-first-served order:
1. decodes: every running sequence past its prefill advances by one model iteration (one token,
   or one draft-and-verify round in self-speculation, which needs `lookahead` slots). Decodes are
   never deferred; their tokens are charged to the budget first;
2. prefill chunks: what is left of the budget goes to running sequences still in their prefill,
   then to newly admitted ones, so a long prompt is split over several steps. While more than one
   prompt is running or waiting, one chunk takes at most half of it at first (the rest is handed
   out at the end), so a short request is not held behind a long prompt's whole prefill.

With `mixed=True` (a strategy whose decode step can carry prefill rows: full depth) both kinds
ride in the same step, so a request that arrives costs the running streams a bounded amount of
extra work in one step instead of a whole prefill step of its own (chunked prefill as vLLM's
scheduler does it). Otherwise (early exit, self-speculation: their decode iteration is one token
or one draft run per row) a step is either prefill or decode, and when both have work the kinds
alternate, so a running stream waits at most one budget-bounded prefill step between tokens.
A strategy with `plain_above` (self-speculation's disable_by_batch_size) runs plain full-depth
steps while more sequences than that decode: those steps reserve one slot per decode and, with
`plain_mixed`, take prompt chunks beside the decodes. With `plain_mixed`, a strategy that looks
ahead (lookahead > 1) and cannot mix its own steps also runs plain mixed steps while a prompt is
being computed, and looks ahead again once none is: alternating rounds with prefill steps made
every stream wait a prefill step between rounds, and under `eecore serve` (SmolLM2, exit-ready
presets, 4-8 closed-loop clients, an Intel Xeon) the rounds carried 2.6 sequences a step against
full depth's 3.3 and throughput fell to 0.78-0.95x full depth's; with plain steps while prompts
wait it was 1.03-1.28x (bench/serve_load.py).

When a sequence needs blocks that are not free, the newest running sequence is preempted (its
KV is dropped and recomputed on readmission) rather than failing the step; a step that preempted
admits nobody new, so freed blocks go to the sequences already running.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from eecore.engine.block_manager import BlockManager
from eecore.engine.sequence import Sequence


@dataclass
class ScheduledStep:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[Sequence] = field(default_factory=list)
    # Prompt tokens each prefill sequence computes in this step (its chunk).
    prefill_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Tokens one decode computes at most (1; d + 1 for a self-speculation round).
    decode_cost: int = 1

    @property
    def seqs(self) -> list[Sequence]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes at most (a speculation round may verify fewer)."""
        return len(self.decodes) * self.decode_cost + sum(self.prefill_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int = 1, mixed: bool = True, plain_above: Optional[int] = None,
                 plain_mixed: bool = False):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Slots a decode step may write past the pending token (self-speculation drafts ahead).
        self.lookahead = lookahead
        self.mixed = mixed
        # More decodes than this: a plain step (lookahead 1), mixed if plain_mixed (None: never)
        self.plain_above = plain_above
        self.plain_mixed = plain_mixed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False  # alternation of split (not mixed) steps

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning --------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when there is nothing to run. A step may be empty when all it
        did was preempt (its `preempted` says which)."""
        if not self.has_work:
            return None
        if self.blocks.prefix_caching:  # what the last step's prefill computed can now be shared
            for seq in self.running:
                self.blocks.cache_computed(seq)
        decode, prefill = True, True
        prefilling = sum(1 for s in self.running if s.in_prefill)
        num_decodes = len(self.running) - prefilling
        has_prefill = prefilling > 0 or self._can_admit()
        plain = self.plain_above is not None and num_decodes > self.plain_above
        # a lookahead strategy whose rounds cannot carry prompt chunks runs plain mixed steps while
        # prompts wait, instead of alternating rounds with prefill steps (see the module doc)
        plain = plain or (self.plain_mixed and self.lookahead > 1 and not self.mixed and has_prefill
                          and num_decodes > 0)
        mixed = self.mixed or (plain and self.plain_mixed)
        lookahead = 1 if plain else self.lookahead
        if not mixed:
            # one kind per step: prefill when there is prefill work, unless the last step was a
            # prefill and some stream is waiting for its next token
            prefill = has_prefill and not (num_decodes and self._last_was_prefill)
            decode = not prefill
        step = self._plan(decode, prefill, lookahead)
        if step.is_empty and not mixed and prefill and not step.preempted:
            step = self._plan(True, False, lookahead)  # no prefill fitted (blocks): run the decodes instead
        if step.is_empty and not step.preempted:
            return None
        self._last_was_prefill = bool(step.prefills) and not step.decodes
        return step

    def _can_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def _plan(self, decode: bool, prefill: bool, lookahead: int) -> ScheduledStep:
        step = ScheduledStep(decode_cost=lookahead)
        # Decodes are charged first; in a split prefill step the whole budget is the prefill's.
        prefilling = sum(1 for s in self.running if s.in_prefill)
        num_decodes = len(self.running) - prefilling if decode else 0
        budget = max(self.max_num_batched_tokens - num_decodes * lookahead, 0)
        # Fairness: while another prompt runs or waits, no prompt's chunk takes more than half the
        # budget, so a short request starts within a step or two beside however long a prompt (the
        # oldest-first order alone let a long prefill take every step's budget to its end); what the
        # others leave goes back to the capped chunks at the end.
        cap = max(budget // 2, 1) if prefill and (prefilling > 1 or self._can_admit()) else budget
        queue = deque(self.running)  # oldest first; victims of preemption come off the tail
        while queue:
            seq = queue.popleft()
            if not seq.in_prefill:
                if decode and self._reserve(seq, seq.num_tokens + lookahead - 1, queue, step):
                    step.decodes.append(seq)
            elif prefill and budget > 0:
                n = self._chunk(seq, min(budget, cap), queue, step)
                if n:
                    step.prefills.append(seq)
                    step.prefill_tokens.append(n)
                    budget -= n
        if prefill and not step.preempted:
            budget = self._admit(budget, step, cap)
            self._extend_chunks(budget, step)
        return step

    def _extend_chunks(self, budget: int, step: ScheduledStep) -> None:
        """Gives budget the step has left to its prefill chunks, in order, as far as free blocks
        allow (no preemption for this: it is only extra)."""
        for i, seq in enumerate(step.prefills):
            if budget <= 0:
                return
            start = seq.num_computed_tokens
            end = start + step.prefill_tokens[i]
            want = min(seq.prefill_target - end, budget)
            room = (self.blocks.num_free_blocks + len(seq.block_table)) * self.blocks.block_size - end
            extra = max(min(want, room), 0)
            if seq.num_encoder_tokens or not extra:
                continue  # an encoder-decoder request's first chunk also paid for its encoder: keep it
            self.blocks.grow(seq, end + extra)
            step.prefill_tokens[i] += extra
            budget -= extra

    def _reserve(self, seq: Sequence, num_tokens: int, queue: deque[Sequence], step: ScheduledStep) -> bool:
        """Grows `seq` to `num_tokens` slots, preempting the newest sequences not yet planned
        (`queue`'s tail), and `seq` itself as the last resort (then False)."""
        if self.blocks.covers(seq, num_tokens):
            return True
        while not self.blocks.can_grow(seq, num_tokens):
            victim = queue.pop() if queue else seq
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def _chunk(self, seq: Sequence, budget: int, queue: deque[Sequence], step: ScheduledStep) -> int:
        """Tokens of a running prefill that fit the budget and the free blocks (at least one, by
        preemption if need be; 0 if `seq` itself had to go); grows its table."""
        start = seq.num_computed_tokens
        if not self._reserve(seq, start + 1, queue, step):
            return 0
        # its cross-attention blocks (encoder-decoder) were taken at admission: only self-attention
        # slots are left to find
        room = (self.blocks.num_free_blocks + len(seq.block_table)) * self.blocks.block_size - start
        n = min(seq.prefill_target - start, budget, room)
        self.blocks.grow(seq, start + n)
        return n

    def _admit(self, budget: int, step: ScheduledStep, cap: int) -> int:
        """Newly admitted sequences (FCFS), each with a first chunk of what is left of the budget;
        returns the budget left.

        An encoder-decoder request runs its whole encoder in the step that admits it (the encoder is
        not chunked), so its encoder tokens are charged to the budget as well: a batch of long inputs
        is spread over several steps. One whose encoder alone exceeds what is left waits for a step
        with no other prefill, which admits it whatever its length, so that it cannot starve."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            encoder = seq.num_encoder_tokens
            if encoder and min(seq.num_tokens, budget) + encoder > budget and step.prefills:
                break
            # the prefix cache may hold its first blocks (never all of it: the last token must run
            # to give the first output's logits)
            cached = self.blocks.share_cached_prefix(seq, seq.num_tokens - 1)
            first = min(seq.num_tokens - cached, budget, cap if len(self.waiting) > 1 else budget)
            if not self.blocks.can_grow(seq, cached + first):
                self.blocks.free(seq)  # give the shared blocks back; it waits
                break
            self.waiting.popleft()
            self.blocks.record_prefix_lookup(seq.num_tokens - 1, cached)
            seq.start_prefill(cached)
            self.running.append(seq)
            self.blocks.grow(seq, cached + first)
            step.prefills.append(seq)
            step.prefill_tokens.append(first)
            budget -= first + encoder
        return budget

    def preempt_all(self) -> None:
        """Every running sequence back to the front of the waiting queue, in order, to be recomputed
        (after a failed step, whose half-done KV and counts cannot be trusted)."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # ---- completion ------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends `seq` wherever it is (running, or waiting: an aborted request) and frees its blocks."""
        seq.finish(reason)
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
