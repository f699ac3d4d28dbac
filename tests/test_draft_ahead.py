"""Draft ahead (EECORE_DRAFT_AHEAD=1, eecore.speculative.proposers.CopyProposer): a draft copy's
passes take their tokens from the pass before on the device and the host reads the chain back
once. Every sequence drafts, and so emits, what the pass-by-pass chain does; only the passes a chain
stopped early would have skipped are extra. With EECORE_VERIFY_AHEAD=1 the round's verify pass goes
out behind the chain, from the chain's tokens on the device (eecore.speculative.verification.VerifyAhead),
and verifies each chain at its planned length: the same tokens and accepted drafts again."""
from __future__ import annotations

import os
import sys

import pytest

import eecore
from eecore.engine.static_decode import StaticVerify
from engine_utils import emulate_graphs, greedy, random_prompts
from model_factory import make_tiny_hf_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from cost_round import install_oracle  # noqa: E402 (the benchmarks' perfect drafts, cuda_e2e.py's too)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("ahead"), num_layers=3)


CONFIGS = {
    "copy": lambda: eecore.SelfSpeculativeConfig(num_speculations=4, layer=eecore.LayerDrafts(
        1, copy=eecore.DraftCopy())),
    # the exit-ready preset's rules: a chain stops below a top-1 probability, and goes past its
    # first draft only when that draft is sure enough while the sequence's drafts are rejected
    "stops": lambda: eecore.SelfSpeculativeConfig(num_speculations=4, layer=eecore.LayerDrafts(
        2, stop_below=0.0045, long_draft_acceptance=0.5, copy=eecore.DraftCopy())),
    # not chained: token trees, exits
    "trees": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
        1, copy=eecore.DraftCopy(top_k=2))),
    "exits": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
        1, stop_below=0.0, exit_threshold=0.0035, copy=eecore.DraftCopy())),
}


def _llm(path, config, ahead: bool, monkeypatch, num_blocks: int = 128, verify_ahead: bool = False):
    monkeypatch.setenv("EECORE_DRAFT_AHEAD", "1" if ahead else "0")
    monkeypatch.setenv("EECORE_VERIFY_AHEAD", "1" if verify_ahead else "0")
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=num_blocks, block_size=4, max_num_seqs=8,
                     speculative=config)
    runner, decoder = llm.engine.runner, llm.engine.strategy
    rows = llm.engine.config.max_num_seqs
    runner.static_verify = emulate_graphs(StaticVerify(runner, rows, capture=False, width=decoder.lookahead))
    decoder.draft_stack.static = emulate_graphs(decoder.draft_stack.static_pass(capture=False, max_batch=rows))
    return llm


def _chains(llm) -> list:
    """Records each chain: whether it began at the round's first pass (no first draft read back),
    and whether a stop rule dropped drafts its passes had run."""
    proposer, chains = llm.engine.strategy.proposer, []
    inner = proposer.chain

    def chain(seqs, drafts, budgets, live, opening=None, **named):
        before = sum(len(drafts[b]) for b in live)
        inner(seqs, drafts, budgets, live, opening, **named)
        ran = sum(budgets[b] for b in live) - before
        chains.append((opening is not None, ran > sum(len(drafts[b]) for b in live) - before))
    proposer.chain = chain
    return chains


def _calls(owner, method: str) -> list:
    """The batch size (rows or sequences: the first argument's length) of each call of owner.method."""
    calls, inner = [], getattr(owner, method)

    def counted(batch, *args):
        calls.append(len(batch))
        return inner(batch, *args)
    setattr(owner, method, counted)
    return calls


def _chained_passes(llm) -> list:
    """The passes that took their tokens on the device."""
    return _calls(llm.engine.strategy.draft_stack, "chained_pass")


def _verified_ahead(llm) -> list:
    """The verify passes launched behind a chain."""
    return _calls(llm.engine.runner.static_verify, "run_with_tokens")


