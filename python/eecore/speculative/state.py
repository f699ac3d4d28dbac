"""What self-speculation keeps about each running sequence between its rounds, in one object.

Each part of a round that learns about a sequence (the acceptance guard, the draft-length rule, the
draft planner, the draft copy's K/V bookkeeping, prompt lookup's n-gram index) keeps its record in a
slot of the sequence's `SequenceState`, so a sequence's whole speculative state is one object to
inspect, and a finished or aborted sequence leaves nothing behind once the decoder releases it.
The parts share one `SequenceStates`; built alone (as the tests build them) each makes its own.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from eecore.engine.sequence import Sequence


@dataclass
class SequenceState:
    guard: Any = None                          # SpeculationGuard's record (guard._SequenceGuard)
    first_draft_rate: Optional[float] = None   # DraftLength's running rate of accepted first drafts
    odds: Optional[dict] = None                # DraftPlanner's acceptance odds, by draft kind
    copy: Optional[list[int]] = None           # DraftStack's: [preemptions then, right K/V up to, written up to]
    index: Any = None                          # prompt lookup's NgramIndex of the sequence's tokens
    fused: Optional[list[int]] = None          # RoundRecorder's counts of fused rounds: [rounds, drafted, accepted]
    features: Any = None                       # FeatureProposer's: the target's tapped streams at the last verified position


SLOTS = tuple(f.name for f in fields(SequenceState))


class SequenceStates:
    """The running sequences' states, by sequence id."""

    def __init__(self):
        self._states: dict[int, SequenceState] = {}

    def of(self, seq: Sequence) -> SequenceState:
        """`seq`'s state, made empty on first use."""
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = SequenceState()
        return state

    def get(self, seq: Sequence) -> Optional[SequenceState]:
        return self._states.get(seq.seq_id)

    def slot(self, seq: Sequence, name: str):
        """`seq`'s record in slot `name`, None where there is none."""
        state = self._states.get(seq.seq_id)
        return None if state is None else getattr(state, name)

    def clear_slot(self, seq: Sequence, name: str):
        """Empties `seq`'s slot `name`; returns what it held."""
        state = self._states.get(seq.seq_id)
        if state is None:
            return None
        held = getattr(state, name)
        setattr(state, name, None)
        return held

    def count(self, name: str) -> int:
        """Sequences with a record in slot `name`."""
        return sum(getattr(s, name) is not None for s in self._states.values())

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def __len__(self) -> int:
        return len(self._states)
