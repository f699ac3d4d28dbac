"""What a machine's passes cost, measured while decoding: the draft planner's prices
(`eecore.speculative.draft_planner`, whose module doc says how the decoder times a round)."""
from __future__ import annotations

from typing import Callable, Optional


class PassClock:
    """Running averages of measured pass costs, in seconds: a verify pass by its rows, a copy pass,
    a feature head's pass."""

    DECAY = 0.8  # weight on the past: a few rounds ride out noise, a phase change passes in ~10
    # A pass the planner stopped running keeps the time it took then, while the machine's speed
    # drifts (warming up, a neighbour's memory traffic): a 2-row pass timed in a slow phase kept
    # drafts dearer than they were for hundreds of rounds. So a wider pass not timed for
    # STALE_ROUNDS rounds, whose batch's plain step has since moved by more than DRIFT, is scaled
    # by the plain step's move (the machine's speed, not the pass's shape, is what changed). Where
    # the plain step holds still (a GPU that stopped drafting because rounds do not pay there)
    # nothing changes. (Forgetting such a pass instead, to price it from below and time it again,
    # made drafts look nearly free once a phase changed, and requests whose drafts fail drafted.)
    STALE_ROUNDS = 64
    DRIFT = 0.05

    def __init__(self):
        self._verify: dict[int, float] = {}
        # per row count of a pass wider than its batch's plain step: (the round it was last timed or
        # scaled in, its batch, that batch's plain step then)
        self._timed: dict[int, tuple[int, int, float]] = {}
        self._drifted: list[tuple[int, float]] = []  # (rows, plain step now): the next record_verify scales them
        self.rounds = 0  # record_verify calls
        # verify()'s answers since the last record_verify: a round plans every sequence at a few
        # row counts, and each answer would otherwise scan every row count measured
        self._estimates: dict[int, Optional[float]] = {}
        self.copy_pass: Optional[float] = None
        self.feature_pass: Optional[float] = None  # a feature head's step (eecore.speculative.feature_drafts)
        self.catch_up_token: float = 0.0  # until measured: drafting starts hopeful
        self.version = 0  # counts the changes of any cost (DraftPlanner caches what it derives from them)
        # Under tensor parallelism every rank plans the same rounds, so every rank must price them
        # alike: each measured time goes through `shared` (rank 0's measurement on every rank).
        self.shared: Callable[[float], float] = lambda seconds: seconds

    def record_verify(self, rows: int, seconds: float, batch: Optional[int] = None) -> None:
        """A verify pass of `rows` rows for `batch` sequences (a plain step where they are equal, the
        default) took `seconds`."""
        seconds = self.shared(seconds)
        self.rounds += 1
        for stale, plain in self._drifted:
            at, b, then = self._timed[stale]
            self._verify[stale] *= plain / then
            self._timed[stale] = (self.rounds, b, plain)
        self._verify[rows] = self._average(self._verify.get(rows), seconds)
        plain = self._verify.get(batch) if batch is not None and batch < rows else None
        if plain is not None:
            self._timed[rows] = (self.rounds, batch, plain)
        else:
            self._timed.pop(rows, None)  # a plain step (or one with nothing to compare): timed as it runs
        # decided here, done at the next record, so that DraftPlanner.quiet knows of it a round ahead
        self._drifted = [(r, self._verify[b]) for r, (at, b, then) in self._timed.items()
                         if r != rows and self.rounds + 1 - at >= self.STALE_ROUNDS and b in self._verify
                         and abs(self._verify[b] - then) > self.DRIFT * then]
        self._estimates.clear()
        self.version += 1

    def changes_next_round(self) -> bool:
        """Whether the next record_verify scales a drifted pass's cost (so that plans may change with
        no new timing of it: DraftPlanner.quiet asks)."""
        return bool(self._drifted)

    def record_copy(self, passes: int, seconds: float) -> None:
        seconds = self.shared(seconds)
        if passes > 0:
            self.copy_pass = self._average(self.copy_pass, seconds / passes)
            self.version += 1

    def record_feature(self, passes: int, seconds: float) -> None:
        seconds = self.shared(seconds)
        if passes > 0:
            self.feature_pass = self._average(self.feature_pass, seconds / passes)
            self.version += 1

    def draft_pass(self, kind: str) -> float:
        """What one draft pass of `kind` costs ("layer": the copy's, "feature": the head's, "lookup":
        nothing; 0 until timed: drafting starts hopeful)."""
        cost = self.copy_pass if kind == "layer" else self.feature_pass if kind == "feature" else None
        return cost or 0.0

    def record_catch_up(self, passes: int, tokens: int, seconds: float) -> None:
        """Draft passes that also ran `tokens` catch-up tokens: the time beyond `passes` plain copy
        passes is theirs (nothing is learned before a plain copy pass has been timed)."""
        seconds = self.shared(seconds)
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
