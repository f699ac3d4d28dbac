"""The static decode step (eecore.engine.static_decode) on the CPU: the code a CUDA graph captures,
run eagerly. Padded to a capture size, on buffers at fixed addresses, it must give the plain
step's tokens and logprobs, count only the real rows' work, and allocate nothing step to step.
tests/test_engine_cuda.py checks the captured graphs against eager mode on a GPU."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

import eecore
from eecore.engine.inputs import InputBuilder, Row
from eecore.engine.llm_engine import EngineConfig
from eecore.engine.sequence import Sequence
from eecore.engine.static_decode import StaticDecode, StaticVerify
from eecore.engine.static_pass import capture_sizes
from eecore.speculative.draft_stack import CATCH_UP_WIDTH
from eecore.speculative.static_passes import StaticExitVerify, StaticLayers
from eecore.engine.piecewise import PiecewiseForward
from eecore.exits.static_segments import StaticExitSegments
from engine_utils import assert_same_outputs, emulate_graphs, generate_arriving, greedy, random_prompts
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("static"), num_layers=3)


def _llm(path, static: bool, prepare: Optional[bool] = None, **kw):
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=kw.pop("num_blocks", 96), block_size=4,
                     max_num_seqs=kw.pop("max_num_seqs", 12), **kw)
    if static:
        runner = llm.engine.runner
        runner.static_decode = StaticDecode(runner, llm.engine.config.max_num_seqs, capture=False, prepare=prepare)
    return llm


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(33) == [1, 2, 4, 8, 16, 24, 32, 33]


@pytest.mark.parametrize("num_prompts", [1, 3, 7, 12])
def test_same_tokens_and_logprobs_as_the_plain_step(tiny, num_prompts):
    # Different max_tokens: requests finish on different steps, so the batch shrinks through
    # several padded sizes (7 -> 8, 5 -> 8, 3 -> 4, ...).
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3 + (5 * i) % 11 for i in range(num_prompts)], seed=1)
    params = [greedy(4 + 2 * i, logprobs=3) for i in range(num_prompts)]
    plain = _llm(path, static=False).generate(prompts, params)
    llm = _llm(path, static=True)
    assert_same_outputs(llm.generate(prompts, params), plain)
    assert llm.engine.runner.static_decode.outputs, "the static step never ran"


@pytest.mark.parametrize("num_blocks", [96, 12])  # 12: sequences are preempted and recomputed
def test_steps_prepared_ahead_give_the_same_outputs(tiny, num_blocks, monkeypatch):
    """EECORE_PREPARE_NEXT_STEP: each decode step's inputs filled in during the step before. With
    blocks of 4 tokens a row gains a block every fourth step, requests finish on different steps
    and (12 blocks) are preempted, so prepared steps are used, patched and thrown away."""
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "0")  # which prepares its steps by itself
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3 + (5 * i) % 11 for i in range(6)], seed=5)
    params = [greedy(6 + 3 * i, logprobs=2) for i in range(6)]
    plain = _llm(path, static=False, num_blocks=num_blocks).generate(prompts, params)
    llm = _llm(path, static=True, prepare=True, num_blocks=num_blocks)
    assert_same_outputs(llm.generate(prompts, params), plain)
    builder = llm.engine.runner.builder
    assert builder.prepared_steps > 0, "no step used its prepared inputs"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_environment_switch_turns_preparing_on(tiny, switch, monkeypatch):
    monkeypatch.setenv("EECORE_PREPARE_NEXT_STEP", switch)
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "0")
    path, hf = tiny
    llm = _llm(path, static=True)
    llm.generate(random_prompts(hf.config.vocab_size, [5, 7], seed=6), greedy(6))
    assert (llm.engine.runner.builder.prepared_steps > 0) == (switch == "1")


@pytest.mark.parametrize("num_blocks", [96, 12])  # 12: sequences are preempted and recomputed
def test_steps_launched_ahead_give_the_same_outputs(tiny, num_blocks, monkeypatch):
    """EECORE_DECODE_AHEAD: each greedy step launches the next before its tokens are read back.
    Requests finish on different steps (the next step takes the ahead step's rows that remain),
    rows cross into new blocks (no step ahead there) and, with 12 blocks, are preempted (the
    ahead step is not taken); the layers' counted work stays the plain engine's."""
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3 + (5 * i) % 11 for i in range(6)], seed=9)
    params = [greedy(6 + 3 * i) for i in range(6)]
    plain_llm = _llm(path, static=False, num_blocks=num_blocks)
    plain = plain_llm.generate(prompts, params)
    llm = _llm(path, static=True, num_blocks=num_blocks)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.engine.runner.static_decode.ahead_taken > 0
    assert llm.engine.runner.layer_tokens == plain_llm.engine.runner.layer_tokens
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_a_lone_sequence_launches_every_step_ahead(tiny, monkeypatch):
    """Blocks of 4: every fourth step's successor needs a new block, which the step launching it
    ahead takes from the spare ones; so every decode step after the first comes from a step
    launched ahead."""
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    path, hf = tiny
    prompt = random_prompts(hf.config.vocab_size, [6], seed=12)
    plain = _llm(path, static=False).generate(prompt, greedy(20))
    llm = _llm(path, static=True)
    assert [o.token_ids for o in llm.generate(prompt, greedy(20))] == [o.token_ids for o in plain]
    assert llm.engine.runner.static_decode.ahead_taken == 20 - 2  # 19 decode steps, the first not ahead
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_an_ahead_step_is_not_taken_for_a_sequence_whose_blocks_changed(tiny, monkeypatch):
    """A sequence preempted and recomputed since the ahead step ran holds new blocks (a new table
    list): the ahead step's K/V went into the old ones, so its logits must not stand in for the
    step, even at the same position with the same token."""
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    path, hf = tiny
    llm = _llm(path, static=True)
    engine = llm.engine
    seq = engine.add_request(random_prompts(hf.config.vocab_size, [6], seed=13)[0], greedy(8))
    while engine.strategy._ahead is None:
        engine.step()
    ahead, static = engine.strategy._ahead, engine.runner.static_decode
    row = Row(seq, seq.num_computed_tokens, [seq.last_token_id])
    table = seq.block_table
    seq.block_table = list(table)  # what BlockManager.free then grow leaves: a new list
    assert static.take_ahead(ahead, [row]) is None
    seq.block_table = table
    assert static.take_ahead(ahead, [row]) is not None


@pytest.mark.parametrize("every", [1, 3])
def test_steps_launched_ahead_with_requests_arriving(tiny, every, monkeypatch):
    """Requests added while others decode: steps that mix decodes with prompt chunks leave the
    ahead step untaken, and the decodes after them launch ahead again."""
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [4 + (7 * i) % 13 for i in range(5)], seed=11)
    params = [greedy(5 + 2 * i) for i in range(5)]
    plain = generate_arriving(_llm(path, static=False), prompts, params, every)
    llm = _llm(path, static=True)
    assert [o.token_ids for o in generate_arriving(llm, prompts, params, every)] == [o.token_ids for o in plain]
    assert llm.engine.runner.static_decode.ahead_taken > 0


@pytest.mark.parametrize("other", ["logprobs", "top-p", "both"])
def test_steps_with_logprobs_or_top_p_launch_ahead_too(tiny, other, monkeypatch):
    """A row's log-probabilities are computed on the device and read back with the tokens, and a
    top-p row's nucleus search reads the device before the launch: such steps launch ahead too,
    with the plain engine's tokens and log-probabilities (every row's, or some rows')."""
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 8, 3], seed=10)
    top_p = eecore.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True,
                                  logprobs=3 if other == "both" else None)
    second = greedy(6, logprobs=2) if other == "logprobs" else top_p
    params = [greedy(6, logprobs=1 if other == "both" else None), second, greedy(6)]
    plain = _llm(path, static=False).generate(prompts, params)
    llm = _llm(path, static=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.logprobs for o in outs] == [o.logprobs for o in plain]
    assert llm.engine.runner.static_decode.ahead_taken > 0
    every = [greedy(5, logprobs=4)] * 3  # every row with logprobs
    assert [o.logprobs for o in llm.generate(prompts, every)] == \
        [o.logprobs for o in _llm(path, static=False).generate(prompts, every)]


