"""Draft lengths chosen from what this machine's passes cost (`SelfSpeculativeConfig(adaptive=True)`).

A round pays only when it emits more tokens per second than a plain step, and what its passes
cost depends on the weights and the hardware more than on the drafts. On 2 Zen 4 cores with
SmolLM2-135M (bench/cost_round.py verify-rows), a full-depth pass over 2 / 5 rows costs 1.70 / 2.39
one-row passes on the Q4_1 file's exact kernel (fp32 products: arithmetic-bound past one row),
1.06 / 1.51 with 8-bit activations and about 1.1 / 1.2 on dequantized fp32 weights; a pass of the
exit-ready draft copy costs 0.29-0.42 of a step. No fixed draft length suits all three: d = 4
pays on fp32 weights and loses on the exact Q4_1 kernel, where a layer draft cannot pay at all.

So the planner measures the costs where it runs, and chooses each sequence's draft length per
round and per draft kind (layer drafts from the copy, prompt-lookup drafts):

- costs (`PassClock`): the wall time of every round, less its draft passes, is the verify pass's
  cost for the rows it verified (a plain step is a pass of one row per sequence); the draft
  passes' time over their count is the copy pass's cost, and what a pass that first catches the
  copy up (on the prompt, or on tokens decoded without it) takes beyond that is the cost of a
  catch-up token. Each is a running average. Every round ends by reading its tokens on the host,
  so wall time is right on a GPU as well; a round that captured a CUDA graph (the first of its
  shape) paid a one-time cost and teaches nothing. A pass not timed for 64 rounds while its
  batch's plain step moved is scaled with the plain step. A row count not yet measured is
  estimated at the cost of the widest one measured below it (the cheapest it could be), so that
  the planner tries it and learns its cost, and no row count costs more than a wider one measured;
- acceptance: per sequence and kind, two rates: that a round's first draft of the kind is
  accepted (a1), and that a later one is when every draft before it was (a2). A prompt-lookup
  draft is either a wrong guess (its first token fails) or a copy of text that goes on (its later
  tokens rarely fail), so one rate for both would misjudge every length. Each is a running sum of
  hits and misses that forgets, with six rounds' worth of what recent sequences measured as its
  prior (`_Prior`: each sequence counts once, so one request whose drafts fail does not stop the
  next ones from drafting);
- choice: a chain of d drafts emits E(d) = 1 + a1 (1 + a2 + ... + a2^(d-1)) tokens and costs the
  verify pass of its rows plus, for layer drafts, d copy passes and the copy's catch-up on the
  tokens it is behind, spread over the rounds left to earn it back (the tokens the sequence may
  still emit, at most 64, over E(d)); the planner takes the d with the most tokens per second, 0
  being a plain step. In a batch, a sequence is planned as if the others verified one row each;
  with fused rounds, whose passes and verify width serve the whole batch, as if every sequence
  drafted the length at its rates (a round's length is the longest any sequence is planned).
- probes: a sequence planned at 0 for a kind stops learning about it, so after a wait it drafts
  that kind as far as the prior would pay (none if it would not); the wait doubles while probes
  fail (32 to 128 rounds), and a round whose drafts of the kind were all accepted resets it. The
  prior drifts back to hopeful while nobody drafts, so that a workload that turns to text where
  drafts pay (chat, then code) starts drafting again.

Greedy outputs do not depend on the drafts, so every choice keeps them the full model's; sampled
outputs keep its law.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from eecore.engine.sequence import Sequence
from eecore.speculative.draft import Draft
from eecore.speculative.pass_clock import PassClock
from eecore.speculative.round_planning import FIRST, LATER, BatchRounds
from eecore.speculative.state import SequenceStates

KINDS = ("layer", "lookup", "feature")


@dataclass
class _Odds:
    """One sequence's record for one draft kind: hits and misses of first and later drafts."""
    hits: list = field(default_factory=lambda: [0.0, 0.0])
    misses: list = field(default_factory=lambda: [0.0, 0.0])
    idle: int = 0            # rounds planned at 0 since it last drafted this kind
    wait: int = 0            # rounds planned at 0 before a probe (DraftPlanner sets the first)
    shares: list = field(default_factory=lambda: [(0.0, 0.0), (0.0, 0.0)])  # its (hits, misses) in the prior


