"""Fused self-speculation rounds (LLM(fused_rounds=True), eecore.speculative.fused_round): a draft
copy's greedy round with every pass's inputs filled at once, the chain's tokens and the acceptance
on the device, one read-back. The tokens are full depth's whatever the drafts; rounds it does not
take (sampling, log-probabilities, a copy that must catch up, no room) run op by op beside it."""
from __future__ import annotations

import pytest

import eecore
from eecore.testing import accept_every_draft
from engine_utils import emulate_graphs, greedy, random_prompts
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("fused"), num_layers=3)


def _config(drafts: int = 4, adaptive: bool = False, **layer):
    return eecore.SelfSpeculativeConfig(num_speculations=drafts, adaptive=adaptive,
                                        layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy(), **layer))


def _llm(path, config, fused: bool = True, num_blocks: int = 128, block_size: int = 4):
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=num_blocks, block_size=block_size,
                     max_num_seqs=8, speculative=config, fused_rounds=fused)
    if fused:  # the passes as CUDA graphs would run them (a recording that leaves state changed fails)
        emulate_graphs(llm.engine.strategy.fused.chain)
        emulate_graphs(llm.engine.strategy.fused.verify)
    return llm


def _prompts(hf, lengths=(3, 9, 17, 5, 12, 7), seed=11):
    prompts = random_prompts(hf.config.vocab_size, list(lengths), seed=seed)
    return [p + p[: len(p) // 2] + p for p in prompts]  # repeats: drafts that are sometimes right


@pytest.fixture(scope="module")
def full_depth(tiny):
    path, hf = tiny
    llm = eecore.LLM(path, dtype="float32", device="cpu")
    return lambda prompts, params: [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("config", [
    _config(),
    _config(drafts=1),
    # the GPU preset's rules (the chain's stops do not cut a fused round) and the planner's lengths
    _config(drafts=3, adaptive=True, stop_below=0.003, long_draft_acceptance=0.5),
], ids=["d4", "d1", "planner-and-stops"])
def test_fused_rounds_emit_full_depths_tokens(tiny, full_depth, config):
    path, hf = tiny
    prompts = _prompts(hf)
    params = [greedy(6 + 5 * i) for i in range(len(prompts))]
    llm = _llm(path, config)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == full_depth(prompts, params)
    fused = llm.engine.strategy.fused
    # (the planner turns the tiny model's drafts off after a round or two)
    assert fused.rounds >= (1 if config.adaptive else 5)
    assert fused.captures > 0  # (emulated graphs, replayed from then on)
    if not config.adaptive:
        assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0, "no draft accepted: the test shows little"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_perfect_drafts_are_accepted_whole(tiny):
    """accept_every_draft (benchmarks' perfect drafts) holds for fused rounds: every draft of every
    fused round accepted, d + 1 tokens a round."""
    path, hf = tiny
    llm = _llm(path, _config(drafts=3))
    accept_every_draft(llm)
    outs = llm.generate(_prompts(hf)[:3], greedy(24))
    assert all(o.metrics["num_accepted_tokens"] == o.metrics["num_drafted_tokens"] for o in outs)
    assert all(o.metrics["mean_accepted_tokens_per_step"] > 3 for o in outs)


def test_rounds_a_fused_round_does_not_take_run_op_by_op(tiny, full_depth):
    """A sampled request and one with log-probabilities in the batch: those rounds go op by op;
    the greedy requests' tokens stay full depth's, and so does the run done without fused rounds."""
    path, hf = tiny
    prompts = _prompts(hf)
    params = [greedy(14) for _ in prompts]
    params[1] = greedy(14, logprobs=2)
    llm = _llm(path, _config())
    outs = llm.generate(prompts, params)
    plain = _llm(path, _config(), fused=False).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] == full_depth(prompts, params)
    for a, b in zip(outs[1].logprobs, plain[1].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    # a sampled request beside a greedy one (it outlasts the greedy one: a round emits at most 5
    # tokens a sequence): every round op by op
    llm.engine.strategy.fused.rounds = 0
    sampled = eecore.SamplingParams(max_tokens=80, temperature=0.8, seed=3, ignore_eos=True)
    outs = llm.generate(prompts[:2], [sampled, greedy(12)])
    assert outs[1].token_ids == full_depth(prompts[1:2], greedy(12))[0]
    assert len(outs[0].token_ids) == 80
    assert llm.engine.strategy.fused.rounds == 0


def test_fused_rounds_with_preemption(tiny, full_depth):
    """Sequences preempted and recomputed between rounds (blocks freed, the copy's cache forgotten):
    full depth's tokens, every block freed."""
    path, hf = tiny
    prompts = _prompts(hf, (9, 3, 14, 7, 11, 5), seed=3)
    llm = _llm(path, _config(), num_blocks=24)
    outs = llm.generate(prompts, greedy(12))
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "no sequence was preempted"
    assert llm.engine.strategy.fused.rounds > 0
    assert [o.token_ids for o in outs] == full_depth(prompts, greedy(12))
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_configs_a_fused_round_cannot_run_are_left_op_by_op(tiny):
    path, _ = tiny
    for config in (eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(1)),  # shared layers
                   eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
                       1, copy=eecore.DraftCopy(top_k=2)))):  # token trees
        llm = eecore.LLM(path, dtype="float32", device="cpu", speculative=config, fused_rounds=True)
        assert llm.engine.strategy.fused is None