@pytest.mark.parametrize("num_blocks", [96, 12])
def test_sampled_steps_launched_ahead_draw_what_plain_steps_draw(tiny, num_blocks, monkeypatch):
    """Sampled rows (temperature, top-k; seeded and not) draw on the device and launch ahead: the
    same tokens as plain steps, since each row takes the same numbers from its generator in the
    same order; with 12 blocks, through preemptions. Every row samples, so the steps taken ahead
    are sampled ones."""
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3 + (5 * i) % 11 for i in range(5)], seed=14)
    params = [eecore.SamplingParams(max_tokens=6 + 2 * i, temperature=0.9, seed=20 + i, ignore_eos=True,
                                    top_k=50 if i % 2 else 0) for i in range(4)]
    params.append(eecore.SamplingParams(max_tokens=9, temperature=0.7, top_k=5, ignore_eos=True))  # unseeded
    plain_llm = _llm(path, static=False, num_blocks=num_blocks, seed=5)
    llm = _llm(path, static=True, num_blocks=num_blocks, seed=5)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [o.token_ids for o in plain_llm.generate(prompts, params)]
    assert llm.engine.runner.static_decode.ahead_taken > 0
    unseeded = [eecore.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)] * 3
    assert [o.token_ids for o in llm.generate(prompts[:3], unseeded)] == \
        [o.token_ids for o in plain_llm.generate(prompts[:3], unseeded)]


def _two_decode_rows():
    seqs = [Sequence([1, 2, 3, 4, 5], eecore.SamplingParams(max_tokens=9)),
            Sequence([6, 7, 8], eecore.SamplingParams(max_tokens=9))]
    seqs[0].block_table, seqs[1].block_table = [2, 5], [7]
    return seqs, [Row(seqs[0], 5, [11]), Row(seqs[1], 3, [12])]


def _fields(inputs):
    a = inputs.attn
    return [t.tolist() for t in (inputs.token_ids, a.positions, a.slot_mapping, a.block_table, a.seq_lens,
                                 a.query_start_loc, inputs.last_rows)] + [inputs.row_lens, a.max_query_len]


def test_a_prepared_step_is_the_step_built_anew():
    """prepare_decode, then the rows it predicted (one position further, new tokens, the second
    row given the block its next token needs): build's inputs are those of a fresh build."""
    def builder():
        return InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, block_size=4,
                            device=torch.device("cpu"), pad_block=9)
    ahead, fresh = builder(), builder()
    seqs, rows = _two_decode_rows()
    ahead.build(rows, pad_to=2, table_width=ahead.table_width_bucket(rows))
    ahead.prepare_decode(rows, pad_to=2)
    seqs[1].block_table.append(3)  # position 4 of the second sequence starts block 1
    following = [Row(seqs[0], 6, [21]), Row(seqs[1], 4, [22])]
    width = fresh.table_width_bucket(following)
    got = ahead.build(following, pad_to=2, table_width=width)
    assert ahead.prepared_steps == 1
    assert _fields(got) == _fields(fresh.build(following, pad_to=2, table_width=width))
    assert got.attn.slot_mapping.tolist() == [5 * 4 + 2, 3 * 4 + 0]


@pytest.mark.parametrize("change", ["other sequence", "other start", "freed table", "two tokens", "other size"])
def test_a_prepared_step_that_did_not_come_is_built_anew(change):
    builder = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, block_size=4,
                           device=torch.device("cpu"), pad_block=9)
    fresh = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, block_size=4,
                         device=torch.device("cpu"), pad_block=9)
    seqs, rows = _two_decode_rows()
    builder.prepare_decode(rows, pad_to=2)
    seqs[1].block_table.append(3)
    following = [Row(seqs[0], 6, [21]), Row(seqs[1], 4, [22])]
    pad_to = 2
    if change == "other sequence":
        other = Sequence([1, 2, 3, 4, 5, 6], eecore.SamplingParams(max_tokens=9))
        other.block_table = [4, 6]
        following[0] = Row(other, 6, [21])
    elif change == "other start":
        following[0] = Row(seqs[0], 5, [21])
    elif change == "freed table":
        seqs[0].block_table = [2, 5]  # the same blocks, a new list: the sequence was freed and refilled
    elif change == "two tokens":
        following[0] = Row(seqs[0], 6, [21, 23])
        pad_to = None
    else:
        pad_to = 4
    width = None if pad_to is None else fresh.table_width_bucket(following)
    got = builder.build(following, pad_to=pad_to, table_width=width)
    assert builder.prepared_steps == 0
    assert _fields(got) == _fields(fresh.build(following, pad_to=pad_to, table_width=width))


def test_counts_only_real_rows_and_frees_every_block(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 9, 2], seed=2)
    plain, static = _llm(path, static=False), _llm(path, static=True)
    plain.generate(prompts, greedy(6))
    static.generate(prompts, greedy(6))
    # 3 rows padded to 4 each step: the layers still did the plain engine's work, no more
    assert static.engine.runner.layer_tokens == plain.engine.runner.layer_tokens
    assert static.engine.blocks.num_free_blocks == static.engine.blocks.num_blocks


def test_with_preemption(tiny):
    # 12 blocks of 4 tokens for 6 requests of ~20 tokens: sequences are preempted and recomputed.
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 14, 7, 11, 5], seed=3)
    plain = _llm(path, static=False, num_blocks=12).generate(prompts, greedy(10))
    llm = _llm(path, static=True, num_blocks=12)
    assert [o.token_ids for o in llm.generate(prompts, greedy(10))] == [o.token_ids for o in plain]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_buffers_are_reused_step_to_step(tiny, monkeypatch):
    """What a graph replays reads and writes fixed addresses: the inputs of a padded size and its
    logits are the same tensors' storage on every step of that size."""
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "0")  # every step through `run`, which the spy watches
    path, hf = tiny
    llm = _llm(path, static=True)
    static = llm.engine.runner.static_decode
    seen = {}
    run = static.run

    def spy(rows, tap=None):
        inputs, logits = run(rows, tap)
        size = static.padded_size(len(rows))
        ptrs = (inputs.token_ids.data_ptr(), inputs.attn.block_table.data_ptr(), inputs.attn.seq_lens.data_ptr(),
                inputs.attn.slot_mapping.data_ptr(), logits.data_ptr(), tuple(inputs.attn.block_table.shape))
        assert seen.setdefault(size, ptrs) == ptrs
        return inputs, logits

    static.run = spy
    prompts = random_prompts(hf.config.vocab_size, [4, 6, 8], seed=4)
    llm.generate(prompts, [greedy(8), greedy(5), greedy(3)])
    assert set(seen) == {1, 2, 4}