class _Prior:
    """What recent sequences measured for one draft kind and place, each sequence counting once: the
    prior of new sequences and of probes. A running rate over all drafts would let one request
    whose drafts fail speak for every request after it (one code prompt the copy does badly on: the
    prior falls below what a draft needs, the next requests never draft, so never measure their
    own, and the prior hardly recovers). So every sequence adds its own rate, weighed by how much
    it has seen (fully from a few rounds on): the live ones as they stand, the released ones fading
    out over the next few releases. It starts hopeful (0.8, worth two sequences), so that the first
    sequences draft and measure instead of waiting for probes, and drifts back there while nobody
    drafts (`relax`), so that a workload that turns to text where drafts pay finds out."""
    HOPEFUL_HITS, HOPEFUL_MISSES = 1.6, 0.4
    # a sequence's rate counts as min(1, judged / FULL_EVIDENCE) sequences, `judged` its drafts
    # judged so far (forgetting as its own record does)
    FULL_EVIDENCE = 3.0
    RELEASE_FORGET = 0.8     # per released sequence (with evidence): about the last five count

    def __init__(self):
        self.hits, self.misses = self.HOPEFUL_HITS, self.HOPEFUL_MISSES  # released sequences'
        self.live_hits = self.live_misses = 0.0                           # live sequences' shares

    def value(self) -> float:
        hits = self.hits + self.live_hits
        return hits / (hits + self.misses + self.live_misses)

    def release(self, share: tuple[float, float], last: bool) -> None:
        """A sequence ended: its share moves from the live ones to the released ones (`last`: no live
        sequence is left, so the live sums are exactly zero, whatever rounding they gathered)."""
        self.live_hits -= share[0]
        self.live_misses -= share[1]
        if last:
            self.live_hits = self.live_misses = 0.0
        if share[0] + share[1] > 0.0:
            self.hits = self.RELEASE_FORGET * self.hits + share[0]
            self.misses = self.RELEASE_FORGET * self.misses + share[1]

    def relax(self, keep: float) -> None:
        self.hits = keep * self.hits + (1 - keep) * self.HOPEFUL_HITS
        self.misses = keep * self.misses + (1 - keep) * self.HOPEFUL_MISSES


class DraftPlan(NamedTuple):
    """A sequence's caps for this round: the most tokens it may draft by lookup, by layers, and by
    a feature head (the planner gives a sequence layer or feature drafts in a round, not both)."""
    lookup: int
    layer: int
    feature: int = 0


NO_DRAFTS = DraftPlan(0, 0, 0)


def never_drafts(seq: Sequence) -> bool:
    """A seeded sampled request: under adaptive planning it never drafts. Its tokens follow its drafts
    (rejection sampling) and the planner's lengths follow the machine's timings, so with drafts
    its seed would not reproduce its output; without them it is full depth's for that seed."""
    return seq.params.seed is not None and not seq.params.greedy


