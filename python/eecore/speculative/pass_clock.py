"""What a machine's passes cost, measured while decoding: the draft planner's prices
(`eecore.speculative.draft_planner`, whose module doc says how the decoder times a round)."""
from __future__ import annotations

from typing import Optional


class PassClock:
    """Running averages of measured pass costs, in seconds: a verify pass by its rows, a copy pass."""

    DECAY = 0.8  # weight on the past: a few rounds ride out noise, a phase change passes in ~10

    def __init__(self):
        self._verify: dict[int, float] = {}
        # verify()'s answers since the last record_verify: a round plans every sequence at a few
        # row counts, and each answer would otherwise scan every row count measured
        self._estimates: dict[int, Optional[float]] = {}
        self.copy_pass: Optional[float] = None
        self.catch_up_token: float = 0.0  # until measured: drafting starts hopeful
        self.version = 0  # counts the changes of any cost (DraftPlanner caches what it derives from them)

    def record_verify(self, rows: int, seconds: float) -> None:
        self._verify[rows] = self._average(self._verify.get(rows), seconds)
        self._estimates.clear()
        self.version += 1

    def record_copy(self, passes: int, seconds: float) -> None:
        if passes > 0:
            self.copy_pass = self._average(self.copy_pass, seconds / passes)
            self.version += 1

    def record_catch_up(self, passes: int, tokens: int, seconds: float) -> None:
        """Draft passes that also ran `tokens` catch-up tokens: the time beyond `passes` plain copy
        passes is theirs (nothing is learned before a plain copy pass has been timed)."""
        if tokens > 0 and self.copy_pass is not None:
            extra = max(0.0, seconds - passes * self.copy_pass) / tokens
            self.catch_up_token = self._average(self.catch_up_token or None, extra)
            self.version += 1

    def verify(self, rows: int) -> Optional[float]:
        """The estimated cost of a verify pass of `rows` rows; None before anything is measured.
        No pass costs less than a narrower one, so an unmeasured row count costs what the widest
        measured below it does; and none costs more than a wider one: a measured figure above a
        wider pass's is stale (the planner stopped running that pass, so it is never timed again) or
        carried a one-time cost, and left standing it would keep the planner drafting at any
        acceptance (a plain step dearer than a round)."""
        if rows not in self._estimates:
            below = max((r for r in self._verify if r <= rows), default=None)
            estimate = None if below is None else self._verify[below]
            wider = [cost for r, cost in self._verify.items() if r > rows]
            if estimate is not None and wider:
                estimate = min(estimate, min(wider))
            self._estimates[rows] = estimate
        return self._estimates[rows]

    def _average(self, old: Optional[float], new: float) -> float:
        return new if old is None else self.DECAY * old + (1 - self.DECAY) * new