def test_the_default_engine_on_the_cpu_has_no_static_step(tiny):
    path, _ = tiny
    assert eecore.LLM(path, dtype="float32", device="cpu", num_blocks=16).engine.runner.static_decode is None


def test_graphs_need_cuda(tiny):
    path, _ = tiny
    llm = _llm(path, static=False)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticDecode(llm.engine.runner, 4, capture=True)


def test_enforce_eager_must_be_a_bool():
    with pytest.raises(ValueError, match="'enforce_eager' must be a bool"):
        EngineConfig(enforce_eager="yes")


def test_padding_rows_live_in_the_pad_block():
    builder = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=3, block_size=4,
                           device=torch.device("cpu"), pad_block=9)
    seq = Sequence([1, 2, 3, 4, 5], eecore.SamplingParams(max_tokens=4))
    seq.block_table = [2, 5]
    inputs = builder.build([Row(seq, 5, [7])], pad_to=4)
    assert inputs.token_ids.tolist() == [7, 0, 0, 0]
    assert inputs.attn.slot_mapping.tolist() == [5 * 4 + 1, 36, 36, 36]
    assert inputs.attn.seq_lens.tolist() == [6, 1, 1, 1]
    assert inputs.attn.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inputs.attn.block_table.tolist() == [[2, 5, -1], [9, -1, -1], [9, -1, -1], [9, -1, -1]]
    assert inputs.attn.positions.tolist() == [5, 0, 0, 0]
    assert inputs.last_rows.tolist() == [0, 1, 2, 3]


def test_padding_errors():
    builder = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=3, block_size=4, device=torch.device("cpu"),
                           pad_block=9)
    seq = Sequence([1, 2, 3], eecore.SamplingParams(max_tokens=4))
    seq.block_table = [0]
    with pytest.raises(ValueError, match="padding to 1 rows of 1 tokens takes at most that many rows"):
        builder.build([Row(seq, 3, [7]), Row(seq, 3, [8])], pad_to=1)
    with pytest.raises(ValueError, match="rows of 1 to 1 tokens each"):
        builder.build([Row(seq, 1, [7, 8])], pad_to=2)
    with pytest.raises(ValueError, match="rows of 1 to 2 tokens each"):
        builder.build([Row(seq, 1, [7, 8, 9])], pad_to=2, width=2)
    wide = InputBuilder(max_tokens=160, max_seqs=2, max_blocks_per_seq=20, block_size=4, device=torch.device("cpu"),
                        pad_block=9)
    with pytest.raises(ValueError, match="token trees: rows of at most 64"):
        wide.build([Row(seq, 1, list(range(65)), parents=[-1] + list(range(64)))], pad_to=2, width=65)
    no_pad = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=3, block_size=4, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="padding needs the KV cache's pad block"):
        no_pad.build([Row(seq, 3, [7])], pad_to=2)


def _builder_and_two_sequences():
    """A padding InputBuilder (3 rows of 16 tokens, blocks of 4, pad block 9) and two sequences in
    its cache: 5 tokens in blocks 2, 5, 6, and 2 tokens in blocks 3, 4."""
    builder = InputBuilder(max_tokens=16, max_seqs=3, max_blocks_per_seq=3, block_size=4,
                           device=torch.device("cpu"), pad_block=9)
    seq = Sequence([1, 2, 3, 4, 5], eecore.SamplingParams(max_tokens=4))
    seq.block_table = [2, 5, 6]
    other = Sequence([1, 2], eecore.SamplingParams(max_tokens=4))
    other.block_table = [3, 4]
    return builder, seq, other


def test_rows_padded_to_a_width():
    """A verify pass's rows padded to W tokens: the extra tokens write K/V into the sequence's own
    next slots (reserved by the round) at its last position for RoPE; padding sequences hold W
    tokens in the pad block, wrapping around it."""
    builder, seq, full = _builder_and_two_sequences()
    inputs = builder.build([Row(seq, 4, [7, 8]), Row(full, 1, [6, 1, 2, 3, 4])], pad_to=3, width=5)
    assert inputs.token_ids.tolist() == [7, 8, 8, 8, 8, 6, 1, 2, 3, 4, 0, 0, 0, 0, 0]
    assert inputs.attn.positions.tolist() == [4, 5, 5, 5, 5, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    assert inputs.attn.slot_mapping.tolist() == [20, 21, 22, 23, 24, 13, 14, 15, 16, 17, 36, 37, 38, 39, 36]
    assert inputs.attn.seq_lens.tolist() == [9, 6, 5]
    assert inputs.attn.query_start_loc.tolist() == [0, 5, 10, 15]
    assert inputs.attn.max_query_len == 5
    assert inputs.attn.block_table.tolist() == [[2, 5, 6], [3, 4, -1], [9, 9, -1]]


def test_token_trees_padded_to_a_width():
    """A tree row of a padded step: its tokens at their depths, seeing their ancestors; the padding
    after them at the tree's deepest position, each seeing itself alone (its K/V in the round's
    reserved slots); a chain row beside it and the padding rows see every token before them."""
    builder, seq, chain = _builder_and_two_sequences()
    # the pending token 7, its draft 8 and runner-up 9 (both children of 7), then 10 after 8
    inputs = builder.build([Row(seq, 4, [7, 8, 9, 10], parents=[-1, 0, 0, 1]), Row(chain, 1, [6, 1])],
                           pad_to=3, width=5)
    assert inputs.token_ids.tolist() == [7, 8, 9, 10, 10, 6, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert inputs.attn.positions.tolist() == [4, 5, 5, 6, 6, 1, 2, 2, 2, 2, 0, 1, 2, 3, 4]
    assert inputs.attn.slot_mapping.tolist() == [20, 21, 22, 23, 24, 13, 14, 15, 16, 17, 36, 37, 38, 39, 36]
    chains = [1, 3, 7, 15, 31]
    assert inputs.attn.tree_mask.tolist() == [1, 3, 5, 11, 16] + chains + chains
    assert inputs.attn.query_start_loc.tolist() == [0, 5, 10, 15]


SPEC_CONFIGS = {
    "lookup": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, lookup=eecore.LookupDrafts()),
    "copy": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
        2, copy=eecore.DraftCopy())),
    "hybrid-token": lambda: eecore.SelfSpeculativeConfig(
        num_speculations=4, layer=eecore.LayerDrafts(2, max_length=2, copy=eecore.DraftCopy()),
        lookup=eecore.LookupDrafts(min_ngram=2), hybrid_switch="token"),
    "copy-exits": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
        2, stop_below=0.0, exit_threshold=0.0035, copy=eecore.DraftCopy())),
    # token trees: the copy's runners-up verified beside its chain (EECORE_TREE_GRAPHS)
    "copy-tree": lambda: eecore.SelfSpeculativeConfig(num_speculations=2, layer=eecore.LayerDrafts(
        2, copy=eecore.DraftCopy(top_k=3))),
}


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_static_verify_pass_gives_the_varlen_pass_tokens(tiny, name, monkeypatch):
    """Self-speculation's verify pass through every layer, padded to the verify width on static
    buffers, and a draft copy's one-token passes on static buffers (the code CUDA graphs capture,
    run eagerly), give the varlen passes' tokens, exits and logprobs, do the same work, and leave
    every block free."""
    monkeypatch.setenv("EECORE_TREE_GRAPHS", "1")  # (read when the static verify pass is built)
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]  # repeats: prompt lookup finds matches
    params = [greedy(6 + 3 * i, logprobs=2) for i in range(len(prompts))]

    def run(static: bool):
        llm = _llm(path, static=False, speculative=SPEC_CONFIGS[name]())
        runner = llm.engine.runner
        stack = llm.engine.strategy.draft_stack
        if static:
            runner.static_verify = StaticVerify(runner, llm.engine.config.max_num_seqs, capture=False,
                                                width=llm.engine.strategy.lookahead)
            if stack is not None:  # the copy's passes too
                stack.static = stack.static_pass(capture=False)
        return llm, llm.generate(prompts, params)

    plain_llm, plain = run(False)
    llm, static = run(True)
    assert llm.engine.runner.static_verify.outputs, "the static verify pass never ran"
    stack = llm.engine.strategy.draft_stack
    if stack is not None:
        assert stack.static.outputs, "no static copy pass ran"
        assert stack.runner.layer_tokens == plain_llm.engine.strategy.draft_stack.runner.layer_tokens
        if name == "hybrid-token":  # rounds drafted by lookup alone: the copy catches up on several tokens
            assert max(key[-1] for key in stack.static.outputs) > 2
    if name == "copy-tree":
        assert any(key[-1] == "tree" for key in llm.engine.runner.static_verify.outputs), "no tree ran static"
    _assert_same_rounds(llm, static, plain_llm, plain)


