"""Mixed prefill + decode steps on the engine (tiny models): the greedy tokens of every request are
those it gets alone, whatever rides beside it (chunks of later prompts, preemption), every step
keeps to the token budget, and strategies that cannot mix never get mixed steps."""
import pytest

import eecore
from eecore.engine.decoding import FullDepthDecoder
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model

VOCAB = 320


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("mixed"), num_layers=4)
    return path


def _llm(path, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 256)
    return eecore.LLM(path, dtype="float32", device="cpu", **kw)


def _record_steps(engine) -> list:
    """Wraps the scheduler so that every planned step is kept: (a stream was ready, decodes, prefills,
    tokens at plan time, decode cost)."""
    steps = []
    plan = engine.scheduler.schedule

    def schedule():
        # whether a running stream waited for its next token when this step was planned
        ready = any(not s.in_prefill for s in engine.scheduler.running)
        step = plan()
        if step is not None:
            steps.append((ready, len(step.decodes), len(step.prefills), step.num_tokens, step.decode_cost))
        return step

    engine.scheduler.schedule = schedule
    return steps


def _run_with_late_arrivals(engine, prompts, params) -> list:
    """The first request decodes alone for 3 steps, then the rest arrive at once; runs to the end."""
    seqs = [engine.add_request(prompts[0], params[0], 0)]
    for _ in range(3):
        engine.step()
    seqs += [engine.add_request(p, sp, i + 1) for i, (p, sp) in enumerate(zip(prompts[1:], params[1:]))]
    while engine.has_unfinished():
        engine.step()
    return seqs


def _alone(path, prompts, params) -> list[list[int]]:
    llm = _llm(path, max_num_seqs=1)
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def test_a_request_admitted_while_others_decode_gets_its_tokens_alone(tiny_path):
    prompts = random_prompts(VOCAB, [6, 9, 37, 21], seed=11)
    params = [greedy(20), greedy(16), greedy(12), greedy(14)]
    expected = _alone(tiny_path, prompts, params)
    llm = _llm(tiny_path, max_num_batched_tokens=12)
    engine = llm.engine
    steps = _record_steps(engine)
    first = [engine.add_request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts[:2], params[:2]))]
    for _ in range(4):
        engine.step()
    assert all(s.num_output_tokens > 0 for s in first)
    late = [engine.add_request(p, sp, 2 + i) for i, (p, sp) in enumerate(zip(prompts[2:], params[2:]))]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in first + late] == expected
    mixed = [(d, p) for _, d, p, _, _ in steps if d and p]
    assert mixed, "the late prompts' chunks rode with the running decodes"
    assert all(t <= 12 for _, _, _, t, _ in steps)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("budget", [5, 16, 1024])
def test_batch_invariance_with_mixed_steps(tiny_path, budget):
    prompts = random_prompts(VOCAB, [9, 3, 21, 14, 7, 30, 2, 11], seed=3)
    params = [greedy(8 + 2 * i) for i in range(len(prompts))]
    expected = _alone(tiny_path, prompts, params)
    llm = _llm(tiny_path, max_num_seqs=3, max_num_batched_tokens=budget)
    steps = _record_steps(llm.engine)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert any(d and p for _, d, p, _, _ in steps)
    # the same engine without mixing: the same tokens, and no mixed step
    split = _llm(tiny_path, max_num_seqs=3, max_num_batched_tokens=budget, mixed_steps=False)
    split_steps = _record_steps(split.engine)
    assert [o.token_ids for o in split.generate(prompts, params)] == expected
    assert not any(d and p for _, d, p, _, _ in split_steps)


def test_every_step_keeps_to_the_token_budget(tiny_path):
    prompts = random_prompts(VOCAB, [40, 3, 25, 17, 33, 8], seed=5)
    llm = _llm(tiny_path, max_num_seqs=4, max_num_batched_tokens=10)
    steps = _record_steps(llm.engine)
    llm.generate(prompts, greedy(10))
    assert max(t for _, _, _, t, _ in steps) == 10  # the budget is used, and never exceeded
    assert all(t <= 10 for _, _, _, t, _ in steps)


def test_preemption_with_mixed_steps_keeps_the_outputs(tiny_path):
    prompts = random_prompts(VOCAB, [13, 7, 22, 9, 17], seed=7)
    params = [greedy(24) for _ in prompts]
    expected = _alone(tiny_path, prompts, params)
    # 20 blocks of 4 slots: five requests that grow to 31..46 tokens cannot all hold their KV
    llm = _llm(tiny_path, num_blocks=20, max_num_seqs=5, max_num_batched_tokens=8)
    steps = _record_steps(llm.engine)
    outs = llm.generate(prompts, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert any(d and p for _, d, p, _, _ in steps)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_sampled_requests_with_seeds_are_unchanged_by_mixing(tiny_path):
    prompts = random_prompts(VOCAB, [5, 19, 11], seed=9)
    params = [eecore.SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=100 + i, ignore_eos=True)
              for i in range(3)]
    mixed = _llm(tiny_path, max_num_batched_tokens=6).generate(prompts, params)
    split = _llm(tiny_path, max_num_batched_tokens=6, mixed_steps=False).generate(prompts, params)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in split]


