"""Fused rounds' planning and books (eecore.speculative.fused_round), for a whole batch at once: a
mixin of DraftPlanner (eecore.speculative.draft_planner), whose costs, rates and records it uses.

A fused round runs every sequence at the round's length over passes the batch shares, so a length
is priced for the batch (each sequence at its own rates and budget) rather than sequence by
sequence, and a round's outcome is recorded for the batch in one loop, without the per-draft walk
a round op by op needs.
"""
from __future__ import annotations

import itertools

import numpy as np

from eecore.engine.sequence import Sequence

FIRST, LATER = 0, 1  # a round's first draft of a kind, and the ones after it


class BatchRounds:
    """DraftPlanner's plan_round and record_layer_rounds (see the module doc)."""

    def plan_round(self, seqs: list[Sequence], budgets: list[int], rooms: list[int], behinds: list[int]) -> int:
        """The length of a fused round of layer drafts (`shared_rounds`; 0: a plain step): the one
        with the most expected tokens per second for the whole batch, each sequence at its own
        rates and its budget, the round's passes and verify width shared. The batch is probed as
        `plan` probes a sequence: after a wait of plain rounds, one round at the length the prior
        would pay for. Also sets `all_quiet`."""
        B, most = len(seqs), min(max(budgets, default=0), self.max_length["layer"])
        plain, rounds, _ = self._prices(B, most, "layer") if most > 0 else (None, (), 0.0)
        if plain is None:
            self.all_quiet = False
            return 0
        first_prior, later_prior = self._prior("layer")
        a1, a2 = [], []
        w, slot = self.PRIOR_ROUNDS, self.states.slot
        for seq in seqs:  # each sequence's rates (as _rate computes them, inline: this runs for the whole batch)
            mine = slot(seq, "odds")
            if mine is None:
                a1.append(first_prior)
                a2.append(later_prior)
            else:
                hits, misses = mine["layer"].hits, mine["layer"].misses
                a1.append((hits[FIRST] + w * first_prior) / (hits[FIRST] + misses[FIRST] + w))
                a2.append((hits[LATER] + w * later_prior) / (hits[LATER] + misses[LATER] + w))
        token = self.clock.catch_up_token
        catch = [token * behind / max(1, min(room, self.CATCH_UP_HORIZON)) for room, behind in zip(rooms, behinds)] \
            if token else [0.0] * B
        length = self._round_length(a1, a2, catch, budgets, plain, rounds)
        if length:
            self._round_idle = 0
        else:
            self._round_idle += 1
            if self._round_idle >= self._round_wait:  # a probe at the prior's rates
                self._round_idle, self._round_wait = 0, min(2 * self._round_wait, self.MAX_PROBE_WAIT)
                length = self._round_length([first_prior] * B, [later_prior] * B, catch, budgets, plain, rounds)
        self.all_quiet = not length and self._round_idle + 1 < self._round_wait and \
            not self.clock.changes_next_round()
        return length

    @staticmethod
    def _round_length(a1: list[float], a2: list[float], catch: list[float], budgets: list[int], plain: float,
                      rounds: tuple) -> int:
        """plan_round's choice at rates a1, a2 and catch-up costs `catch` per sequence (a handful of
        array operations whatever the batch: at 64 sequences a loop over them and the lengths cost
        the host more than the round it plans)."""
        most, B = len(rounds), len(a1)
        catch_total = sum(catch)
        # a round of d drafts emits B + the sum over k < d of reach[i, k], the chance that sequence
        # i's draft k + 1 is accepted (none past its budget); its catch-up costs likewise
        if B * most <= 32:  # a few sequences: a loop costs the host less than array operations
            extra, extra_catch = [0.0] * most, [0.0] * most
            for first, later, c, budget in zip(a1, a2, catch, budgets):
                reach = first
                for k in range(min(most, budget)):
                    extra[k] += reach
                    extra_catch[k] += c * reach
                    reach *= later
            extra, extra_catch = list(itertools.accumulate(extra)), list(itertools.accumulate(extra_catch))
        else:
            reach = np.multiply.outer(a1, np.ones(most)) * np.power.outer(a2, np.arange(most))
            if min(budgets) < most:
                reach *= np.less.outer(np.arange(most), budgets).T
            extra = np.cumsum(reach.sum(axis=0)).tolist()
            extra_catch = np.cumsum(np.dot(catch, reach)).tolist() if catch_total else [0.0] * most
        best, best_rate = 0, B / plain
        for d in range(most):
            rate = (B + extra[d]) / (rounds[d] + catch_total + extra_catch[d])
            if rate > best_rate:
                best, best_rate = d + 1, rate
        return best

    def record_layer_rounds(self, seqs: list[Sequence], drafts: int, accepted: list[int]) -> None:
        """`record` for a fused round: each of `seqs` drafted `drafts` layer tokens and kept the first
        accepted[i] (the same bookkeeping as record's, without its per-draft walk; the priors' sums
        move once for the batch)."""
        self._prior_values.clear()
        forget, full, first_wait = self.FORGET, self.FULL_EVIDENCE, self.FIRST_PROBE_WAIT
        moved = [0.0, 0.0, 0.0, 0.0]  # the live shares' change: first hits, first misses, later hits, later misses
        get = self.states.get
        for seq, kept in zip(seqs, accepted):
            state = get(seq)
            odds = (state.odds if state is not None and state.odds is not None else self._seq(seq))["layer"]
            hits, misses, shares = odds.hits, odds.misses, odds.shares
            hit = kept > 0
            later_miss = hit and kept < drafts
            # the first draft, then the later ones (unrolled: this runs for every sequence of the batch)
            h = hits[FIRST] = forget * hits[FIRST] + (1.0 if hit else 0.0)
            m = misses[FIRST] = forget * misses[FIRST] + (0.0 if hit else 1.0)
            weight = 1.0 / max(h + m, full)
            old_hits, old_misses = shares[FIRST]
            shares[FIRST] = (h * weight, m * weight)
            moved[0] += h * weight - old_hits
            moved[1] += m * weight - old_misses
            h = hits[LATER] = forget * hits[LATER] + max(0, min(kept, drafts) - 1)
            m = misses[LATER] = forget * misses[LATER] + (1.0 if later_miss else 0.0)
            weight = 1.0 / max(h + m, full)
            old_hits, old_misses = shares[LATER]
            shares[LATER] = (h * weight, m * weight)
            moved[2] += h * weight - old_hits
            moved[3] += m * weight - old_misses
            if hit and not later_miss:
                odds.wait = first_wait
            odds.idle = 0
        for place, prior in enumerate(self._priors["layer"]):
            prior.live_hits += moved[2 * place]
            prior.live_misses += moved[2 * place + 1]