def test_a_copy_catching_up_past_its_token_budget_with_static_passes(tiny):
    """A prompt longer than a pass's token budget: the copy's first round catches up in chunks, read
    by token, so every chunk runs op by op, the last one too however short (a static pass gives each
    row's last token only: taken for a last chunk of 2-16 tokens, it once failed with an index error
    or, with other rows beside it, took another row's state). One sequence at a time, so that each
    first pass holds one prompt: its catch-up (the prompt and the pending token) ends 2-9 tokens
    into a second chunk."""
    path, hf = tiny

    def llm_with(static: bool):
        llm = _llm(path, static=False, speculative=SPEC_CONFIGS["copy"](), max_num_seqs=1,
                   max_num_batched_tokens=32)
        stack = llm.engine.strategy.draft_stack
        if static:
            stack.static = stack.static_pass(capture=False)
        return llm

    budget = llm_with(False).engine.strategy.draft_stack.runner.builder.max_tokens
    prompts = random_prompts(hf.config.vocab_size, [budget + 1, budget + 4, budget + 8], seed=5)
    params = [greedy(8, logprobs=2) for _ in prompts]
    plain_llm, llm = llm_with(False), llm_with(True)
    plain, static = plain_llm.generate(prompts, params), llm.generate(prompts, params)
    stack = llm.engine.strategy.draft_stack
    assert stack.static.outputs and stack.catch_up_tokens > 3 * budget, "no catch-up went past the budget"
    _assert_same_rounds(llm, static, plain_llm, plain)


def _assert_same_rounds(llm, outs, plain_llm, plain) -> None:
    """Static (or graphed) self-speculation against the varlen passes: the same tokens, accepted
    drafts, exits and logprobs, the same work per layer, and every block freed."""
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.metrics["num_accepted_tokens"] for o in outs] == [o.metrics["num_accepted_tokens"] for o in plain]
    assert [o.exit_layers for o in outs] == [o.exit_layers for o in plain]
    for a, b in zip(outs, plain):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a)
    assert llm.engine.runner.layer_tokens == plain_llm.engine.runner.layer_tokens
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_static_layers_take_rows_up_to_their_width_whose_padding_fits(tiny):
    """A two-token pass pads one-token rows by a position, which must lie in the sequence's blocks;
    rows past the width, token trees and batches past the largest size go op by op."""
    path, _ = tiny
    llm = _llm(path, static=False)
    layers = StaticLayers(llm.engine.runner, 4, capture=False, max_width=2)
    seq = Sequence(list(range(1, 8)), eecore.SamplingParams(max_tokens=4))
    llm.engine.blocks.grow(seq, 8)  # 8 positions: two blocks of 4
    assert layers.takes([Row(seq, 6, [7])]) and layers.takes([Row(seq, 6, [7, 8])])
    assert not layers.takes([Row(seq, 5, [6, 7, 8])])
    assert not layers.takes([Row(seq, 7, [8]), Row(seq, 6, [7, 8])])  # its padding at 8 is past its blocks
    assert layers.takes([Row(seq, 7, [8])])  # alone it runs one token: no padding
    assert not layers.takes([Row(seq, 6, [7, 8], parents=[-1, 0])])
    assert not layers.takes([Row(seq, 6, [7])] * 5)
    assert not StaticLayers(llm.engine.runner, 4, capture=False).takes([Row(seq, 6, [7, 8])])
    wide = StaticLayers(llm.engine.runner, 4, capture=False, max_width=4)
    assert wide.takes([Row(seq, 4, [5, 6, 7])]) and wide._width([Row(seq, 4, [5, 6, 7])]) == 4
    assert not wide.takes([Row(seq, 5, [6, 7, 8])])  # padded to 4, its last position (9) is past its blocks
    builder = llm.engine.runner.builder
    tight = StaticLayers(llm.engine.runner, 4, capture=False, max_width=4)
    builder.max_tokens, saved = 7, builder.max_tokens  # a padded pass of 2 rows x 4 tokens would not fit
    try:
        assert not tight.takes([Row(seq, 4, [5, 6, 7]), Row(seq, 4, [5])])
    finally:
        builder.max_tokens = saved
    llm.engine.blocks.free(seq)


@pytest.mark.parametrize("head", [False, True], ids=["states", "with a draft head"])
@pytest.mark.parametrize("longest", [1, 2, 3])
def test_a_few_token_static_pass_gives_the_varlen_pass(tiny, longest, head):
    """Rows of one to `longest` tokens padded to 1, 2 or 4: each row's last state (or with a draft
    head, the head's logits of it, computed inside the pass as a draft copy's are) and the K/V of
    every real position are the varlen pass's, bit for bit."""
    from eecore.models.exit_adapter import DraftHead

    path, hf = tiny
    llm = _llm(path, static=False)
    runner = llm.engine.runner
    prompts = random_prompts(hf.config.vocab_size, [5, 9, 3], seed=4)
    seqs = [Sequence(p + [1, 2, 3], eecore.SamplingParams(max_tokens=4)) for p in prompts]
    for seq in seqs:
        llm.engine.blocks.grow(seq, len(seq.prompt_token_ids) + 4)
    prefix = [Row(s, 0, s.prompt_token_ids[:-3]) for s in seqs]
    inputs = runner.prepare(prefix)
    runner.run_layers(runner.embed(inputs), inputs.attn, 0, runner.num_layers)
    lengths = [longest, 1, min(2, longest)]
    rows = [Row(s, len(s.prompt_token_ids) - 3, s.prompt_token_ids[-3:][:n]) for s, n in zip(seqs, lengths)]
    inputs = runner.prepare(rows)
    hidden = runner.run_layers(runner.embed(inputs), inputs.attn, 0, runner.num_layers)
    want = hidden.index_select(0, inputs.last_rows[: len(rows)]).clone()
    slots = inputs.attn.slot_mapping.clone()
    kv = [(runner.kv.k(i).flatten(0, 1)[slots].clone(), runner.kv.v(i).flatten(0, 1)[slots].clone())
          for i in range(runner.num_layers)]
    draft_head = DraftHead(runner.model, runner.num_layers, None, 4) if head else None
    if head:
        want = draft_head.columns(want).clone()
    layers = StaticLayers(runner, 4, capture=False, max_width=CATCH_UP_WIDTH, head=draft_head)
    assert layers.takes(rows)
    got = layers.run(rows)
    assert list(layers.outputs)[-1][-1] == {1: 1, 2: 2, 3: 4}[longest]  # the pass's width
    assert got.shape == want.shape and torch.equal(got, want)
    for i, (k, v) in enumerate(kv):
        assert torch.equal(runner.kv.k(i).flatten(0, 1)[slots], k) and torch.equal(runner.kv.v(i).flatten(0, 1)[slots], v)
    for seq in seqs:
        llm.engine.blocks.free(seq)


