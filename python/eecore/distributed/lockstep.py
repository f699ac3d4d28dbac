"""Every tensor-parallel rank runs the same engine, step for step.

Rank 0's engine (`LeaderEngine`) is the one users and the server drive. Before each step it sends
the others what changed since the last one (requests queued, aborted, a failed step's recovery)
and a fingerprint of the last step's outcome; each worker (`follow`) applies the same changes to
its own engine and steps it. The scheduler, the strategies and the sampler then make the same
decisions on every rank, because everything they decide from is the same there: the requests, the
tokens (logits are gathered whole on every rank), the exit checks' statistics (one all-gather), and
the draft planner's timings (rank 0's, `PassClock.shared`). A worker whose last outcome differs from
rank 0's stops with an error naming the step instead of running collectives out of step.
"""
from __future__ import annotations

import threading
from typing import Optional, Union

from eecore.distributed.group import STEP, STOP, TensorParallelError, TensorParallelGroup
from eecore.engine.llm_engine import LLMEngine
from eecore.engine.sequence import Sequence
from eecore.sampling_params import SamplingParams

_FAILED = -1  # the fingerprint of a step that raised


def outcome(numbers: list[int], seqs: list[Sequence]) -> int:
    """A fingerprint of a step's results: each sequence's number, length, last token and whether it
    finished (ints only, so the hash is the same in every process)."""
    return hash(tuple((n, s.num_tokens, s.output_token_ids[-1] if s.output_token_ids else -1, s.is_finished)
                      for n, s in zip(numbers, seqs)))


class LeaderEngine(LLMEngine):
    """Rank 0's engine: an LLMEngine whose changes and steps the other ranks follow."""

    def __init__(self, *args, group: TensorParallelGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group
        self._changes: list[tuple] = []
        self._numbers: dict[int, int] = {}  # id(seq) -> its number on every rank
        self._next_number = 0
        self._last = 0
        self._lock = threading.Lock()  # the server queues from its request threads
        self._stopped = False

    def enqueue(self, prompt: Union[str, list[int]], token_ids: list[int], params: SamplingParams,
                index: int) -> Sequence:
        seq = super().enqueue(prompt, token_ids, params, index)
        with self._lock:
            number = self._numbers[id(seq)] = self._next_number
            self._next_number += 1
            self._changes.append(("enqueue", number, prompt, token_ids, params, index))
        return seq

    def abort_request(self, seq: Sequence) -> bool:
        aborted = super().abort_request(seq)
        if aborted:
            with self._lock:
                self._changes.append(("abort", self._numbers.pop(id(seq))))
        return aborted

    def recover_from_failed_step(self) -> list[Sequence]:
        suspects = super().recover_from_failed_step()
        with self._lock:
            self._changes.append(("recover",))
        return suspects

    def step(self) -> list[Sequence]:
        if self._stopped or self.group.failed:
            raise TensorParallelError("the tensor-parallel workers were shut down, or a rank failed before")
        with self._lock:
            changes, self._changes = self._changes, []
        self.group.send_control(STEP, (changes, self._last))
        self._last = _FAILED
        seqs = super().step()
        numbers = [self._numbers[id(s)] for s in seqs]
        self._last = outcome(numbers, seqs)
        for seq in seqs:
            if seq.is_finished:
                self._numbers.pop(id(seq), None)
        return seqs

    def shutdown(self) -> None:
        """Tells the workers to exit (their engines end with the process); after a failed collective
        nothing is sent (the launcher ends the workers)."""
        if not self._stopped:
            self._stopped = True
            if not self.group.failed:
                self.group.send_control(STOP)


def follow(engine: LLMEngine, group: TensorParallelGroup) -> None:
    """A worker's life after its engine is built: rank 0's changes and steps, until it says stop."""
    seqs: dict[int, Sequence] = {}  # rank 0's numbers -> this rank's sequences
    numbers_of: dict[int, int] = {}  # id(sequence) -> its number
    last, step = 0, 0
    while True:
        kind, payload = group.receive_control()
        if kind == STOP:
            return
        if kind != STEP:
            raise TensorParallelError(f"tensor parallel rank {group.rank}: unknown control message {kind}")
        changes, leader_last = payload
        if leader_last != last:
            raise TensorParallelError(
                f"tensor parallel rank {group.rank} left lockstep with rank 0 at step {step}: the ranks' last "
                "outcomes differ (a decision made from a value that is not the same on every rank)")
        for change in changes:
            seq = _apply(engine, seqs, change)
            if change[0] == "enqueue":
                numbers_of[id(seq)] = change[1]
            elif change[0] == "abort" and seq is not None:
                numbers_of.pop(id(seq), None)
        step += 1
        last = _FAILED
        try:
            results = engine.step()
        except TensorParallelError:
            raise
        except Exception:  # noqa: BLE001: rank 0's step raised the same; its recovery comes as a change
            continue
        numbers = [numbers_of[id(s)] for s in results]
        last = outcome(numbers, results)
        for n, seq in zip(numbers, results):
            if seq.is_finished:
                numbers_of.pop(id(seqs.pop(n)), None)


def _apply(engine: LLMEngine, seqs: dict[int, Sequence], change: tuple) -> Optional[Sequence]:
    kind = change[0]
    if kind == "enqueue":
        _, number, prompt, token_ids, params, index = change
        seqs[number] = engine.enqueue(prompt, token_ids, params, index)
        return seqs[number]
    if kind == "abort":
        seq = seqs.pop(change[1], None)
        if seq is not None:
            engine.abort_request(seq)
        return seq
    if kind == "recover":
        engine.recover_from_failed_step()
        return None
    raise TensorParallelError(f"unknown engine change {kind!r}")
