"""Draft lengths from measured pass costs (SelfSpeculativeConfig(adaptive=True),
eecore.speculative.draft_planner): the cost model's choices, what it learns from rounds, and that
outputs stay full depth's whatever it chooses."""
from __future__ import annotations

import pytest

import eecore
from eecore.engine.sequence import Sequence
from eecore.speculative.draft import Draft
from eecore.speculative.draft_planner import DraftPlan, DraftPlanner
from eecore.speculative.pass_clock import PassClock
from engine_utils import greedy
from test_hybrid_switch import _prompts, lora_file  # noqa: F401 (a fixture)
from test_separate_draft_layers import tiny  # noqa: F401 (a fixture)


class StubClock(PassClock):
    """Fixed costs: a verify pass of r rows `verify(r)`, a copy pass `copy`; learns nothing."""

    def __init__(self, verify, copy=0.0, catch_up=0.0):
        super().__init__()
        self._cost, self.copy_pass, self.catch_up_token = verify, copy, catch_up

    def verify(self, rows):
        return self._cost(rows)

    def record_verify(self, rows, seconds, batch=None):
        pass

    def record_copy(self, passes, seconds):
        pass

    def record_catch_up(self, passes, tokens, seconds):
        pass


def _planner(verify, copy=0.0, most=4, catch_up=0.0) -> DraftPlanner:
    planner = DraftPlanner(max_layer=most, max_lookup=most)
    planner.clock = StubClock(verify, copy, catch_up)
    return planner


def _seq(prompt=(1, 2, 3)) -> Sequence:
    return Sequence(list(prompt), eecore.SamplingParams(max_tokens=1000))


def _rate(planner, acceptance, d, copy_passes, batch=1):
    """Expected tokens per second of a batch in which one sequence drafts a chain of d at (a1, a2),
    brute force."""
    first, later = acceptance
    tokens = batch + sum(first * later ** k for k in range(d))
    copy = planner.clock.copy_pass if copy_passes else 0.0
    return tokens / (planner.clock.verify(batch + d) + d * copy)


# ---- the clock -------------------------------------------------------------------------------

def test_the_clock_averages_and_estimates_unmeasured_rows_from_below():
    clock = PassClock()
    assert clock.verify(1) is None and clock.copy_pass is None
    clock.record_verify(1, 0.010)
    clock.record_verify(1, 0.020)
    assert clock.verify(1) == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)
    clock.record_verify(3, 0.030)
    # 2 rows: never cheaper than 1 row, so 1 row's cost; 5 rows: the widest measured below, 3 rows'
    assert clock.verify(2) == clock.verify(1) and clock.verify(5) == pytest.approx(0.030)
    clock.record_catch_up(1, 10, 0.050)  # nothing to subtract a pass from yet: not learned
    assert clock.catch_up_token == 0.0
    clock.record_copy(2, 0.004)
    assert clock.copy_pass == pytest.approx(0.002)
    clock.record_copy(0, 1.0)  # no pass ran: nothing learned
    assert clock.copy_pass == pytest.approx(0.002)
    clock.record_catch_up(1, 10, 0.012)  # 0.010 s beyond the pass, over 10 tokens
    assert clock.catch_up_token == pytest.approx(0.001)


def test_a_pass_not_timed_while_the_plain_step_moved_is_scaled_with_it():
    """A pass the planner stopped running would keep the time it took in another phase of the
    machine for good: once it is STALE_ROUNDS rounds old and its batch's plain step has moved by more
    than DRIFT since, its cost moves with the plain step (quiet() hears of it a round ahead, since
    plans may change then with no new timing). Where the plain step holds still nothing changes: a
    GPU that stopped drafting because rounds do not pay there spends no round finding that out."""
    clock = PassClock()
    clock.record_verify(1, 0.010)
    clock.record_verify(2, 0.015, batch=1)  # 1.5 plain steps
    clock.record_verify(3, 0.018, batch=1)
    for _ in range(3 * PassClock.STALE_ROUNDS):  # the plain step alone, holding still
        clock.record_verify(1, 0.010)
    assert not clock.changes_next_round() and clock.verify(2) == pytest.approx(0.015)
    planner = DraftPlanner(max_layer=0, max_lookup=2)
    planner.clock = clock
    seq = _seq()
    planner.plan(seq, 1, 2, room=100)
    assert planner.quiet(seq)
    for _ in range(40):  # the machine speeds up
        if clock.changes_next_round():
            break
        assert planner.quiet(seq)
        clock.record_verify(1, 0.005)
    assert clock.changes_next_round() and not planner.quiet(seq)
    assert clock.verify(2) == pytest.approx(0.015)  # until the next record
    plain = clock.verify(1)
    clock.record_verify(1, 0.005)  # scaled by the plain step as it was when the change was decided
    assert clock.verify(2) == pytest.approx(0.015 * plain / 0.010)
    assert clock.verify(3) == pytest.approx(0.018 * plain / 0.010)
    for _ in range(2 * PassClock.STALE_ROUNDS):  # settled at 0.005: scaled again once, then still
        clock.record_verify(1, 0.005)
    assert clock.verify(2) == pytest.approx(0.0075, rel=0.05) and not clock.changes_next_round()
    before = clock.verify(2)
    clock.record_verify(2, 0.006, batch=1)  # timed again: averaged with its own times as before
    assert clock.verify(2) == pytest.approx(PassClock.DECAY * before + (1 - PassClock.DECAY) * 0.006)


