"""The scheduler charges an encoder-decoder request's encoder tokens to the step's token budget:
the encoder runs whole in the step that admits the request, so a batch of long inputs is spread
over steps instead of blowing one up; an input longer than the budget still gets admitted."""
from eecore.engine.block_manager import BlockManager
from eecore.engine.scheduler import Scheduler
from eecore.engine.sequence import Sequence
from eecore.sampling_params import SamplingParams


def _t5_seq(encoder_len: int) -> Sequence:
    # T5's decoder prompt is its start token; the request's prompt feeds the encoder
    return Sequence([0], SamplingParams(max_tokens=4), encoder_token_ids=list(range(2, 2 + encoder_len)))


def _admitted(sched: Scheduler) -> list[list[int]]:
    """Encoder lengths admitted by each step until the queue is empty (decodes not advanced)."""
    steps = []
    while sched.waiting:
        step = sched.schedule()
        steps.append([s.num_encoder_tokens for s in step.prefills])
        for seq in step.prefills:  # the decoder prompt is computed: the request now decodes
            seq.num_computed_tokens = seq.num_tokens
    return steps


def test_encoder_tokens_count_against_the_budget():
    sched = Scheduler(BlockManager(256, 16), max_num_seqs=16, max_num_batched_tokens=64)
    for _ in range(5):
        sched.add(_t5_seq(30))
    # 31 tokens each (30 encoder + the start token): two fit a budget of 64, not three
    assert _admitted(sched)[:3] == [[30, 30], [30, 30], [30]]


def test_an_encoder_longer_than_the_budget_is_admitted_alone():
    sched = Scheduler(BlockManager(256, 16), max_num_seqs=16, max_num_batched_tokens=64)
    for n in (10, 100, 10):
        sched.add(_t5_seq(n))
    assert _admitted(sched) == [[10], [100], [10]]


def test_decoder_only_requests_are_charged_as_before():
    sched = Scheduler(BlockManager(256, 16), max_num_seqs=16, max_num_batched_tokens=64)
    for _ in range(3):
        sched.add(Sequence(list(range(20)), SamplingParams(max_tokens=4)))
    step = sched.schedule()
    assert step.prefill_tokens == [20, 20, 20]