def test_static_verify_takes_plain_rows_up_to_its_width(tiny):
    path, _ = tiny
    llm = _llm(path, static=False)
    verify = StaticVerify(llm.engine.runner, 4, capture=False, width=3)
    seq = Sequence([1, 2, 3], eecore.SamplingParams(max_tokens=4))
    assert verify.takes([Row(seq, 2, [3, 4, 5])])
    assert not verify.takes([Row(seq, 2, [3, 4, 5, 6])])
    assert not verify.takes([Row(seq, 2, [3, 4], parents=[-1, 0])])
    assert not verify.takes([Row(seq, 2, [3])] * 5)



EARLY_EXIT_CONFIGS = {
    # (thresholds that let some iterations exit at each check of this tiny random model, others not)
    "softmax": lambda: eecore.EarlyExitConfig(measure="softmax", threshold=3e-5),
    "cosine-decay": lambda: eecore.EarlyExitConfig(measure="cosine", threshold=0.5, decay=2.0),
    "cosine": lambda: eecore.EarlyExitConfig(measure="cosine", threshold=0.5),
    "static": lambda: eecore.EarlyExitConfig(measure="static", exit_layer=2),
}


@pytest.mark.parametrize("name", list(EARLY_EXIT_CONFIGS))
def test_static_early_exit_segments_give_the_eager_iteration(tiny, name):
    """Early exit's iteration (rule "all", or a static exit) as static segments, the layers between
    two checks with the check that ends them (the code CUDA graphs capture, run eagerly): the same
    tokens, exit layers, logprobs and wasted layers as the eager iteration, the same layer work."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 2, 7], seed=5)
    params = [greedy(5 + 2 * i, logprobs=2 if i % 2 else None) for i in range(len(prompts))]

    def run(static: bool):
        llm = _llm(path, static=False, early_exit=EARLY_EXIT_CONFIGS[name]())
        strategy = llm.engine.strategy
        if static:
            strategy.static = StaticExitSegments(strategy, llm.engine.config.max_num_seqs, capture=False)
        return llm, llm.generate(prompts, params)

    eager_llm, eager = run(False)
    llm, static = run(True)
    segments = llm.engine.strategy.static
    assert segments.outputs, "no static segment ran"
    # the last segment, where an iteration reached it, computed its logits in the pass (the graph)
    last = [out for key, out in segments.outputs.items() if key[-1] == len(segments.segments) - 1]
    assert all(logits is not None for _, _, logits in last)
    assert [o.token_ids for o in static] == [o.token_ids for o in eager]
    assert [o.exit_layers for o in static] == [o.exit_layers for o in eager]
    exits = [e for o in static for e in o.exit_layers]
    assert min(exits) < 3, "nothing exited early: the test would not cover the exit path"
    assert last or name != "static", "a static exit's one segment is its last"
    for a, b in zip(static, eager):
        assert a.metrics.get("layers_wasted_per_token") == b.metrics.get("layers_wasted_per_token")
        for step_a, step_b in zip(a.logprobs or [], b.logprobs or []):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a)
    assert llm.engine.runner.layer_tokens == eager_llm.engine.runner.layer_tokens
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_compact_rule_stays_eager(tiny):
    path, _ = tiny
    llm = _llm(path, static=True, early_exit=eecore.EarlyExitConfig(measure="softmax", threshold=0.5,
                                                                    batch_rule="compact"))
    assert llm.engine.strategy.static is None


@pytest.mark.parametrize("name", ["softmax", "cosine-decay", "static"])
def test_early_exit_segments_replayed_as_graphs_give_the_eager_iteration(tiny, name):
    """Capture (a warm-up run, then a recording) and replay, emulated: a later segment continues
    the residual stream in place, so the warm-up's changes must be undone before the recording."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 2, 7], seed=5)
    params = [greedy(5 + 2 * i) for i in range(len(prompts))]
    eager = _llm(path, static=False, early_exit=EARLY_EXIT_CONFIGS[name]()).generate(prompts, params)
    llm = _llm(path, static=False, early_exit=EARLY_EXIT_CONFIGS[name]())
    strategy = llm.engine.strategy
    strategy.static = emulate_graphs(StaticExitSegments(strategy, llm.engine.config.max_num_seqs, capture=False))
    graphed = llm.generate(prompts, params)
    assert strategy.static.graphs
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert [o.exit_layers for o in graphed] == [o.exit_layers for o in eager]
    assert [o.metrics.get("layers_wasted_per_token") for o in graphed] == \
        [o.metrics.get("layers_wasted_per_token") for o in eager]


def test_decode_and_verify_replayed_as_graphs_give_the_eager_tokens(tiny, monkeypatch):
    """(Token trees' verify passes, EECORE_TREE_GRAPHS: graphs of their own, on their own buffers.)"""
    monkeypatch.setenv("EECORE_TREE_GRAPHS", "1")
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]
    params = [greedy(6 + 3 * i) for i in range(len(prompts))]
    for config in (None, SPEC_CONFIGS["hybrid-token"](), SPEC_CONFIGS["copy-tree"]()):
        eager = _llm(path, static=False, speculative=config).generate(prompts, params)
        llm = _llm(path, static=True, speculative=config)
        runner = llm.engine.runner
        emulate_graphs(runner.static_decode)
        if config is not None:
            runner.static_verify = emulate_graphs(StaticVerify(runner, llm.engine.config.max_num_seqs, capture=False,
                                                                width=llm.engine.strategy.lookahead))
            stack = llm.engine.strategy.draft_stack
            stack.static = emulate_graphs(stack.static_pass(capture=False))
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in eager]
        assert runner.static_decode.graphs or config is not None