def test_no_row_count_costs_more_than_a_wider_one_measured():
    """A plain step timed once, dearly (a one-time cost, or long ago: the planner stopped running
    it), must not stay dearer than the rounds' wider passes, or the planner would keep drafting at
    any acceptance."""
    clock = PassClock()
    clock.record_verify(2, 0.050)
    clock.record_verify(6, 0.010)
    assert clock.verify(2) == pytest.approx(0.010)
    assert clock.verify(4) == pytest.approx(0.010) and clock.verify(6) == pytest.approx(0.010)
    assert clock.verify(1) is None  # nothing measured at or below it
    planner = DraftPlanner(max_layer=4, max_lookup=0)
    planner.clock = clock
    assert planner.best_length((0.0, 0.0), 2, 4, copy_passes=True) == 0  # drafts that never land: plain


# ---- choosing a length -----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(30))
def test_the_choice_is_the_brute_force_best_rate(seed):
    """best_length (with its shortcut for first-draft rates too low for any length to pay) against
    every length priced by brute force, on random costs and rates, near the break-even too."""
    import random

    rng = random.Random(seed)
    base, per_row, copy = rng.uniform(1, 5), rng.uniform(0, 0.5), rng.choice([0.0, rng.uniform(0, 1)])
    planner = _planner(lambda rows: base + per_row * rows, copy=copy)
    for _ in range(200):
        batch, most = rng.randint(1, 16), rng.randint(1, 6)
        later = rng.random()
        # a first-draft rate around the least one at which one draft would pay, or anywhere
        least = batch * (planner.clock.verify(batch + 1) + copy - planner.clock.verify(batch)) / planner.clock.verify(batch)
        first = min(1.0, max(0.0, least * rng.uniform(0.9, 1.1))) if rng.random() < 0.5 else rng.random()
        best, best_rate = 0, batch / planner.clock.verify(batch)
        for d in range(1, most + 1):
            rate = _rate(planner, (first, later), d, True, batch)
            if rate > best_rate:
                best, best_rate = d, rate
        assert planner.best_length((first, later), batch, most, copy_passes=True) == best


def test_verify_rows_that_cost_nothing_make_the_longest_chain_pay():
    planner = _planner(lambda rows: 1.0, copy=0.1)
    assert planner.best_length((0.6, 0.6), 1, 4, copy_passes=False) == 4
    assert planner.best_length((0.8, 0.8), 1, 4, copy_passes=True) == 4
    # a copy pass costs a tenth of a step: a fourth draft accepted 0.6^4 of the time does not pay it
    assert planner.best_length((0.6, 0.6), 1, 4, copy_passes=True) == 3
    assert planner.best_length((0.0, 0.9), 1, 4, copy_passes=False) == 0  # never accepted: never pays


def test_verify_rows_that_cost_a_step_each_never_pay():
    planner = _planner(lambda rows: float(rows))
    # E(d) <= d + 1 tokens for d + 1 rows' cost: even sure drafts only tie with a plain step
    assert planner.best_length((0.99, 0.99), 1, 4, copy_passes=False) == 0


@pytest.mark.parametrize("acceptance", [(0.3, 0.5), (0.75, 0.9), (0.9, 0.95), (0.5, 0.3)])
def test_the_choice_is_the_best_rate_at_the_costs_measured_on_a_cpu(acceptance):
    # bench/cost_round.py verify-rows on 2 Zen 4 cores, SmolLM2's Q4_1 file, exact kernel (ms)
    costs = {1: 7.53, 2: 12.79, 3: 14.67, 4: 16.11, 5: 18.02}
    planner = _planner(costs.get, copy=2.22)
    for copy_passes in (False, True):
        rates = [1 / costs[1]] + [_rate(planner, acceptance, d, copy_passes) for d in range(1, 5)]
        best = max(range(5), key=lambda d: (rates[d], -d))
        assert planner.best_length(acceptance, 1, 4, copy_passes) == best
    # layer drafts need the rate of the copy on code to break even there; lookup drafts (no copy
    # pass) pay far sooner
    assert planner.best_length((0.65, 0.9), 1, 4, copy_passes=True) == 0
    assert planner.best_length((0.65, 0.9), 1, 4, copy_passes=False) == 4


