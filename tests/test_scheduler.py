"""The scheduler alone (no model): token budget, mixed and split steps, admission, preemption.

`_run` plays the engine's part: a decode computes the pending token and appends one, a prefill
chunk advances `num_computed_tokens` and appends the first output once the prefill is complete.
"""
import pytest

from eecore.engine.block_manager import BlockManager
from eecore.engine.scheduler import Scheduler
from eecore.engine.sequence import Sequence
from eecore.sampling_params import SamplingParams


def _seq(n: int) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=100, ignore_eos=True))


def _apply(sched: Scheduler, step, max_tokens: int) -> None:
    for seq in step.decodes:
        seq.num_computed_tokens += 1
        seq.append_token(7, 1)
    for seq, n in zip(step.prefills, step.prefill_tokens):
        seq.num_computed_tokens += n
        if not seq.in_prefill:
            seq.append_token(7, 1)
    for seq in list(sched.running):
        if seq.num_output_tokens >= max_tokens:
            sched.finish(seq, "length")


def _run(sched: Scheduler, max_tokens: int, limit: int = 1000, add_at: dict | None = None) -> list:
    steps = []
    for i in range(limit):
        for seq in (add_at or {}).get(i, []):
            sched.add(seq)
        step = sched.schedule()
        if step is None:
            if not (add_at and any(k > i for k in add_at)):
                break
            continue
        _check_invariants(sched, step)
        steps.append(step)
        _apply(sched, step, max_tokens)
    return steps


def _check_invariants(sched: Scheduler, step) -> None:
    assert len(step.seqs) == len(set(id(s) for s in step.seqs)) <= sched.max_num_seqs
    for seq in step.decodes:  # a decode is one pending token, its slots reserved
        assert not seq.in_prefill and seq.num_pending_tokens == 1
        assert len(seq.block_table) * sched.blocks.block_size >= seq.num_tokens + step.decode_cost - 1
    for seq, n in zip(step.prefills, step.prefill_tokens):
        assert seq.in_prefill and 0 < n <= seq.prefill_target - seq.num_computed_tokens
        assert len(seq.block_table) * sched.blocks.block_size >= seq.num_computed_tokens + n


def test_mixed_steps_carry_prefill_chunks_beside_the_decodes_within_the_budget():
    sched = Scheduler(BlockManager(200, 4), max_num_seqs=4, max_num_batched_tokens=8)
    first = [_seq(5), _seq(3)]
    late = [_seq(30), _seq(9)]
    steps = _run(sched, max_tokens=12, add_at={0: first, 4: late})
    assert all(s.num_tokens <= 8 for s in steps)
    mixed = [s for s in steps if s.decodes and s.prefills]
    assert mixed, "a request that arrives while others decode rides in their steps"
    # the running streams never stop: every step after their prefill decodes both of them
    decoding = [s for s in steps if first[0] in s.decodes or first[1] in s.decodes]
    assert all(set(first) <= set(s.decodes) for s in decoding if not (first[0].is_finished or first[1].is_finished)
               and s is not decoding[-1])
    # the 30-token prompt went in chunks of at most 8 - (decodes in that step)
    chunks = [n for s in steps for q, n in zip(s.prefills, s.prefill_tokens) if q is late[0]]
    assert sum(chunks) == 30 and len(chunks) >= 30 // 8 + 1
    assert all(q.num_output_tokens == 12 for q in first + late)
    assert sched.blocks.num_free_blocks == 200


def test_decodes_are_never_deferred_when_they_exceed_the_budget():
    sched = Scheduler(BlockManager(200, 4), max_num_seqs=6, max_num_batched_tokens=4)
    seqs = [_seq(3) for _ in range(6)]
    steps = _run(sched, max_tokens=20, add_at={0: seqs})
    full = [s for s in steps if len(s.decodes) >= 4]
    assert full and all(not s.prefills for s in full)  # nothing left for prefill in those steps
    assert all(s.num_tokens <= max(4, len(s.decodes)) for s in steps)
    assert all(q.num_output_tokens == 20 for q in seqs)


def test_split_steps_alternate_so_a_stream_waits_at_most_one_prefill_step():
    sched = Scheduler(BlockManager(200, 4), max_num_seqs=8, max_num_batched_tokens=6, mixed=False)
    first = [_seq(4), _seq(4)]
    late = [_seq(20) for _ in range(4)]
    steps = _run(sched, max_tokens=10, add_at={0: first, 3: late})
    assert not any(s.decodes and s.prefills for s in steps)
    assert all(s.num_tokens <= 6 for s in steps if s.prefills)
    for a, b in zip(steps, steps[1:]):  # no two prefill steps in a row while someone decodes
        if a.prefills and any(not q.in_prefill and not q.is_finished for q in b.seqs):
            assert b.decodes
    assert all(q.num_output_tokens == 10 for q in first + late)


def test_speculative_lookahead_reserves_slots_and_counts_against_the_budget():
    sched = Scheduler(BlockManager(200, 4), max_num_seqs=4, max_num_batched_tokens=12, lookahead=3, mixed=False)
    seqs = [_seq(6) for _ in range(3)]
    steps = _run(sched, max_tokens=6, add_at={0: seqs})
    assert all(s.decode_cost == 3 for s in steps)
    assert any(len(s.decodes) == 3 for s in steps)