class DraftPlanner(BatchRounds):
    """Per sequence and round, how many tokens to draft of each kind (see the module doc); the
    decoder calls new_round, plan for each sequence, record after each verified round, release
    when a sequence ends."""

    FORGET = 0.9             # per recorded round: about the last 10 rounds count
    PRIOR_ROUNDS = 6.0       # the prior counts as this many rounds of a sequence's own
    FIRST_PROBE_WAIT = 32
    MAX_PROBE_WAIT = 128
    FULL_EVIDENCE = _Prior.FULL_EVIDENCE  # (what BatchRounds reads)
    RELAX = 0.998            # per round: the released sequences' rates are back near hopeful after ~1,000 rounds

    def __init__(self, max_layer: int, max_lookup: int, states: Optional[SequenceStates] = None,
                 shared_rounds: bool = False, max_feature: int = 0,
                 feature_rows: Optional[Callable[[int], int]] = None):
        """`shared_rounds`: the batch's rounds are fused (eecore.speculative.fused_round), so every
        sequence verifies the round's length and the round's passes serve all of them: a length is
        priced as if every sequence of the batch drafted it at the sequence's rates. `max_feature`:
        the longest feature-head draft, `feature_rows(d)` the rows a feature draft of d positions
        verifies (SelfSpeculativeConfig.feature_tree_nodes: its token tree's; default d)."""
        self.max_length = {"layer": max_layer, "lookup": max_lookup, "feature": max_feature}
        chain = (lambda d: d)
        self._rows = {"layer": chain, "lookup": chain, "feature": feature_rows or chain}
        self.shared_rounds = shared_rounds
        self._kinds = [kind for kind in KINDS if self.max_length[kind] > 0]  # the kinds it plans
        self.clock = PassClock()
        self._priors = {kind: (_Prior(), _Prior()) for kind in KINDS}
        # each sequence's acceptance odds by kind (SequenceState.odds: kind -> _Odds)
        self.states = SequenceStates() if states is None else states
        self._prices_stamp: tuple = (None, -1)  # the clock and its version _price_list was derived at
        self._price_list: dict[tuple, tuple] = {}
        self._prior_values: dict[str, tuple[float, float]] = {}  # _prior's answers until a prior changes
        self.all_quiet = False  # whether every sequence of the last plan_all was quiet
        # plan_round's probes of the whole batch: plain rounds since the last drafting one, and the wait
        self._round_idle, self._round_wait = 0, self.FIRST_PROBE_WAIT

    # ---- planning ----------------------------------------------------------------------------
    # tokens over which a catch-up's cost is spread, at most: a longer reply earns it back sooner
    # than it can be measured to
    CATCH_UP_HORIZON = 64

    def plan(self, seq: Sequence, batch: int, budget: int, room: int, behind: int = 0) -> DraftPlan:
        """The caps for `seq` this round: `batch` sequences decoding, at most `budget` drafts, `room`
        tokens it may still emit, `behind` tokens the copy must catch up on before it drafts."""
        return self.plan_all([seq], batch, [budget], [room], [behind])[0]

    def plan_all(self, seqs: list[Sequence], batch: int, budgets: list[int], rooms: list[int],
                 behinds: list[int]) -> list[DraftPlan]:
        """`plan` for each of a round's sequences, in one loop that derives what they share (the
        prices, the priors) once: a round plans every running sequence, and at large batches the
        planning would otherwise cost the host more than the plain step it so often decides on.
        Also sets `all_quiet` (see `quiet`) for these sequences."""
        plans, shared, kinds, states = [], {}, self._kinds, self.states
        quiet = not self.clock.changes_next_round()
        for seq, budget, room, behind in zip(seqs, budgets, rooms, behinds):
            if never_drafts(seq):
                plans.append(NO_DRAFTS)
                continue
            lookup = layer = feature = 0
            by_layer = by_feature = 0.0  # their expected tokens a second
            mine = states.slot(seq, "odds")
            for kind in kinds:
                most = min(budget, self.max_length[kind])
                if most > 0:
                    prices = shared.get((kind, most))
                    if prices is None:
                        prices = shared[kind, most] = self._prices(batch, most, kind) + self._prior(kind)
                    if mine is None:
                        mine = self._seq(seq)
                    length, rate = self._length(mine[kind], kind, batch, prices, room, behind)
                    if kind == "layer":
                        layer, by_layer = length, rate
                    elif kind == "feature":
                        feature, by_feature = length, rate
                    else:
                        lookup = length
            if layer and feature:  # the copy or the head, whichever emits more tokens a second
                layer, feature = (0, feature) if by_feature > by_layer else (layer, 0)
            plans.append(DraftPlan(lookup, layer, feature) if lookup or layer or feature else NO_DRAFTS)
            quiet = quiet and self._no_probe_next(mine)
        self.all_quiet = quiet
        return plans

    def _catch_up(self, room: int, behind: int) -> float:
        """The copy's catch-up in seconds, times the tokens a round emits (a cost per round of
        min(room, horizon) / E(d) rounds)."""
        return self.clock.catch_up_token * behind / max(1, min(room, self.CATCH_UP_HORIZON))

    def acceptance(self, seq: Sequence, kind: str) -> tuple[float, float]:
        """(a1, a2): the rates at which `seq`'s first and later drafts of `kind` are accepted."""
        mine = self.states.slot(seq, "odds")
        odds = mine[kind] if mine else None
        first, later = self._prior(kind)
        return self._rate(odds, FIRST, first), self._rate(odds, LATER, later)

    def _rate(self, odds: Optional[_Odds], place: int, prior: float) -> float:
        """How often drafts at `place` are accepted: a sequence's own hits and misses (none: the
        prior alone), with the prior counting as PRIOR_ROUNDS rounds."""
        hits, misses = (odds.hits[place], odds.misses[place]) if odds is not None else (0.0, 0.0)
        w = self.PRIOR_ROUNDS
        return (hits + w * prior) / (hits + misses + w)

    def _prior(self, kind: str) -> tuple[float, float]:
        values = self._prior_values.get(kind)
        if values is None:
            values = self._prior_values[kind] = (self._priors[kind][FIRST].value(), self._priors[kind][LATER].value())
        return values

    def new_round(self) -> None:
        """Called once per round, before planning it."""
        self._prior_values.clear()
        for priors in self._priors.values():
            for prior in priors:
                prior.relax(self.RELAX)

    def best_length(self, acceptance: tuple[float, float], batch: int, most: int, copy_passes: bool,
                    catch_up: float = 0.0) -> int:
        """The draft length d in 0..most with the most expected tokens per second at rates
        `acceptance` (a1, a2) and the clock's costs (`catch_up`: see _catch_up), the other `batch` - 1
        sequences verifying one row each; 0 until a plain step of `batch` rows (or fewer) was timed."""
        if most <= 0:
            return 0
        return self._best(self._prices(batch, most, "layer" if copy_passes else "lookup"), acceptance, batch,
                          catch_up)[0]

    def _best(self, prices: tuple, acceptance: tuple[float, float], batch: int, catch_up: float
              ) -> tuple[int, float]:
        """best_length at `prices` (_prices), and its expected tokens a second."""
        plain, rounds, floor = prices[:3]
        first, later = acceptance
        if plain is None or first < floor:
            return 0, 0.0  # nothing timed yet, or no length pays even if every draft after the first were accepted
        best, best_rate = 0, batch / plain
        tokens, reach = float(batch), first  # reach: the chance that the d-th draft is accepted
        # whose tokens a round's cost buys: this sequence's alone, or every sequence's (shared rounds)
        drafting, shared = (batch, True) if self.shared_rounds else (1, False)
        for d, cost in enumerate(rounds, 1):
            tokens += reach * drafting
            reach *= later
            rate = tokens / (cost + catch_up * (tokens if shared else tokens - batch + 1))
            if rate > best_rate:
                best, best_rate = d, rate
        return best, best_rate

    def _prices(self, batch: int, most: int, kind: str) -> tuple:
        """(the plain step's cost, the cost of a round of d = 1..most drafts without catch-up, the
        first-draft rate a1 at or below which no length pays) at the clock's costs. The last: with
        every later draft accepted (a2 = 1) and no catch-up, the best any rates can do, a round of
        d drafts emits batch + a1 d tokens at cost verify(batch + d) + d copy passes, against batch
        tokens at verify(batch); where drafting is off (failing drafts, or rounds dearer than their
        tokens) most sequences stop there instead of pricing every length. The same for all of a
        round's sequences, so derived once a round (once per change of the clock's costs). A draft
        of `kind` costs its pass (a copy's or a feature head's; lookup none) and verifies that many
        rows a position (a token tree's)."""
        stamp = (self.clock, self.clock.version)
        if self._prices_stamp != stamp:
            self._prices_stamp, self._price_list = stamp, {}
        key = (batch, most, kind)
        prices = self._price_list.get(key)
        if prices is None:
            plain = self.clock.verify(batch)
            if plain is None:
                prices = (None, (), 0.0)
            else:
                copy = self.clock.draft_pass(kind)
                # the sequences drafting: this one beside one row each, or everyone (shared rounds);
                # each drafted position verifies its tree's rows, and emits at most one token
                width = batch if self.shared_rounds else 1
                rows = self._rows[kind]
                rounds = tuple(self.clock.verify(batch + width * rows(d)) + d * copy for d in range(1, most + 1))
                floor = min(batch * (cost - plain) / (width * d * plain) for d, cost in enumerate(rounds, 1))
                prices = (plain, rounds, floor - abs(floor) * 1e-9 - 1e-12)  # below it for sure, whatever the rounding
            self._price_list[key] = prices
        return prices

    def _length(self, odds: _Odds, kind: str, batch: int, prices: tuple, room: int, behind: int
                ) -> tuple[int, float]:
        """The length of `kind` drafts for a sequence with `odds`, or its probe, and its expected
        tokens a second; `prices`: _prices's plain step, round costs and floor, then the prior's
        two rates."""
        plain, _, floor, first_prior, later_prior = prices
        first = self._rate(odds, FIRST, first_prior)
        catch_up = 0.0
        if plain is not None and first >= floor:  # (below the floor no length pays: the usual case off)
            later = self._rate(odds, LATER, later_prior)
            if kind == "layer":
                catch_up = self._catch_up(room, behind)
            best = self._best(prices, (first, later), batch, catch_up)
            if best[0] > 0:
                return best
        odds.idle += 1
        if odds.idle < odds.wait:
            return 0, 0.0
        odds.idle = 0
        odds.wait = min(2 * odds.wait, self.MAX_PROBE_WAIT)
        # a probe: the length that would pay at the prior (recent sequences' rates), so that one
        # round says whether this one's is back; none where even those would not pay (chat alone,
        # or layer drafts on an exact 4-bit kernel on a CPU)
        if kind == "layer":
            catch_up = self._catch_up(room, behind)
        return self._best(prices, (first_prior, later_prior), batch, catch_up)

    def quiet(self, seq: Sequence) -> bool:
        """Whether `seq`, planned no drafts this round, will be planned none in the next as well,
        its rates and the costs staying as they are: it has been planned before, no probe of a kind
        it may draft falls due, and the clock scales no stale cost at this round's end (a sequence
        that never drafts is quiet). `all_quiet` says it of a whole plan_all."""
        return never_drafts(seq) or (not self.clock.changes_next_round() and
                                     self._no_probe_next(self.states.slot(seq, "odds")))

    def _no_probe_next(self, mine: Optional[dict[str, _Odds]]) -> bool:
        """A sequence with record `mine` has been planned, and planned at 0 next round no kind it
        may draft probes."""
        if mine is None:
            return False
        for kind in self._kinds:
            odds = mine[kind]
            if odds.idle + 1 >= odds.wait:
                return False
        return True

    # ---- learning ----------------------------------------------------------------------------
    def record(self, seq: Sequence, draft: Optional[Draft], accepted: int) -> None:
        """A verified round of `seq`: its draft and how many of its leading drafts were accepted."""
        if draft is None:
            return
        # per kind, [first hit, first miss, later hits, later misses]: every draft up to the first
        # rejected one was judged
        outcome: dict[str, list[int]] = {}
        sources = draft.from_lookup
        if sources and not any(sources):  # layer or feature drafts alone (a batch's usual round), counted at once
            n, hit = len(sources), accepted > 0
            outcome[draft.source] = [int(hit), int(not hit), max(0, min(accepted, n) - 1), int(hit and accepted < n)]
            sources = ()
        for i, from_lookup in enumerate(sources[: accepted + 1]):
            kind = "lookup" if from_lookup else draft.source
            counts = outcome.get(kind)
            if counts is None:
                counts = outcome[kind] = [0, 0, 0, 0]
                counts[0 if i < accepted else 1] += 1
            else:
                counts[2 if i < accepted else 3] += 1
        if draft.copy_ran and "layer" not in outcome and len(draft) <= accepted:
            # the copy ran and its draft was dropped below the threshold: a pass paid for nothing
            outcome["layer"] = [0, 1, 0, 0]
        mine = self._seq(seq)
        self._prior_values.clear()
        forget, full = self.FORGET, _Prior.FULL_EVIDENCE
        for kind, counts in outcome.items():
            odds, priors = mine[kind], self._priors[kind]
            all_hits, all_misses, shares = odds.hits, odds.misses, odds.shares
            for place in (FIRST, LATER):
                hits = all_hits[place] = forget * all_hits[place] + counts[2 * place]
                misses = all_misses[place] = forget * all_misses[place] + counts[2 * place + 1]
                # its share of the prior (_Prior): its rate, counting as min(1, seen / full) sequences
                seen = hits + misses
                weight = 1.0 / (full if seen < full else seen)
                prior, (old_hits, old_misses) = priors[place], shares[place]
                shares[place] = (hits * weight, misses * weight)
                prior.live_hits += hits * weight - old_hits
                prior.live_misses += misses * weight - old_misses
            if not counts[1] and not counts[3]:  # this kind pays again: probes start over from the first wait
                odds.wait = self.FIRST_PROBE_WAIT
            odds.idle = 0

    def _seq(self, seq: Sequence) -> dict[str, _Odds]:
        state = self.states.of(seq)
        if state.odds is None:
            state.odds = {kind: _Odds(wait=self.FIRST_PROBE_WAIT) for kind in KINDS}
        return state.odds

    def release(self, seq: Sequence) -> None:
        mine = self.states.clear_slot(seq, "odds")
        if mine is not None:
            self._prior_values.clear()
            last = self.states.count("odds") == 0
            for kind, odds in mine.items():
                for place in (FIRST, LATER):
                    self._priors[kind][place].release(odds.shares[place], last=last)

    def __len__(self) -> int:
        return self.states.count("odds")