def test_a_batch_prices_a_sequences_rows_at_the_batch_width():
    # 4 rows cost what 1 does, more cost a step each: alone a sequence drafts 3, beside 3 others none
    planner = _planner(lambda rows: 1.0 if rows <= 4 else float(rows - 3))
    assert planner.best_length((0.9, 0.9), 1, 4, copy_passes=False) == 3
    assert planner.best_length((0.9, 0.9), 4, 4, copy_passes=False) == 0
    for batch in (1, 2, 3):
        rates = [_rate(planner, (0.9, 0.9), d, False, batch) for d in range(5)]
        assert planner.best_length((0.9, 0.9), batch, 4, False) == max(range(5), key=lambda d: (rates[d], -d))


def test_catching_the_copy_up_is_spread_over_the_rounds_left():
    planner = _planner(lambda rows: 1.0 + 0.05 * (rows - 1), copy=0.1, catch_up=0.05)
    assert planner.plan(_seq(), 1, 4, room=64, behind=0).layer == 4
    # 200 tokens behind: 10 steps of catch-up, which 64 tokens at d = 4 earn back (0.4 steps a
    # token) and 8 tokens do not; lookup drafts have nothing to catch up on
    assert planner.plan(_seq(), 1, 4, room=64, behind=200).layer == 4
    assert planner.plan(_seq(), 1, 4, room=8, behind=200).layer == 0
    assert planner.plan(_seq(), 1, 4, room=8, behind=200).lookup == 4


def test_a_batch_size_first_decodes_a_plain_step_to_time_it():
    planner = DraftPlanner(max_layer=3, max_lookup=4)
    seq = _seq()
    assert planner.plan(seq, 1, 4, room=64) == DraftPlan(lookup=0, layer=0)
    planner.clock.record_verify(1, 0.01)  # rows not timed yet cost no more than the widest timed below
    assert planner.plan(seq, 1, 4, room=64) == DraftPlan(lookup=4, layer=3)
    assert planner.plan(seq, 1, 2, room=64) == DraftPlan(lookup=2, layer=2)  # the budget caps them
    assert planner.plan(seq, 1, 0, room=64) == DraftPlan(lookup=0, layer=0)


# ---- learning from rounds --------------------------------------------------------------------

def _draft(sources: str, copy_ran: bool = False) -> Draft:
    """A draft of k (lookup) and c (copy) tokens."""
    return Draft(tokens=list(range(len(sources))), from_lookup=[s == "k" for s in sources], copy_ran=copy_ran)


def test_hits_and_misses_go_to_each_kind_and_place():
    planner = _planner(lambda rows: 1.0)
    seq = _seq()
    base_lookup, base_layer = planner.acceptance(seq, "lookup"), planner.acceptance(seq, "layer")
    planner.record(seq, _draft("kkcc", copy_ran=True), accepted=3)  # k k c accepted, the second c rejected
    lookup, layer = planner.acceptance(seq, "lookup"), planner.acceptance(seq, "layer")
    assert lookup[0] > base_lookup[0] and lookup[1] > base_lookup[1]  # first and later lookup hits
    assert layer[0] > base_layer[0] and layer[1] < base_layer[1]  # first copy token hit, later one missed
    other = _seq()
    planner.record(other, _draft("", copy_ran=True), accepted=0)  # the copy ran, the threshold dropped it
    assert planner.acceptance(other, "layer")[0] < planner.acceptance(_seq(), "layer")[0]
    assert planner.acceptance(other, "lookup") == planner.acceptance(_seq(), "lookup")
    planner.record(other, None, 0)  # a plain round teaches nothing
    planner.release(seq)
    planner.release(other)
    assert len(planner) == 0


@pytest.mark.parametrize("sources", ["c", "cc", "cccc", "kc", "kkcc", "ckc"])
def test_a_round_counts_every_draft_up_to_the_first_rejected_one(sources):
    """Per kind, a round's first draft is a first-draft hit or miss and each later one up to the first
    rejected draft a later hit or miss, whatever the chain's mix of kinds (layer drafts alone are
    counted without walking the chain)."""
    for accepted in range(len(sources) + 1):
        planner = _planner(lambda rows: 1.0)
        seq = _seq()
        planner.record(seq, _draft(sources), accepted)
        expected = {"layer": [0, 0, 0, 0], "lookup": [0, 0, 0, 0]}
        seen = set()
        for i, source in enumerate(sources[: accepted + 1]):
            kind = "lookup" if source == "k" else "layer"
            place = 2 if kind in seen else 0
            seen.add(kind)
            expected[kind][place + (0 if i < accepted else 1)] += 1
        for kind, (first_hit, first_miss, later_hits, later_misses) in expected.items():
            odds = planner.states.slot(seq, "odds")[kind]
            assert (odds.hits, odds.misses) == ([first_hit, later_hits], [first_miss, later_misses]), (kind, accepted)


