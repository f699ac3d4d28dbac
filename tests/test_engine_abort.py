"""LLMEngine.abort_request (what a server does when a client goes away) and the streaming deltas
the server and LLM.generate_stream share (tiny models)."""
import pytest

import eecore
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model

NUM_LAYERS = 4
STRATEGIES = {
    "full": {},
    "early_exit": {"early_exit": eecore.EarlyExitConfig(measure="softmax", threshold=0.05)},
    "speculate": {"speculative": eecore.SelfSpeculativeConfig(exit_layer=2, num_speculations=3)},
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("abort"), num_layers=NUM_LAYERS)
    return path


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_abort_frees_blocks_and_leaves_the_others_intact(tiny_path, strategy):
    llm = eecore.LLM(tiny_path, dtype="float32", device="cpu", block_size=4, num_blocks=96, max_num_seqs=3,
                     **STRATEGIES[strategy])
    engine = llm.engine
    prompts = random_prompts(320, [5, 11, 3, 7, 9], seed=3)
    params = [greedy(12 + i) for i in range(5)]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    seqs = [engine.add_request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
    for _ in range(3):
        engine.step()
    running = next(s for s in seqs if s in engine.scheduler.running and s.num_output_tokens > 0)
    waiting = engine.scheduler.waiting[-1]  # max_num_seqs=3: two of the five still wait
    used_before = engine.blocks.num_blocks - engine.blocks.num_free_blocks
    assert engine.abort_request(running) and engine.abort_request(waiting)
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert running not in engine.scheduler.running and waiting not in engine.scheduler.waiting
    assert running.block_table == [] and engine.blocks.num_blocks - engine.blocks.num_free_blocks < used_before
    assert not engine.abort_request(running)  # a second abort is a no-op
    while engine.has_unfinished():
        engine.step()
    for i, seq in enumerate(seqs):
        if seq not in (running, waiting):
            assert seq.output_token_ids == expected[i]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.abort_request(seqs[0])  # finished: nothing to abort


def test_last_stream_delta_carries_the_metrics(tiny_path):
    llm = eecore.LLM(tiny_path, dtype="float32", device="cpu", **STRATEGIES["speculate"])
    prompts = random_prompts(320, [4, 8], seed=5)
    offline = llm.generate(prompts, greedy(9))
    finals = {d.index: d for d in llm.generate_stream(prompts, greedy(9)) if d.finished}
    for i, out in enumerate(offline):
        assert finals[i].metrics["num_output_tokens"] == 9
        assert finals[i].metrics["acceptance_rate"] == out.metrics["acceptance_rate"]


def test_stream_logprobs_match_generate(tiny_path):
    llm = eecore.LLM(tiny_path, dtype="float32", device="cpu")
    prompts = random_prompts(320, [6, 3], seed=9)
    offline = llm.generate(prompts, greedy(5, logprobs=2))
    got = {0: [], 1: []}
    for d in llm.generate_stream(prompts, greedy(5, logprobs=2)):
        got[d.index] += d.logprobs
    assert [got[0], got[1]] == [o.logprobs for o in offline]