def test_plain_above_plans_plain_mixed_steps_while_the_batch_is_large():
    # self-speculation's disable_by_batch_size: above 2 decodes a step reserves one slot per decode
    # and may carry prompt chunks; at 2 or fewer it looks ahead, unless prompts wait (below)
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=6, max_num_batched_tokens=12, lookahead=3, mixed=False,
                      plain_above=2, plain_mixed=True)
    seqs = [_seq(5 + 3 * i) for i in range(6)]
    steps = _run(sched, max_tokens=8 + 2, add_at={0: seqs[:2], 4: seqs[2:]})
    plain = [s for s in steps if s.decodes and s.decode_cost == 1]
    ahead = [s for s in steps if s.decodes and s.decode_cost == 3]
    assert plain and ahead
    assert all(len(s.decodes) > 2 or s.prefills for s in plain) and all(len(s.decodes) <= 2 for s in ahead)
    assert any(len(s.decodes) > 2 for s in plain)
    assert any(s.prefills for s in plain)          # mixed
    assert not any(s.prefills for s in ahead)      # split, as the speculative strategy needs
    assert all(s.num_tokens <= 12 for s in plain)
    assert all(q.num_output_tokens == 10 for q in seqs)


def test_a_lookahead_strategy_takes_plain_mixed_steps_while_prompts_wait():
    # rounds that cannot carry prompt chunks would alternate with prefill steps, so that a stream
    # waits a prefill step between rounds; the decodes take plain mixed steps instead until the
    # prompts are in, then look ahead again
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=6, max_num_batched_tokens=12, lookahead=3, mixed=False,
                      plain_mixed=True)
    seqs = [_seq(5 + 3 * i) for i in range(4)]
    steps = _run(sched, max_tokens=10, add_at={0: seqs[:2], 4: seqs[2:]})
    first_decode = next(i for i, s in enumerate(steps) if s.decodes)
    assert all(s.decodes for s in steps[first_decode:] if s.prefills)  # no prefill step of its own
    assert all(s.decode_cost == 1 for s in steps if s.decodes and s.prefills)
    rounds = [i for i, s in enumerate(steps) if s.decode_cost == 3 and s.decodes]
    last_prefill = max(i for i, s in enumerate(steps) if s.prefills)
    assert any(i < 4 for i in rounds) and any(i > last_prefill for i in rounds)
    assert all(q.num_output_tokens == 10 for q in seqs)


def test_plain_steps_stay_split_without_plain_mixed():
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=6, max_num_batched_tokens=12, lookahead=3, mixed=False,
                      plain_above=1)
    seqs = [_seq(6) for _ in range(4)]
    steps = _run(sched, max_tokens=6, add_at={0: seqs[:2], 3: seqs[2:]})
    assert any(s.decode_cost == 1 and len(s.decodes) > 1 for s in steps)
    assert not any(s.decodes and s.prefills for s in steps)


def test_preemption_under_mixed_steps_drops_the_newest_and_readmits_it():
    # 10 blocks of 4 slots: two 12-token sequences growing to 24 cannot both stay
    sched = Scheduler(BlockManager(10, 4), max_num_seqs=4, max_num_batched_tokens=16)
    a, b = _seq(12), _seq(12)
    steps = _run(sched, max_tokens=12, add_at={0: [a], 1: [b]})
    preempted = [q for s in steps for q in s.preempted]
    assert preempted and all(q is b for q in preempted)  # the newest goes, the oldest keeps running
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert a.num_output_tokens == b.num_output_tokens == 12
    # a step that preempted admits nobody
    assert all(not any(q.num_computed_tokens == 0 for q in s.prefills) or not s.preempted for s in steps)
    assert sched.blocks.num_free_blocks == 10


def test_a_running_prefill_without_free_blocks_preempts_the_newest():
    # a (16 tokens) needs 5 blocks once it decodes; b (8) is admitted beside a's last chunk and
    # cannot grow into its second block
    sched = Scheduler(BlockManager(6, 4), max_num_seqs=4, max_num_batched_tokens=10)
    a, b = _seq(16), _seq(8)
    steps = _run(sched, max_tokens=3, add_at={0: [a, b]})
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_output_tokens == b.num_output_tokens == 3
    assert sched.blocks.num_free_blocks == 6 and steps


@pytest.mark.parametrize("mixed", [True, False])
def test_the_running_batch_is_bounded_and_admission_is_fcfs(mixed):
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=3, max_num_batched_tokens=64, mixed=mixed)
    seqs = [_seq(5 + i) for i in range(7)]
    order = []
    for seq in seqs:
        sched.add(seq)
    while True:
        step = sched.schedule()
        if step is None:
            break
        assert len(sched.running) <= 3
        order += [q for q in step.prefills if q.num_computed_tokens == 0]
        _apply(sched, step, 4)
    assert order == seqs


def test_released_blocks_are_taken_first_again():
    """Last in, first out: a new sequence gets the blocks just given back (their KV lines may be
    cached, and a lazily backed KV cache only grows as far as the load needs)."""
    bm = BlockManager(10, 4)
    a, b = _seq(8), _seq(8)
    bm.grow(a, 8)
    bm.grow(b, 8)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.free(b)
    bm.shrink(a, 4)  # a speculative rollback gives back block 1
    c = _seq(12)
    bm.grow(c, 12)
    assert c.block_table == [1, 3, 2]  # the last given back first; then untouched blocks 4..9
    assert bm.num_free_blocks == 10 - 4


def test_token_slice_is_the_slice_of_prompt_and_outputs():
    """Sequence.token_slice slices without building the whole context: held to the slice of the
    concatenation for every start <= end, within the prompt, across it and within the outputs."""
    seq = Sequence(list(range(100, 107)), SamplingParams(max_tokens=20))
    for token in range(200, 210):
        seq.append_token(token, 0)
    whole = seq.prompt_token_ids + seq.output_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert seq.token_slice(start, end) == whole[start:end], (start, end)