def _rounds(planner, seq, good, n, accept):
    """`n` rounds of `seq`, whose lookup drafts are accepted as `accept(d)` says, beside `good`, whose
    drafts are always accepted (so the rates of all sequences stay worth a probe); `seq`'s lengths."""
    lengths = []
    for _ in range(n):
        planner.new_round()
        g = planner.plan(good, 2, 4, room=10_000).lookup
        if g:
            planner.record(good, _draft("k" * g), accepted=g)
        d = planner.plan(seq, 2, 4, room=10_000).lookup
        lengths.append(d)
        if d:
            planner.record(seq, _draft("k" * d), accepted=accept(d))
    return lengths


def test_a_sequence_whose_drafts_fail_stops_and_probes_ever_more_rarely():
    planner = _planner(lambda rows: 1.0 + 0.25 * (rows - 1))
    rounds = _rounds(planner, _seq(), _seq(), 400, lambda d: 0)
    drafting = [i for i, d in enumerate(rounds) if d]
    assert drafting[0] == 0  # hopeful at first
    probes = [i for i in drafting if i > 20]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] >= 64, rounds  # waits double
    assert sum(1 for d in rounds if d) < 15


def test_accepted_probes_bring_the_drafts_back():
    planner = _planner(lambda rows: 1.0 + 0.25 * (rows - 1))
    seq, good = _seq(), _seq()
    assert _rounds(planner, seq, good, 20, lambda d: 0)[-1] == 0
    rounds = _rounds(planner, seq, good, 100, lambda d: d)
    first = next(i for i, d in enumerate(rounds) if d)
    assert first <= 33 and all(rounds[first + 3:]), rounds  # the first probe, then every round


def test_a_decoder_whose_drafts_all_fail_hardly_probes():
    # one sequence alone, never accepted: the rates of all are its own, and a probe rarely pays
    planner = _planner(lambda rows: 1.0 + 0.5 * (rows - 1))
    seq, rounds = _seq(), []
    for _ in range(200):
        planner.new_round()
        d = planner.plan(seq, 1, 4, room=10_000).lookup
        rounds.append(d)
        if d:
            planner.record(seq, _draft("k" * d), accepted=0)
    # a probe falls due now and then, as the rates of all (its own) drift back towards hopeful
    assert rounds[0] and sum(1 for d in rounds[1:] if d) <= 3, rounds
    assert not any(a and b for a, b in zip(rounds[1:], rounds[2:])), rounds


def test_a_sequence_is_quiet_until_its_probe_falls_due():
    """DraftPlanner.quiet: planned at 0 this round, is the next round plain too? Not for a sequence
    never planned, and not on the round before a probe; the prediction matches what plan does."""
    planner = _planner(lambda rows: 1.0 + 0.25 * (rows - 1))
    seq, good = _seq(), _seq()
    assert not planner.quiet(seq)
    assert _rounds(planner, seq, good, 10, lambda d: 0)[-1] == 0  # its drafts fail: planned at 0 from here on
    predictions = []
    for _ in range(60):
        quiet = planner.quiet(seq)
        planner.new_round()
        d = planner.plan(seq, 2, 4, room=10_000).lookup
        predictions.append((quiet, d))
        if d:
            planner.record(seq, _draft("k" * d), accepted=0)
    assert all(not d for quiet, d in predictions if quiet), predictions  # quiet: no drafts next round
    assert any(d for _, d in predictions) and any(quiet for quiet, _ in predictions)