@pytest.mark.parametrize("verify_ahead", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_draft_ahead_drafts_and_emits_what_the_pass_by_pass_chain_does(tiny, name, verify_ahead, monkeypatch):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 7], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]
    params = [greedy(8 + 3 * i, logprobs=2 if i % 2 else None) for i in range(len(prompts))]
    plain = _llm(path, CONFIGS[name](), False, monkeypatch).generate(prompts, params)
    llm = _llm(path, CONFIGS[name](), True, monkeypatch, verify_ahead=verify_ahead)
    chained, chains, verified = _chained_passes(llm), _chains(llm), _verified_ahead(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for key in ("num_drafted_tokens", "num_accepted_tokens"):
        assert [o.metrics[key] for o in outs] == [o.metrics[key] for o in plain]
    assert [o.exit_layers for o in outs] == [o.exit_layers for o in plain]
    for a, b in zip(outs, plain):
        for step_a, step_b in zip(a.logprobs or [], b.logprobs or []):
            assert step_a.keys() == step_b.keys() and all(abs(step_a[t] - step_b[t]) < 1e-5 for t in step_a)
    if name in ("trees", "exits"):
        assert not chained and not verified  # draft rules the chain does not take: pass by pass
    else:
        assert chained
        assert bool(verified) == verify_ahead
    if name == "stops":  # every path of the chain: from the first pass or after a first draft read back, cut short
        assert {opening for opening, _ in chains} == {True, False}
        assert any(cut for _, cut in chains), "no chain stopped early: the test would not cover the stop rule"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("verify_ahead", [False, True])
def test_adaptive_lengths_down_the_chain_keep_full_depths_tokens(tiny, verify_ahead, monkeypatch):
    """With the draft planner's lengths (which follow the passes' measured times, so two runs may
    draft differently) the chain still emits full depth's greedy tokens."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 7], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]
    params = greedy(16)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, params)
    llm = _llm(path, eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
        1, stop_below=0.003, copy=eecore.DraftCopy()), adaptive=True), True, monkeypatch, verify_ahead=verify_ahead)
    verified = _verified_ahead(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert bool(verified) == verify_ahead
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("verify_ahead", [False, True])
def test_perfect_drafts_go_down_the_chain(tiny, verify_ahead, monkeypatch):
    """Drafts replaced by full depth's own tokens (cost_round.install_oracle, which replaces a
    chain's drafts on the device, where a verify pass launched behind it reads them): every draft
    accepted, full depth's tokens, and the rounds' later passes chained."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    params = greedy(14)
    expected = {tuple(p): o.token_ids for p, o in zip(prompts, eecore.LLM(
        path, dtype="float32", device="cpu").generate(prompts, params))}
    llm = _llm(path, CONFIGS["copy"](), True, monkeypatch, verify_ahead=verify_ahead)
    install_oracle(llm, expected)
    chained, verified = _chained_passes(llm), _verified_ahead(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [expected[tuple(p)] for p in prompts]
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) == sum(o.metrics["num_drafted_tokens"] for o in outs)
    assert len(chained) >= 3 and max(chained) == len(prompts)  # whole rounds went down the chain
    assert bool(verified) == verify_ahead


@pytest.mark.parametrize("verify_ahead", [False, True])
def test_draft_ahead_with_preemption(tiny, verify_ahead, monkeypatch):
    """Sequences preempted and recomputed between chained rounds (their blocks freed, the copy's
    cache forgotten): the tokens and accepted drafts of the pass-by-pass chain, every block freed."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 14, 7, 11, 5], seed=3)
    prompts = [p + p[: len(p) // 2] for p in prompts]
    plain = _llm(path, CONFIGS["copy"](), False, monkeypatch, num_blocks=20).generate(prompts, greedy(12))
    llm = _llm(path, CONFIGS["copy"](), True, monkeypatch, num_blocks=20, verify_ahead=verify_ahead)
    chained, verified = _chained_passes(llm), _verified_ahead(llm)
    outs = llm.generate(prompts, greedy(12))
    assert chained and bool(verified) == verify_ahead
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "no sequence was preempted"
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.metrics["num_accepted_tokens"] for o in outs] == [o.metrics["num_accepted_tokens"] for o in plain]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks

