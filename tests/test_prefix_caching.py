"""Prefix caching: requests that start with the same full blocks of tokens share their K/V.

The block manager alone (naming, sharing, reference counts, eviction), then the engine: outputs
with the cache equal outputs without it, for every strategy, under preemption and eviction.
"""
import pytest

import eecore
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model
from eecore.engine.block_manager import BlockManager, block_digest
from eecore.engine.sequence import Sequence
from eecore.sampling_params import SamplingParams


def _seq(tokens):
    return Sequence(list(tokens), SamplingParams(max_tokens=4, ignore_eos=True))


def _prefill(blocks: BlockManager, seq: Sequence) -> int:
    """Admits `seq` as the scheduler does and marks its whole prompt computed; returns the cached tokens."""
    cached = blocks.share_cached_prefix(seq, seq.num_tokens - 1)
    seq.start_prefill(cached)
    blocks.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    blocks.cache_computed(seq)  # what the scheduler does at the next step
    return cached


# ---- the block manager ----------------------------------------------------------------------

def test_a_finished_prompt_leaves_its_full_blocks_cached_and_free():
    blocks = BlockManager(16, 4, prefix_caching=True)
    a = _seq(range(1, 12))  # 11 tokens: 2 full blocks and a partial one
    assert _prefill(blocks, a) == 0
    blocks.free(a)
    assert blocks.num_cached_blocks == 2 and blocks.num_free_blocks == 16


def test_a_later_request_shares_the_common_full_blocks_only():
    blocks = BlockManager(16, 4, prefix_caching=True)
    a = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    _prefill(blocks, a)
    b = _seq([1, 2, 3, 4, 5, 6, 7, 99, 9, 10, 11, 12])  # differs inside the second block
    assert _prefill(blocks, b) == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_computed_tokens == b.num_tokens
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free_blocks == 16


def test_a_shared_block_is_held_until_its_last_user_leaves():
    blocks = BlockManager(6, 4, prefix_caching=True)
    a = _seq(range(1, 10))
    _prefill(blocks, a)
    b = _seq(range(1, 10))
    assert _prefill(blocks, b) == 8  # both full blocks; the last token runs again
    blocks.free(a)
    # b still holds the two shared blocks: they cannot be handed out
    taken = _seq(range(100, 116))
    assert not blocks.can_grow(taken, 16)
    blocks.grow(taken, 12)
    assert not set(taken.block_table) & set(b.block_table)
    blocks.free(b)
    blocks.free(taken)
    assert blocks.num_free_blocks == 6


def test_the_whole_prompt_is_never_taken_from_the_cache():
    blocks = BlockManager(16, 4, prefix_caching=True)
    a = _seq(range(1, 9))  # exactly 2 blocks
    _prefill(blocks, a)
    blocks.free(a)
    b = _seq(range(1, 9))
    assert _prefill(blocks, b) == 4  # the second block holds the last token, which must run


def test_cached_blocks_are_evicted_least_recently_freed_first():
    blocks = BlockManager(4, 4, prefix_caching=True)
    old, new = _seq(range(1, 6)), _seq(range(50, 55))
    _prefill(blocks, old)
    blocks.free(old)   # its first block named, freed first
    _prefill(blocks, new)
    blocks.free(new)
    assert blocks.num_cached_blocks == 2
    big = _seq(range(200, 212))
    blocks.grow(big, 12)  # takes the 2 never-named blocks, then evicts one cached block: the older
    assert blocks.num_cached_blocks == 1
    blocks.free(big)
    assert _prefill(blocks, _seq(range(1, 6))) == 0
    assert _prefill(blocks, _seq(range(50, 55))) == 4


def test_same_tokens_after_a_different_prefix_are_not_shared():
    assert block_digest(b"", [1, 2]) != block_digest(block_digest(b"", [9, 9]), [1, 2])
    assert block_digest(b"", [1, 23]) != block_digest(b"", [12, 3])
    blocks = BlockManager(16, 2, prefix_caching=True)
    a = _seq([9, 9, 1, 2, 3])
    _prefill(blocks, a)
    blocks.free(a)
    assert _prefill(blocks, _seq([1, 2, 3])) == 0


def test_decode_written_blocks_are_never_named():
    blocks = BlockManager(16, 4, prefix_caching=True)
    a = _seq(range(1, 6))       # prompt of 5: one full block
    _prefill(blocks, a)
    a.prefill_target = 5
    for t in range(6):          # decode 6 tokens: positions 5..10 (the second block fills)
        a.append_token(7, 1)
        blocks.grow(a, a.num_tokens)
        a.num_computed_tokens = a.num_tokens
    blocks.free(a)
    assert blocks.num_cached_blocks == 1


def test_without_prefix_caching_nothing_is_named():
    blocks = BlockManager(8, 4)
    a = _seq(range(1, 10))
    assert _prefill(blocks, a) == 0
    blocks.free(a)
    assert blocks.num_cached_blocks == 0 and blocks.num_free_blocks == 8


# ---- the engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("prefix"), num_layers=4)


def _shared_prefix_prompts(vocab: int, n: int, prefix_len: int, seed: int):
    prefix = random_prompts(vocab, [prefix_len], seed=seed)[0]
    tails = random_prompts(vocab, [3 + (i * 5) % 11 for i in range(n)], seed=seed + 1)
    return [prefix + t for t in tails]


STRATEGIES = {
    "full": {},
    "early-exit": dict(early_exit=eecore.EarlyExitConfig(measure="static", exit_layer=2)),
    "lookup": dict(speculative=eecore.SelfSpeculativeConfig(num_speculations=3, lookup=eecore.LookupDrafts())),
    "layer": dict(speculative=eecore.SelfSpeculativeConfig(exit_layer=2, num_speculations=2)),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_outputs_with_the_cache_equal_outputs_without(tiny, strategy):
    path, hf = tiny
    vocab = hf.config.vocab_size
    kw = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
              **STRATEGIES[strategy])
    plain = eecore.LLM(path, num_blocks=256, **kw)
    # Few blocks: preemption and eviction both happen (2-14 preemptions, 49-67 evictions). Not
    # under early exit: a preempted sequence recomputes its generated tokens' K/V at full depth
    # where they had the exit's fill, so its output may change with or without the cache.
    cached = eecore.LLM(path, num_blocks=256 if strategy == "early-exit" else 24, enable_prefix_caching=True, **kw)
    blocks = cached.engine.blocks
    for round_ in range(3):
        prompts = _shared_prefix_prompts(vocab, 7, prefix_len=17 + round_, seed=round_ % 2)
        params = [greedy(6 + (i % 4) * 3) for i in range(len(prompts))]
        expected = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in cached.generate(prompts, params)] == expected, (strategy, round_)
        assert blocks.num_free_blocks == blocks.num_blocks
    assert blocks.prefix_hit_tokens > 0


def test_a_shared_prefix_is_computed_once(tiny):
    path, hf = tiny
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, num_blocks=64, enable_prefix_caching=True)
    prompts = _shared_prefix_prompts(hf.config.vocab_size, 4, prefix_len=16, seed=3)
    llm.generate(prompts[:1], greedy(2))
    before = list(llm.engine.runner.layer_tokens)
    llm.generate(prompts[1:], greedy(2))
    computed = llm.engine.runner.layer_tokens[0] - before[0]
    # each later prompt runs only what follows its 16 cached tokens (plus 1 decode step each)
    assert computed == sum(len(p) - 16 for p in prompts[1:]) + 3
    assert llm.engine.blocks.prefix_hit_tokens == 3 * 16
    assert llm.engine.blocks.prefix_query_tokens == sum(len(p) - 1 for p in prompts)  # one lookup each


def test_sampled_outputs_with_a_seed_are_the_same_with_the_cache(tiny):
    path, hf = tiny
    prompts = _shared_prefix_prompts(hf.config.vocab_size, 5, prefix_len=12, seed=5)
    params = [eecore.SamplingParams(max_tokens=8, temperature=0.8, seed=10 + i, ignore_eos=True) for i in range(5)]
    kw = dict(dtype="float32", device="cpu", block_size=4, num_blocks=128)
    expected = [o.token_ids for o in eecore.LLM(path, **kw).generate(prompts, params)]
    llm = eecore.LLM(path, enable_prefix_caching=True, **kw)
    llm.generate(prompts[:1], greedy(1))  # warm the cache
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_prefix_caching_flag_and_config(tiny, monkeypatch):
    from eecore import cli
    from eecore.cli import generate as generate_command

    path, _ = tiny
    with pytest.raises(ValueError, match="'enable_prefix_caching' must be a bool"):
        eecore.LLM(path, dtype="float32", device="cpu", enable_prefix_caching="yes")
    seen = []
    build = cli.build_llm
    monkeypatch.setattr(generate_command, "build_llm", lambda args, **kw: (seen.append(args), build(args, **kw))[1])
    assert cli.main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "3",
                     "--enable-prefix-caching"]) == 0
    assert seen[-1].enable_prefix_caching is True
    assert cli.main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "3"]) == 0
    assert seen[-1].enable_prefix_caching is False
    parser = cli.make_parser()  # eecore serve turns it on by default, and --no-enable-prefix-caching off
    assert parser.parse_args(["serve"]).enable_prefix_caching is True
    assert parser.parse_args(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parser.parse_args(["bench"]).enable_prefix_caching is False