@pytest.mark.parametrize("seed", range(6))
def test_a_round_planned_at_once_is_each_sequence_planned_alone(seed):
    """plan_all, which derives a round's prices and priors once for all its sequences, plans each
    as the per-sequence rule does: the length best_length picks at the sequence's own rates and
    catch-up, or where no length pays, 0 until its probe falls due and then the prior's length;
    and all_quiet is quiet() of every sequence. Random costs, records, budgets and rooms, rounds
    with some sequences recorded and some released."""
    import copy
    import random

    r = random.Random(seed)
    step, slope = r.uniform(0.5, 2.0), r.uniform(0.0, 0.15)
    copy_cost = step * r.uniform(0.0, 0.15)
    planner = DraftPlanner(max_layer=r.choice([2, 4]), max_lookup=r.choice([0, 3]))
    planner.clock = StubClock(lambda rows: step * (1.0 + slope * (rows - 1)), copy_cost, r.uniform(0.0, 0.02))
    seqs = [_seq() for _ in range(5)]
    for _ in range(150):
        planner.new_round()
        batch = len(seqs)
        budgets = [r.choice([0, 1, 2, 4, 4, 4]) for _ in seqs]
        rooms = [r.choice([1, 5, 64, 1000]) for _ in seqs]
        behinds = [r.choice([0, 0, 3, 300]) for _ in seqs]
        alone = copy.deepcopy(planner)
        expected = []
        for seq, budget, room, behind in zip(seqs, budgets, rooms, behinds):
            lengths = {}
            for kind in ("lookup", "layer"):
                most = min(budget, alone.max_length[kind])
                catch_up = alone._catch_up(room, behind) if kind == "layer" else 0.0
                best = alone.best_length(alone.acceptance(seq, kind), batch, most, kind == "layer", catch_up)
                if most > 0 and best == 0:
                    odds = alone._seq(seq)[kind]
                    if odds.idle + 1 >= odds.wait:  # its probe
                        best = alone.best_length(alone._prior(kind), batch, most, kind == "layer", catch_up)
                    odds.idle, odds.wait = (0, min(2 * odds.wait, alone.MAX_PROBE_WAIT)) if odds.idle + 1 >= odds.wait \
                        else (odds.idle + 1, odds.wait)
                lengths[kind] = best
            expected.append(DraftPlan(lengths["lookup"], lengths["layer"]))
        assert planner.plan_all(seqs, batch, budgets, rooms, behinds) == expected
        assert planner.all_quiet == all(planner.quiet(seq) for seq in seqs)
        for seq, plan in zip(seqs, expected):
            d = max(plan.lookup, plan.layer)
            if d and r.random() < 0.7:
                planner.record(seq, _draft(("k" if plan.lookup else "c") * d, copy_ran=plan.layer > 0),
                               accepted=r.randint(0, d))
        if r.random() < 0.2:  # one ends, another arrives
            planner.release(seqs.pop(r.randrange(len(seqs))))
            seqs.append(_seq())


def test_each_sequence_counts_once_in_the_prior_of_the_next():
    """One long request whose drafts fail must not stop the requests after it from drafting (they
    would never measure their own rate); a run of such requests, the workload itself, does."""
    planner = _planner(lambda rows: 1.0 + 0.25 * (rows - 1))
    bad = _seq()
    for _ in range(200):  # far more failed drafts than the prior's hopeful start is worth
        planner.new_round()
        planner.record(bad, _draft("kk"), accepted=0)
    assert planner.plan(_seq(), 1, 4, room=1000).lookup > 0  # beside it, live: it is one sequence of two
    planner.release(bad)
    assert planner.plan(_seq(), 1, 4, room=1000).lookup > 0  # after it
    for _ in range(6):  # and after a run of them, the rate they share
        seq = _seq()
        for _ in range(5):
            planner.record(seq, _draft("kk"), accepted=0)
        planner.release(seq)
    assert planner.plan(_seq(), 1, 4, room=1000).lookup == 0
    low = planner._prior("lookup")[0]
    good = _seq()  # a request that drafts well lifts the prior while it runs, and after it ends
    for _ in range(8):
        planner.record(good, _draft("kk"), accepted=2)
    live = planner._prior("lookup")[0]
    planner.release(good)
    assert low < live and low < planner._prior("lookup")[0]


def test_the_rates_of_all_sequences_drift_back_to_hopeful_while_nobody_drafts():
    planner = _planner(lambda rows: 1.0 + 0.2 * (rows - 1))
    for _ in range(30):  # sequences whose drafts failed, ended
        seq = _seq()
        planner.record(seq, _draft("kk"), accepted=0)
        planner.release(seq)
    assert planner.plan(_seq(), 1, 4, room=1000).lookup == 0
    for _ in range(3000):
        planner.new_round()
    assert planner.plan(_seq(), 1, 4, room=1000).lookup == 4


# ---- in the engine ---------------------------------------------------------------------------

def _adaptive(path, file=None, switch="token", copy=True, **kw):
    layer = eecore.LayerDrafts(exit_layer=2, max_length=2, copy=eecore.DraftCopy() if copy else None)
    spec = eecore.SelfSpeculativeConfig(num_speculations=4, hybrid_switch=switch, layer=layer,
                                        lookup=eecore.LookupDrafts(min_ngram=2), adaptive=True)
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8,
                      exit_adapter=file if copy else None, speculative=spec, **kw)


@pytest.mark.parametrize("switch,copy", [("token", True), ("round", True)], ids=["token-copy", "round-copy"])
def test_greedy_is_full_depth_whatever_the_planner_chooses(tiny, lora_file, switch, copy):
    path, _ = tiny
    file, _ = lora_file
    for batch in (1, 3):
        prompts = _prompts(batch)
        params = [greedy(20 + 5 * i) for i in range(batch)]
        expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
            prompts, params)]
        llm = _adaptive(path, file, switch, copy)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        strategy = llm.engine.strategy
        assert strategy.planner.clock.verify(batch) is not None  # it timed the rounds
        assert sum(o.metrics["num_drafted_tokens"] for o in outs) > 0
        assert len(strategy.planner) == 0  # finished sequences leave no state