def test_graphed_verify_accepts_perfect_drafts(tiny):
    """Drafts replaced by full depth's own greedy tokens must all be accepted by the verify pass
    replayed as (emulated) graphs: lossless verification would hide draft rows computed from stale
    inputs, since the pending token's row alone decides what is emitted."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    params = greedy(12)
    expected = {tuple(p): o.token_ids for p, o in zip(prompts, _llm(path, static=False).generate(prompts, params))}
    llm = _llm(path, static=True, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=3, layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy())))
    runner, decoder = llm.engine.runner, llm.engine.strategy
    runner.static_verify = emulate_graphs(StaticVerify(runner, llm.engine.config.max_num_seqs, capture=False,
                                                        width=decoder.lookahead))
    decoder.draft_stack.static = emulate_graphs(decoder.draft_stack.static_pass(capture=False))
    _draft_full_depths_tokens(decoder, expected)
    outs = llm.generate(prompts, params)
    assert runner.static_verify.graphs, "the verify pass was never replayed"
    # a round after one that accepted every draft begins with the last draft and the model's token:
    # that first copy pass is a graph of two tokens a sequence, not an op-by-op pass
    assert any(key[-1] == 2 for key in decoder.draft_stack.static.graphs)
    assert [o.token_ids for o in outs] == [expected[tuple(p)] for p in prompts]
    drafted = sum(o.metrics["num_drafted_tokens"] for o in outs)
    assert drafted > 0
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) == drafted


SHARED_LAYER_CONFIGS = {  # LayerSkip's own: drafts from the model's first E layers, verified from layer E
    "layer": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(2)),
    "layer-lookup": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(1),
                                                         lookup=eecore.LookupDrafts(min_ngram=2)),
    "layer-exits": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
        2, stop_below=0.0, exit_threshold=0.0035)),
}


def _graph_shared_layer_passes(llm):
    """The decoder's draft passes through layers 0..E-1 and its verify pass from the exit-query cache
    as emulated graphs (what a GPU engine builds wherever its decode steps are graphs)."""
    runner, decoder = llm.engine.runner, llm.engine.strategy
    rows = llm.engine.config.max_num_seqs
    decoder.proposer.static = emulate_graphs(StaticLayers(runner, rows, capture=False, num_layers=decoder.exit_layer))
    decoder.verifier.static_from_exit_states = emulate_graphs(StaticExitVerify(
        runner, rows, False, decoder.lookahead, decoder.exit_layer, decoder.verifier.exit_states))
    return decoder.proposer.static, decoder.verifier.static_from_exit_states


@pytest.mark.parametrize("name", list(SHARED_LAYER_CONFIGS))
def test_shared_layer_passes_replayed_as_graphs_give_the_varlen_passes(tiny, name):
    """LayerSkip's one-token draft passes (layers 0..E-1, shared KV cache) and its verify pass from
    the exit-query cache, padded to the verify width, as graphs: the same tokens, logprobs, exits
    and accepted drafts as the varlen passes, the same work per layer, every block freed."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]  # repeats: prompt lookup finds matches
    params = [greedy(6 + 3 * i, logprobs=2) for i in range(len(prompts))]
    plain_llm = _llm(path, static=False, speculative=SHARED_LAYER_CONFIGS[name]())
    plain = plain_llm.generate(prompts, params)
    llm = _llm(path, static=False, speculative=SHARED_LAYER_CONFIGS[name]())
    drafts, verify = _graph_shared_layer_passes(llm)
    graphed = llm.generate(prompts, params)
    assert drafts.graphs and verify.graphs, "a shared-layer pass never ran static"
    _assert_same_rounds(llm, graphed, plain_llm, plain)