STRATEGIES = {
    "early_exit_compact": {"early_exit": eecore.EarlyExitConfig(measure="softmax", threshold=0.05,
                                                                batch_rule="compact")},
    "speculate": {"speculative": eecore.SelfSpeculativeConfig(exit_layer=2, num_speculations=3)},
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_strategies_without_mixed_steps_alternate_bounded_prefill_and_decode_steps(tiny_path, strategy):
    # (self-speculation alternates only with mixed_steps=False; with mixed steps it takes plain
    # mixed steps while prompts wait: the test below)
    prompts = random_prompts(VOCAB, [6, 31, 12, 25], seed=13)
    params = [greedy(14) for _ in prompts]
    reference = _llm(tiny_path, max_num_seqs=1, **STRATEGIES[strategy])
    expected = [reference.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    kinds = dict(mixed_steps=False) if strategy == "speculate" else {}
    llm = _llm(tiny_path, max_num_seqs=4, max_num_batched_tokens=8, **kinds, **STRATEGIES[strategy])
    assert not llm.engine.strategy.supports_mixed_steps and not llm.engine.scheduler.mixed
    engine = llm.engine
    steps = _record_steps(engine)
    seqs = _run_with_late_arrivals(engine, prompts, params)
    assert [s.output_token_ids for s in seqs] == expected
    assert not any(d and p for _, d, p, _, _ in steps)
    assert all(t <= 8 for _, d, p, t, _ in steps if p)  # prefill steps keep to the budget
    assert sum(1 for _, d, p, _, _ in steps[3:] if p) >= 4  # the 74 late prompt tokens took several steps
    # a stream that waits for its next token waits at most one prefill step
    for (_, _, prefilled, _, _), (ready, decoded, _, _, _) in zip(steps, steps[1:]):
        if prefilled and ready:
            assert decoded


def test_self_speculation_takes_plain_mixed_steps_while_prompts_wait(tiny_path):
    """While a prompt is being computed the running streams decode one token a step beside its
    chunks (a plain mixed step) instead of waiting a prefill step between rounds; once the prompts
    are in they speculate again. Greedy outputs stay full depth's."""
    prompts = random_prompts(VOCAB, [6, 31, 12, 25], seed=13)
    params = [greedy(14) for _ in prompts]
    config = STRATEGIES["speculate"]
    reference = _llm(tiny_path, max_num_seqs=1, **config)
    expected = [reference.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    llm = _llm(tiny_path, max_num_seqs=4, max_num_batched_tokens=8, **config)
    steps = _record_steps(llm.engine)
    seqs = _run_with_late_arrivals(llm.engine, prompts, params)
    assert [s.output_token_ids for s in seqs] == expected
    assert not any(ready and p and not d for ready, d, p, _, _ in steps)  # no stream waits out a prefill
    assert all(cost == 1 for _, d, p, _, cost in steps if d and p)        # mixed steps are plain ones
    assert any(d and p for _, d, p, _, _ in steps) and any(d and cost > 1 for _, d, _, _, cost in steps)


def test_full_depth_declares_mixed_steps():
    assert FullDepthDecoder.supports_mixed_steps


EARLY_EXIT_MIXED = {
    # exits at layer 2 of 4 for every token: static, and rule "all" with a threshold every row
    # passes at the first check (the softmax top-1 there is the static exit's token)
    "static": (eecore.EarlyExitConfig(measure="static", exit_layer=2), eecore.EarlyExitConfig(measure="static",
                                                                                             exit_layer=2)),
    "all_exits_at_first_check": (eecore.EarlyExitConfig(measure="softmax", threshold=0.0, min_exit_layer=2),
                                 eecore.EarlyExitConfig(measure="static", exit_layer=2)),
    # rule "all" with a threshold no row passes: full depth
    "all_never_confident": (eecore.EarlyExitConfig(measure="softmax", threshold=1.0), None),
}


@pytest.mark.parametrize("case", list(EARLY_EXIT_MIXED))
def test_early_exit_mixed_steps_keep_the_tokens_of_each_request_alone(tiny_path, case):
    config, reference_config = EARLY_EXIT_MIXED[case]
    prompts = random_prompts(VOCAB, [6, 31, 12, 25, 3], seed=17)
    params = [greedy(12) for _ in prompts]
    reference = _llm(tiny_path, max_num_seqs=1, early_exit=reference_config) if reference_config else \
        _llm(tiny_path, max_num_seqs=1)
    expected = [reference.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    llm = _llm(tiny_path, max_num_seqs=4, max_num_batched_tokens=10, early_exit=config)
    assert llm.engine.strategy.supports_mixed_steps and llm.engine.scheduler.mixed
    steps = _record_steps(llm.engine)
    engine = llm.engine
    seqs = _run_with_late_arrivals(engine, prompts, params)
    assert any(d and p for _, d, p, _, _ in steps)
    assert all(t <= 10 for _, _, _, t, _ in steps)
    for seq, out in zip(seqs, expected):
        assert seq.output_token_ids == out.token_ids
        assert seq.exit_layers == out.exit_layers  # the first token (prefill) ran all 4 layers
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_early_exit_rule_compact_has_no_mixed_steps(tiny_path):
    llm = _llm(tiny_path, **STRATEGIES["early_exit_compact"])
    assert not llm.engine.strategy.supports_mixed_steps and not llm.engine.scheduler.mixed


@pytest.mark.parametrize("name,value", [("max_num_batched_tokens", 0), ("max_num_batched_tokens", -3),
                                        ("max_num_seqs", 0), ("max_num_batched_tokens", 2.5),
                                        ("mixed_steps", "yes")])
def test_bad_engine_knobs_name_the_argument(tiny_path, name, value):
    with pytest.raises(ValueError, match=name):
        _llm(tiny_path, **{name: value})


@pytest.mark.parametrize("flag,value", [("--max-num-batched-tokens", "0"), ("--max-num-seqs", "-1"),
                                        ("--max-num-batched-tokens", "many")])
@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_bad_cli_knobs_name_the_flag(capsys, command, flag, value):
    from eecore.cli import make_parser

    with pytest.raises(SystemExit) as exc:
        make_parser().parse_args(command + [flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