def test_costly_verify_rows_turn_drafting_off_and_free_ones_on(tiny, lora_file):
    path, _ = tiny
    file, _ = lora_file
    prompts, params = _prompts(2), [greedy(40), greedy(40)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, params)]
    drafted = {}
    for name, verify in (("free", lambda rows: 1.0), ("a step a row", lambda rows: float(rows))):
        llm = _adaptive(path, file)
        llm.engine.strategy.planner.clock = StubClock(verify, copy=0.01)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        drafted[name] = sum(o.metrics["num_drafted_tokens"] for o in outs)
    assert drafted["a step a row"] == 0 < drafted["free"]


def test_bad_adaptive_is_refused():
    with pytest.raises(ValueError, match=r"'adaptive' \(--adaptive-drafts\) must be a bool"):
        eecore.SelfSpeculativeConfig(lookup=eecore.LookupDrafts(), adaptive="yes")
    with pytest.raises(ValueError, match="give LayerDrafts a copy"):  # shared layers verify from exit states
        eecore.SelfSpeculativeConfig(layer=eecore.LayerDrafts(exit_layer=2), adaptive=True)


def test_cli_flag_and_preset_override(tiny):
    from eecore.cli import main
    from eecore.cli.args import on_off

    path, _ = tiny
    assert main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                 "--draft", "lookup", "--adaptive-drafts"]) == 0
    assert on_off("off") is False and on_off("ON") is True
    with pytest.raises(SystemExit):
        main(["generate", "Hello", "--model", path, "--speculate", "--draft", "lookup", "--adaptive-drafts", "maybe"])
    from eecore.cli.speculative_flags import preset_with

    assert preset_with(eecore.SelfSpeculativeConfig.exit_ready("hybrid"), dict(adaptive_drafts=False)).adaptive is False


@pytest.mark.parametrize("verify, drafts", [(lambda rows: float(rows), False), (lambda rows: 1.0 + 0.3 * rows, True)],
                         ids=["drafts-never-pay", "drafts-and-probes"])
def test_plain_rounds_launch_their_successor_ahead_where_the_next_is_plain(tiny, lora_file, verify, drafts,
                                                                           monkeypatch):
    """Where the planner has turned drafting off, a plain round's step launches the next step ahead
    (decode ahead, on here with static decode steps on the CPU) and the next plain round takes it;
    a drafting round after it (a probe, or hopeful rates) leaves it untaken, its sequences having
    moved on. The same rounds, outputs and counted work as without decode ahead; every block comes
    back."""
    from eecore.engine.static_decode import StaticDecode

    monkeypatch.setattr(DraftPlanner, "FIRST_PROBE_WAIT", 4)  # probes often, between plain rounds
    path, _ = tiny
    file, _ = lora_file
    prompts, params = _prompts(3), [greedy(30), greedy(24), greedy(36)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, params)]

    def run(ahead: str):
        monkeypatch.setenv("EECORE_DECODE_AHEAD", ahead)
        spec = eecore.SelfSpeculativeConfig(num_speculations=3, adaptive=True,
                                            layer=eecore.LayerDrafts(exit_layer=2, copy=eecore.DraftCopy()))
        llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8, exit_adapter=file,
                         speculative=spec)
        runner = llm.engine.runner
        runner.static_decode = StaticDecode(runner, llm.engine.config.max_num_seqs, capture=False)
        llm.engine.strategy.planner.clock = StubClock(verify, copy=0.01)  # the same choices in both runs
        return llm, llm.generate(prompts, params)

    plain_llm, plain = run("0")
    llm, outs = run("1")
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] == expected
    assert [o.metrics["num_drafted_tokens"] for o in outs] == [o.metrics["num_drafted_tokens"] for o in plain]
    assert (sum(o.metrics["num_drafted_tokens"] for o in outs) > 0) == drafts
    assert llm.engine.runner.layer_tokens == plain_llm.engine.runner.layer_tokens
    rounds = max(o.metrics["num_verify_steps"] for o in outs)
    assert plain_llm.engine.runner.static_decode.ahead_taken == 0
    assert llm.engine.runner.static_decode.ahead_taken >= rounds // 2  # not the first, nor before probes
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_rounds_that_record_a_cuda_graph_teach_the_clock_nothing(tiny, lora_file):
    """The first round of each shape records its passes' CUDA graphs, a one-time cost of
    milliseconds that would price its passes far above their replays (here each emulated recording
    sleeps 50 ms): the clock learns nothing from such rounds, and outputs stay full depth's."""
    import time

    from eecore.engine.static_decode import StaticDecode, StaticVerify
    from engine_utils import emulate_graphs

    path, _ = tiny
    file, _ = lora_file
    prompts, params = _prompts(3), [greedy(12), greedy(20), greedy(16)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, params)]
    spec = eecore.SelfSpeculativeConfig(num_speculations=3, adaptive=True,
                                        layer=eecore.LayerDrafts(exit_layer=2, copy=eecore.DraftCopy()))
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8, exit_adapter=file,
                     speculative=spec)
    runner, strategy, rows = llm.engine.runner, llm.engine.strategy, llm.engine.config.max_num_seqs
    runner.static_decode = StaticDecode(runner, rows, capture=False)
    runner.static_verify = StaticVerify(runner, rows, capture=False, width=strategy.lookahead)
    strategy.draft_stack.static = strategy.draft_stack.static_pass(capture=False, max_batch=rows)
    passes = (runner.static_decode, runner.static_verify, strategy.draft_stack.static)
    for static in passes:
        emulate_graphs(static)
        record = static._record
        static._record = lambda key, step, inputs, record=record: (time.sleep(0.05), record(key, step, inputs))[1]
    learned = []
    clock = strategy.planner.clock
    for name, seconds in (("record_verify", 1), ("record_copy", 1), ("record_catch_up", 2)):
        inner = getattr(clock, name)
        setattr(clock, name, lambda *args, inner=inner, i=seconds: (learned.append(args[i]), inner(*args))[1])
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert all(static.captures for static in passes)  # every kind of pass recorded graphs
    assert learned and max(learned) < 0.05, learned  # none of them priced into the clock