def test_graphed_shared_layer_verify_accepts_perfect_drafts(tiny):
    """Draft tokens replaced by full depth's own must all be accepted from the exit-query cache by
    the graphed verify pass: the drafts' layer-E states and K/V come from the graphed draft passes."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    params = greedy(12)
    expected = {tuple(p): o.token_ids for p, o in zip(prompts, _llm(path, static=False).generate(prompts, params))}
    llm = _llm(path, static=False, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=3, layer=eecore.LayerDrafts(1, guard=None)))
    drafts, verify = _graph_shared_layer_passes(llm)
    _draft_full_depths_tokens(llm.engine.strategy, expected)
    outs = llm.generate(prompts, params)
    assert drafts.graphs and verify.graphs
    assert [o.token_ids for o in outs] == [expected[tuple(p)] for p in prompts]
    drafted = sum(o.metrics["num_drafted_tokens"] for o in outs)
    assert drafted > 0
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) == drafted


def _edit_proposals(decoder, edit) -> None:
    """After each draft pass, `edit(proposal, i, seq, k)` for each row i: seq's k-th proposal of the
    round (from 0)."""
    made: dict[int, int] = {}  # proposals so far this round, by sequence
    propose_round, propose_token = decoder.proposer.propose, decoder.picker.propose

    def round_drafts(*args, **kwargs):
        made.clear()
        return propose_round(*args, **kwargs)

    def edited(logits, seqs, *args, **kwargs):
        proposal = propose_token(logits, seqs, *args, **kwargs)
        for i, seq in enumerate(seqs):
            k = made[seq.seq_id] = made.get(seq.seq_id, -1) + 1
            edit(proposal, i, seq, k)
        return proposal

    decoder.proposer.propose, decoder.picker.propose = round_drafts, edited


def _draft_full_depths_tokens(decoder, expected: dict) -> None:
    """Replace each layer draft's token by full depth's next one (`expected`: prompt -> greedy
    output), after the draft passes have run."""
    def perfect(proposal, i, seq, k):
        wanted = expected[tuple(seq.prompt_token_ids)]
        if len(seq.output_token_ids) + k < len(wanted):
            proposal.tokens[i] = wanted[len(seq.output_token_ids) + k]

    _edit_proposals(decoder, perfect)


def test_graphed_shared_layer_passes_with_preemption(tiny):
    """Sequences preempted and recomputed between replays of LayerSkip's graphed passes: the same
    tokens and accepted drafts as the varlen passes, every block freed."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 14, 7, 11, 5], seed=3)
    prompts = [p + p[: len(p) // 2] for p in prompts]
    spec = SHARED_LAYER_CONFIGS["layer"]
    plain_llm = _llm(path, static=False, num_blocks=16, speculative=spec())
    plain = plain_llm.generate(prompts, greedy(10))
    llm = _llm(path, static=False, num_blocks=16, speculative=spec())
    drafts, verify = _graph_shared_layer_passes(llm)
    outs = llm.generate(prompts, greedy(10))
    assert drafts.graphs and verify.graphs
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "no sequence was preempted"
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.metrics["num_accepted_tokens"] for o in outs] == [o.metrics["num_accepted_tokens"] for o in plain]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_table_width_buckets():
    builder = InputBuilder(max_tokens=64, max_seqs=4, max_blocks_per_seq=40, block_size=4,
                           device=torch.device("cpu"), pad_block=99)

    def rows_with(*table_lens):
        out = []
        for n in table_lens:
            seq = Sequence([1], eecore.SamplingParams(max_tokens=4))
            seq.block_table = list(range(n))
            out.append(Row(seq, 0, [1]))
        return out

    assert builder.table_width_bucket(rows_with(1, 3)) == 8  # at least 8 blocks
    assert builder.table_width_bucket(rows_with(9)) == 16
    assert builder.table_width_bucket(rows_with(16, 2)) == 16
    assert builder.table_width_bucket(rows_with(17)) == 32
    assert builder.table_width_bucket(rows_with(33)) == 40  # never past the full width
    assert builder.table_width_bucket(rows_with(1), width=40) == 16  # a padding row of 40 tokens
    inputs = builder.build(rows_with(9), pad_to=2, table_width=16)
    assert inputs.attn.block_table.shape == (2, 16)
    with pytest.raises(ValueError, match="'table_width' must hold every row's block table"):
        builder.build(rows_with(9), pad_to=2, table_width=8)
    with pytest.raises(ValueError, match="'table_width' must hold"):
        builder.build(rows_with(1), pad_to=2, table_width=41)


def test_graphs_per_table_width_as_sequences_grow(tiny):
    """A graphed step plans attention for its tables' width, so the static passes key their graphs
    by a width bucket too: the batch moves between graphs as its longest sequence finishes or grows,
    replayed (emulated) with the plain step's tokens and logprobs."""
    path, hf = tiny
    # 11 blocks (width 16) while the 40-token prompt decodes, 8 once it has finished, then 16 and
    # 32 as the second sequence grows to 75 tokens
    prompts = random_prompts(hf.config.vocab_size, [3, 5, 40], seed=9)
    params = [greedy(20, logprobs=2), greedy(70, logprobs=2), greedy(4, logprobs=2)]
    plain = _llm(path, static=False).generate(prompts, params)
    llm = _llm(path, static=True)
    emulate_graphs(llm.engine.runner.static_decode)
    assert_same_outputs(llm.generate(prompts, params), plain)
    widths = {key[1] for key in llm.engine.runner.static_decode.graphs}
    assert {8, 16, 32} <= widths, widths


LOSSLESS_CONFIGS = {  # greedy outputs are full depth's whatever the drafts, the batches and the rounding
    "none": lambda: None,
    "lookup": SPEC_CONFIGS["lookup"],
    "copy": SPEC_CONFIGS["copy"],
    "hybrid-token": SPEC_CONFIGS["hybrid-token"],
    "gpu-preset": lambda: eecore.SelfSpeculativeConfig(num_speculations=4, adaptive=True, layer=eecore.LayerDrafts(
        2, copy=eecore.DraftCopy(), stop_below=0.15, long_draft_acceptance=0.5)),
    "hybrid-preset": lambda: eecore.SelfSpeculativeConfig(num_speculations=4, adaptive=True, layer=eecore.LayerDrafts(
        2, copy=eecore.DraftCopy(), stop_below=0.15), lookup=eecore.LookupDrafts()),
}


def _random_workload(r, seed: int, path, vocab_size: int, monkeypatch):
    """A random lossless engine and workload drawn from `r`, prompts from `seed` (see the test below): returns
    (build(graphs) -> LLM, prompts, params, arrive_every)."""
    name = r.choice(sorted(LOSSLESS_CONFIGS))
    monkeypatch.setenv("EECORE_DECODE_AHEAD", r.choice("01"))
    monkeypatch.setenv("EECORE_DRAFT_AHEAD", r.choice("01"))
    monkeypatch.setenv("EECORE_PREPARE_NEXT_STEP", r.choice("01"))
    monkeypatch.setenv("EECORE_VERIFY_AHEAD", "01"[seed % 2])  # (apart from `r`: the workloads stay as they were)
    piecewise, arrive_every = r.random() < 0.5, r.choice([0, 1, 3])
    num_blocks, max_len = r.choice([24, 48, 200]), r.choice([48, 160])
    kw = dict(num_blocks=num_blocks, max_num_seqs=r.choice([1, 3, 6]), max_model_len=max_len,
              max_num_batched_tokens=r.choice([16, 32, 64]), enable_prefix_caching=r.random() < 0.4)
    prompts = random_prompts(vocab_size, [r.randint(1, 120) for _ in range(r.randint(1, 7))], seed=seed)
    if r.random() < 0.5:
        prompts = [p + p[: len(p) // 2] for p in prompts]
    prompts = [p[: min(max_len, num_blocks * 4) - 8] for p in prompts]
    params = [greedy(r.randint(1, 40), logprobs=r.choice([None, 2]),
                     stop_token_ids=[r.randrange(vocab_size)] if r.random() < 0.3 else ())
              for _ in prompts]

    def build(graphs: bool, plain: bool = False):
        """`plain`: full depth on the same cache and budgets."""
        llm = _llm(path, static=graphs, speculative=None if plain else LOSSLESS_CONFIGS[name](), **kw)
        if graphs:
            runner, n, strategy = llm.engine.runner, llm.engine.config.max_num_seqs, llm.engine.strategy
            emulate_graphs(runner.static_decode)
            if piecewise:
                runner.piecewise = emulate_graphs(PiecewiseForward(runner, runner.builder.max_tokens, capture=False))
            if name != "none" and not plain:
                runner.static_verify = emulate_graphs(StaticVerify(runner, n, capture=False, width=strategy.lookahead))
                if strategy.draft_stack is not None:
                    strategy.draft_stack.static = emulate_graphs(strategy.draft_stack.static_pass(capture=False, max_batch=n))
        return llm

    return build, prompts, params, arrive_every


def _seeded_sampled(r, params: list) -> list:
    """About half of `params` (greedy) made seeded sampled requests: temperature, top-k and top-p drawn from `r`."""
    out = []
    for p in params:
        if r.random() < 0.5:
            out.append(p)
            continue
        kw = dict(max_tokens=p.max_tokens, temperature=r.choice([0.5, 1.0, 1.5]), ignore_eos=True,
                  seed=r.randrange(1 << 30), logprobs=p.logprobs, stop_token_ids=p.stop_token_ids)
        if r.random() < 0.4:
            kw["top_k"] = r.choice([1, 3, 20])
        if r.random() < 0.4:
            kw["top_p"] = r.choice([0.5, 0.9])
        out.append(eecore.SamplingParams(**kw))
    return out


@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_on_emulated_graphs_give_the_eager_tokens(tiny, seed, monkeypatch):
    """Random engines and workloads, every pass a GPU engine captures as an emulated graph (decode
    steps, verify passes, the copy's passes, the pieces of prefill and mixed steps) against the
    eager engine: greedy outputs and finish reasons must be equal. Each seed draws a lossless
    configuration, decode ahead, draft ahead (with the verify pass behind its chain or not) and
    next-step preparation on or off, a KV cache small enough to preempt or not, prefix caching, a
    step budget from 16 tokens, prompts up to 120 tokens (longer than the budget: chunked prefills
    and catch-ups) arriving at once or while others decode, repeated text for prompt lookup, stop
    tokens and log-probabilities. Found the catch-up bug above."""
    import random

    path, hf = tiny
    build, prompts, params, arrive_every = _random_workload(random.Random(seed), seed, path, hf.config.vocab_size,
                                                            monkeypatch)

    _assert_graphed_as_eager(build, prompts, params, arrive_every)


def _run_workload(build, prompts, params, arrive_every, graphs: bool, plain: bool = False):
    llm = build(graphs, plain)
    return llm, generate_arriving(llm, prompts, params, arrive_every) if arrive_every else \
        llm.generate(prompts, params)


def _assert_graphed_as_eager(build, prompts, params, arrive_every):
    """The workload's outputs, eager and on emulated graphs: equal tokens, finish reasons and
    logprobs, every block free after. Returns (the graphed engine's LLM, the eager outputs)."""
    _, eager = _run_workload(build, prompts, params, arrive_every, graphs=False)
    llm, graphed = _run_workload(build, prompts, params, arrive_every, graphs=True)
    assert [(o.token_ids, o.finish_reason) for o in graphed] == [(o.token_ids, o.finish_reason) for o in eager]
    for a, b in zip(graphed, eager):
        for step_a, step_b in zip(a.logprobs or [], b.logprobs or []):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    return llm, eager


@pytest.mark.parametrize("seed", range(100, 116))
def test_random_sampled_workloads_on_emulated_graphs_give_the_eager_tokens(tiny, seed, monkeypatch):
    """The random workloads above with seeded sampled requests beside the greedy ones: every output
    graphed as eager (a seed draws the same numbers whichever passes run), and under the adaptive
    presets, where a seeded sampled request never drafts, its tokens those full depth gives its seed
    (up to the shorter output: a cache smaller than the context leaves a sequence under
    self-speculation its verify width less room). Found top-k and top-p rows drawn in rank order by
    decode steps and in vocabulary order by rounds with drafts (Sampler.draw_own)."""
    import random

    path, hf = tiny
    build, prompts, params, arrive_every = _random_workload(random.Random(seed), seed, path, hf.config.vocab_size,
                                                            monkeypatch)
    params = _seeded_sampled(random.Random(seed * 7 + 1), params)
    llm, eager = _assert_graphed_as_eager(build, prompts, params, arrive_every)
    if getattr(llm.engine.strategy, "planner", None) is not None:  # the adaptive presets
        _, full = _run_workload(build, prompts, params, arrive_every, graphs=False, plain=True)
        for out, want, p in zip(eager, full, params):
            if not p.greedy:
                n = min(len(out.token_ids), len(want.token_ids))
                assert out.token_ids[:n] == want.token_ids[:n]


@pytest.mark.parametrize("seed", range(8))
def test_requests_aborted_between_steps_leave_the_others_their_tokens(tiny, seed, monkeypatch):
    """A server aborts a request whenever its client goes away: between any two steps, with a step
    launched ahead or a next step prepared for the batch that held it (on a GPU, with graphs). On
    random engines and workloads as above, with emulated graphs, the other requests' greedy outputs
    must be what they are without the aborts (the CPU's kernels give a row the same bits whatever
    shares its call), an aborted request's tokens a prefix of its own, and every block free after."""
    import random

    path, hf = tiny
    r = random.Random(1000 + seed)
    build, prompts, params, _ = _random_workload(r, 1000 + seed, path, hf.config.vocab_size, monkeypatch)
    aborts = {r.randrange(len(prompts)): r.randint(0, 30) for _ in range(r.randint(1, 3))}  # request: step
    expected = build(False).generate(prompts, params)
    engine = build(True).engine
    seqs = [engine.add_request(p, q, i) for i, (p, q) in enumerate(zip(prompts, params))]
    step = aborted = 0
    while engine.has_unfinished():
        for i in (i for i, at in aborts.items() if at == step):
            aborted += engine.abort_request(seqs[i])  # False: it had finished
        engine.step()
        step += 1
    outs = [engine.output(s) for s in seqs]
    for out, want in zip(outs, expected):
        if out.finish_reason == "abort":
            assert out.token_ids == want.token_ids[: len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)
    assert sum(out.finish_reason == "abort" for out in outs) == aborted
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("seed", range(8))
def test_a_step_that_fails_midway_is_recovered_with_the_tokens_of_a_clean_run(tiny, seed, monkeypatch):
    """A step raising while its tokens are appended (a request's own code failing: some rows have
    their tokens, the others not; on a GPU a step may be launched ahead), then recovered as the
    server does (LLMEngine.recover_from_failed_step: every running sequence recomputed). On random
    engines and workloads as above, with emulated graphs, every output must be the clean run's."""
    import random

    path, hf = tiny
    r = random.Random(5000 + seed)
    build, prompts, params, _ = _random_workload(r, 5000 + seed, path, hf.config.vocab_size, monkeypatch)
    fail_at = r.randint(1, 30)  # the append that raises
    expected = build(False).generate(prompts, params)
    engine = build(True).engine
    seqs = [engine.add_request(p, q, i) for i, (p, q) in enumerate(zip(prompts, params))]
    append, calls = engine.stopper.append, [0]

    def failing_append(seq, tokens):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("a request's code failed")
        return append(seq, tokens)

    monkeypatch.setattr(engine.stopper, "append", failing_append)
    failures = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except RuntimeError as error:
            assert "request's code" in str(error)
            assert engine.recover_from_failed_step() == []  # nobody's own code fails when probed again
            failures += 1
    assert failures == (calls[0] >= fail_at)
    assert [(engine.output(s).token_ids, s.finish_reason) for s in seqs] == \
        [(o.token_ids, o.finish_reason) for o in expected]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def _chains_ending_early(decoder) -> None:
    """Each sequence's chain ends after 1 + seq_id % 3 drafts a round, so that a round's later
    passes run fewer sequences than its first."""
    def ending(proposal, i, seq, k):
        if k >= 1 + seq.seq_id % 3:
            proposal.confident[i] = False

    _edit_proposals(decoder, ending)


@pytest.mark.parametrize("source", ["copy", "copy, chains ending early", "copy, draft ahead", "shared layers",
                                    "shared layers, chains ending early"])
def test_draft_passes_built_from_the_last_pass_draft_what_fresh_builds_draft(tiny, source, monkeypatch):
    """A round's later draft passes are built from the last pass's arrays (InputBuilder.advance),
    the chains that go on moved up where others ended: with a draft copy (pass by pass, or chained on
    the device) the same drafts, accepted as often, as with every pass built anew; with LayerSkip's
    shared layers, whose verify pass continues from the draft passes' states, full depth's tokens
    for drafts that are full depth's own."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 30], seed=13)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]
    params = [greedy(10 + 3 * i) for i in range(len(prompts))]
    if not source.startswith("shared layers"):
        monkeypatch.setenv("EECORE_DRAFT_AHEAD", "1" if source.endswith("ahead") else "0")
    expected = {tuple(p): o.token_ids for p, o in zip(prompts, _llm(path, static=False).generate(prompts, params))}

    def run(advance: bool):
        if not advance:
            monkeypatch.setattr(InputBuilder, "advance", lambda self, rows, pad_to: None)
        if source.startswith("shared layers"):
            llm = _llm(path, static=False, speculative=eecore.SelfSpeculativeConfig(
                num_speculations=3, layer=eecore.LayerDrafts(1, guard=None)))
            _graph_shared_layer_passes(llm)
            _draft_full_depths_tokens(llm.engine.strategy, expected)
            builder = llm.engine.runner.builder
        else:
            llm = _llm(path, static=True, speculative=eecore.SelfSpeculativeConfig(
                num_speculations=3, layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy())))
            stack = llm.engine.strategy.draft_stack
            stack.static = emulate_graphs(stack.static_pass(capture=False))
            builder = stack.runner.builder
        if source.endswith("ending early"):
            _chains_ending_early(llm.engine.strategy)
        return llm.generate(prompts, params), builder.advanced_steps

    advanced, steps = run(advance=True)
    fresh, none = run(advance=False)  # (the fixture puts advance back)
    assert steps > 10 and none == 0
    assert [o.token_ids for o in advanced] == [expected[tuple(p)] for p in prompts] == [o.token_ids for o in fresh]
    for a, f in zip(advanced, fresh):
        assert (a.metrics["num_drafted_tokens"], a.metrics["num_accepted_tokens"]) == \
            (f.metrics["num_drafted_tokens"], f.metrics["num_accepted_tokens"])
    assert sum(o.metrics["num_drafted_tokens"] for o in advanced) > 0
