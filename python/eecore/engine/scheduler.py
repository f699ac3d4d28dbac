"""Iteration-level (Orca-style) scheduling over the paged KV cache. No tensor code here.

Every step is either a prefill step or a decode step:
- prefill: sequences still in their prefill phase, then newly admitted ones (FCFS), each given a
  chunk of at most the remaining token budget, so a long prompt is split over several steps;
- decode: every running sequence advances by one model iteration (one token, or one draft and
  verify round in self-speculation, which needs `lookahead` slots).
Prefill runs first whenever some work is admissible: it keeps the running batch full. When a
decode step runs out of blocks, the newest running sequence is preempted (its KV is dropped and
recomputed on readmission) rather than failing the step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from eecore.engine.block_manager import BlockManager
from eecore.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    is_prefill: bool
    seqs: list[Sequence]
    # Tokens each sequence computes in this step (prefill chunks; 1 per sequence for decode).
    num_new_tokens: list[int]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int = 1):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Slots a decode step may write past the pending token (self-speculation drafts ahead).
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        step = self._schedule_prefill()
        if step is not None:
            return step
        return self._schedule_decode()

    # ---- prefill ---------------------------------------------------------------------------
    def _schedule_prefill(self) -> ScheduledStep | None:
        budget = self.max_num_batched_tokens
        seqs, counts = [], []
        for seq in self.running:  # unfinished chunked prefills first
            if budget == 0:
                break
            if seq.in_prefill:
                n = self._chunk(seq, budget)
                if n == 0:
                    break
                seqs.append(seq)
                counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            target = seq.num_tokens
            first_chunk = min(target, budget)
            if not self.blocks.can_grow(seq, first_chunk):
                break
            self.waiting.popleft()
            seq.start_prefill()
            self.running.append(seq)
            n = self._chunk(seq, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        if not seqs:
            return None
        return ScheduledStep(is_prefill=True, seqs=seqs, num_new_tokens=counts)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq`'s prefill that fit the budget and the free blocks; grows its table."""
        n = min(seq.prefill_target - seq.num_computed_tokens, budget)
        while n > 0 and not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
            n = (self.blocks.num_free_blocks + len(seq.block_table)) * self.blocks.block_size - seq.num_computed_tokens
        if n > 0:
            self.blocks.grow(seq, seq.num_computed_tokens + n)
        return max(n, 0)

    # ---- decode ----------------------------------------------------------------------------
    def _schedule_decode(self) -> ScheduledStep | None:
        preempted: list[Sequence] = []
        scheduled: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            need = seq.num_tokens + self.lookahead - 1
            while not self.blocks.can_grow(seq, need):
                victim = queue.pop() if queue else seq  # newest first; self as the last resort
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, need)
                scheduled.append(seq)
        if not scheduled:
            return ScheduledStep(is_prefill=False, seqs=[], num_new_tokens=[], preempted=preempted) if preempted else None
        return ScheduledStep(is_prefill=False, seqs=scheduled, num_new_tokens=[1] * len(scheduled),
                             preempted=preempted)

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

    def num_unfinished(self) -> int:
        return len(self.waiting) + sum(1 for s in self.running if s.status != SequenceStatus.FINISHED)