def test_a_seeded_sampled_request_gives_its_output_whatever_the_timings(tiny, lora_file):
    """A sampled request's tokens follow its drafts (rejection sampling), and the planner's lengths
    follow the machine's timings, so a seed would not reproduce the output from one run to the next.
    Seeded sampled requests therefore decode without drafts under adaptive planning: with the
    planner's costs making every draft pay or none, their outputs are the same, and full depth's
    for their seeds. (Beside a drafting request a row may come from a verify pass, whose
    arithmetic rounds differently from a decode step's, as in any batch that changes.)"""
    path, _ = tiny
    file, _ = lora_file
    prompts = _prompts(2)
    params = [eecore.SamplingParams(max_tokens=30, temperature=0.8, seed=11, ignore_eos=True),
              eecore.SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True)]
    full = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, params)]
    for name, verify in (("free", lambda rows: 1.0), ("a step a row", lambda rows: float(rows))):
        llm = _adaptive(path, file)
        llm.engine.strategy.planner.clock = StubClock(verify, copy=0.01)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == full, name
        assert [o.metrics["num_drafted_tokens"] for o in outs] == [0, 0]


def test_seeded_sampled_requests_beside_drafting_ones_get_full_depths_tokens(tiny, lora_file):
    """Beside a greedy request that drafts, a seeded sampled one (which never drafts) takes its token
    from a round's verify pass instead of a decode step: drawn there as a decode step draws it
    (Sampler.draw_own), it stays full depth's for its seed. A top-k or top-p row used to be drawn
    there from its distribution in vocabulary order, and in a decode step in rank order: the same law,
    but another token for the same number, so its tokens depended on whether its neighbours drafted
    (and so on the machine's timings)."""
    path, _ = tiny
    file, _ = lora_file
    prompts = _prompts(4)
    prompts[0] = prompts[0] + prompts[0] + prompts[0]  # repeated text: its lookup drafts are accepted
    params = [greedy(30),
              eecore.SamplingParams(max_tokens=30, temperature=1.0, top_k=3, seed=11, ignore_eos=True),
              eecore.SamplingParams(max_tokens=30, temperature=1.5, top_p=0.5, seed=12, ignore_eos=True),
              eecore.SamplingParams(max_tokens=30, temperature=0.7, top_k=20, top_p=0.9, seed=13, ignore_eos=True)]
    full = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        prompts, params)]
    llm = _adaptive(path, file)
    llm.engine.strategy.planner.clock = StubClock(lambda rows: 1.0, copy=0.01)  # drafts are free: the greedy one drafts
    outs = llm.generate(prompts, params)
    assert outs[0].metrics["num_drafted_tokens"] > 0
    assert [o.metrics["num_drafted_tokens"] for o in outs[1:]] == [0, 0, 0]
    assert [o.token_ids for o in outs] == full


# ---- fused rounds: one length for the batch (shared_rounds) ------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_a_fused_rounds_length_is_the_brute_force_best_for_the_batch(seed):
    """plan_round against every length priced by brute force: each sequence at its own rates (set
    by recorded rounds) and budget, the verify pass over every sequence's d + 1 rows and d copy
    passes shared, the catch-up of each sequence spread as plan spreads it."""
    import random

    rng = random.Random(seed)
    base, per_row, copy = rng.uniform(1, 5), rng.uniform(0, 0.3), rng.uniform(0, 1)
    catch_up = rng.choice([0.0, rng.uniform(0, 0.2)])
    planner = _planner(lambda rows: base + per_row * rows, copy=copy, catch_up=catch_up)
    planner.shared_rounds = True
    batch, most = rng.randint(1, 12), rng.randint(1, 6)
    seqs = [_seq((1, 2, 3 + i)) for i in range(batch)]
    for seq in seqs:  # a few recorded rounds each: rates of their own
        planner.record_layer_rounds([seq] * 1, most, [rng.randint(0, most)])
        planner.record_layer_rounds([seq], most, [rng.randint(0, most)])
    budgets = [rng.randint(0, most) for _ in seqs]
    budgets[0] = most
    rooms = [rng.randint(2, 100) for _ in seqs]
    behinds = [rng.randint(0, 3) for _ in seqs]
    rates = [planner.acceptance(seq, "layer") for seq in seqs]
    catch = [catch_up * b / max(1, min(r, DraftPlanner.CATCH_UP_HORIZON)) for r, b in zip(rooms, behinds)]
    best, best_rate = 0, batch / planner.clock.verify(batch)
    for d in range(1, most + 1):
        emitted = [1 + sum(a1 * a2 ** k for k in range(min(d, n))) for (a1, a2), n in zip(rates, budgets)]
        cost = planner.clock.verify(batch * (d + 1)) + d * copy + sum(c * e for c, e in zip(catch, emitted))
        if sum(emitted) / cost > best_rate * (1 + 1e-12):
            best, best_rate = d, sum(emitted) / cost
    planner._round_wait = 10 ** 6  # (no probe)
    assert planner.plan_round(seqs, budgets, rooms, behinds) == best


def test_a_batch_whose_rounds_do_not_pay_is_probed_after_a_wait():
    planner = _planner(lambda rows: float(rows))  # a row costs a step: no length pays
    planner.shared_rounds = True
    planner.clock.copy_pass = 0.0
    seqs = [_seq(), _seq((4, 5))]
    lengths = [planner.plan_round(seqs, [4, 4], [50, 50], [0, 0]) for _ in range(DraftPlanner.FIRST_PROBE_WAIT)]
    assert lengths[:-1] == [0] * (DraftPlanner.FIRST_PROBE_WAIT - 1)
    # the probe drafts as far as the prior would pay: here nothing pays, so it too is a plain step;
    # the wait doubles all the same
    assert planner._round_wait == 2 * DraftPlanner.FIRST_PROBE_WAIT
    cheap = _planner(lambda rows: 1.0)
    cheap.shared_rounds = True
    assert cheap.plan_round(seqs, [4, 4], [50, 50], [0, 0]) == 4  # rows for free: the longest pays


def test_a_fused_rounds_record_learns_what_record_does():
    """record_layer_rounds (a fused round's bookkeeping) leaves the odds and priors record leaves
    for a round of layer drafts."""
    one, two = _planner(lambda rows: 1.0), _planner(lambda rows: 1.0)
    seqs = [_seq((1, 2, 3 + i)) for i in range(4)]
    for accepted in ([0, 4, 2, 1], [4, 4, 0, 3], [1, 0, 4, 4]):
        for seq, kept in zip(seqs, accepted):
            one.record(seq, Draft(tokens=[7] * 4, from_lookup=[False] * 4, copy_ran=True), kept)
        two.record_layer_rounds(seqs, 4, accepted)
    for seq in seqs:
        assert one.acceptance(seq, "layer") == pytest.approx(two.acceptance(seq, "layer"), abs=1e-12)
        mine, theirs = one.states.slot(seq, "odds")["layer"], two.states.slot(seq, "odds")["layer"]
        assert (mine.idle, mine.wait) == (theirs.idle, theirs.wait)
    assert one._prior("layer") == pytest.approx(two._prior("layer"), abs=1e-12)


def test_a_feature_trees_rows_are_priced_up_to_its_node_budget():
    """FeatureDrafts.tree_nodes: a tree of d positions verifies min(d x top_k, tree_nodes) rows, so
    a deeper chain on the same rows costs only its head step."""
    def verify(rows):
        return 1.0 + 0.1 * (rows - 1)
    config = eecore.SelfSpeculativeConfig(num_speculations=3, feature=eecore.FeatureDrafts(top_k=3, tree_nodes=6))
    planner = DraftPlanner(max_layer=0, max_lookup=0, max_feature=3, feature_rows=config.feature_tree_nodes)
    planner.clock = StubClock(verify, 0.0, 0.0)
    plain, rounds, _ = planner._prices(1, 3, "feature")
    assert plain == 1.0 and rounds == pytest.approx((1.3, 1.6, 1.6))
    unbudgeted = DraftPlanner(max_layer=0, max_lookup=0, max_feature=3, feature_rows=lambda d: 3 * d)
    unbudgeted.clock = StubClock(verify, 0.0, 0.0)
    assert unbudgeted._prices(1, 3, "feature")[1] == pytest.approx((1.3, 1.6, 1.9))
