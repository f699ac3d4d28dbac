"""The piecewise pass (eecore.engine.piecewise) on the CPU: the pieces a CUDA graph captures, run
eagerly over tokens padded to a bucket, with attention over the real tokens between them. It must
give the plain pass's tokens and logprobs for prefill chunks and mixed steps, count only the real
tokens' work, write K/V nowhere but the real tokens' slots and the pad block, and reuse its
buffers. tests/test_engine_cuda.py holds the captured graphs to eager mode on a GPU."""
from __future__ import annotations

import pytest
import torch

import eecore
from eecore.engine.inputs import InputBuilder, Row
from eecore.engine.piecewise import PiecewiseForward, maybe_piecewise, token_buckets
from eecore.engine.sequence import Sequence
from eecore.engine.static_decode import StaticDecode
from engine_utils import assert_same_outputs, emulate_graphs, generate_arriving, greedy, random_prompts
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("piecewise"), num_layers=3)


def _llm(path, piecewise: bool, static: bool = False, **kw):
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=kw.pop("num_blocks", 96), block_size=4,
                     max_num_seqs=kw.pop("max_num_seqs", 8), max_num_batched_tokens=kw.pop("max_num_batched_tokens", 48),
                     **kw)
    runner = llm.engine.runner
    if piecewise:
        runner.piecewise = PiecewiseForward(runner, runner.builder.max_tokens, capture=False)
    if static:
        runner.static_decode = StaticDecode(runner, llm.engine.config.max_num_seqs, capture=False)
    return llm


def test_token_buckets():
    assert token_buckets(8) == [8]
    assert token_buckets(48) == [8, 16, 24, 32, 48]
    assert token_buckets(100) == [8, 16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(1024) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]


@pytest.mark.parametrize("static", [False, True], ids=["eager-decodes", "static-decodes"])
def test_same_tokens_and_logprobs_as_the_plain_pass(tiny, static):
    """Prompts arriving while others decode (mixed steps), long ones chunked (48 tokens a step),
    through buckets 8..48."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 29, 7, 61, 1, 16, 40], seed=1)
    params = [greedy(5 + 3 * i, logprobs=3) for i in range(len(prompts))]
    plain = generate_arriving(_llm(path, piecewise=False), prompts, params)
    llm = _llm(path, piecewise=True, static=static)
    assert_same_outputs(generate_arriving(llm, prompts, params), plain)
    sizes = {key[0] for key in llm.engine.runner.piecewise.outputs}
    assert len(sizes) >= 3, f"the workload passed through too few buckets: {sorted(sizes)}"


def test_pieces_replayed_as_graphs_give_the_plain_pass(tiny):
    """Capture (a warm-up run, its change to the residual stream undone, then a recording) and replay,
    emulated: each piece adds its layer's output to the residual stream in place, so a warm-up left
    in place would add it twice."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 29, 7, 61, 1, 16], seed=12)
    params = [greedy(6 + 2 * i, logprobs=2) for i in range(len(prompts))]
    plain = generate_arriving(_llm(path, piecewise=False), prompts, params)
    llm = _llm(path, piecewise=True, static=True)
    emulate_graphs(llm.engine.runner.piecewise)
    emulate_graphs(llm.engine.runner.static_decode)
    assert_same_outputs(generate_arriving(llm, prompts, params), plain)
    assert len(llm.engine.runner.piecewise.graphs) >= 3 * 4, "too few buckets were captured"


def test_batch_generate_and_preemption(tiny):
    # 14 blocks of 4 tokens for 6 requests of ~20 tokens: sequences are preempted and recomputed,
    # their prompts and outputs again by the piecewise pass
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 14, 7, 11, 5], seed=3)
    plain = _llm(path, piecewise=False, num_blocks=14).generate(prompts, greedy(10, logprobs=2))
    llm = _llm(path, piecewise=True, num_blocks=14)
    assert_same_outputs(llm.generate(prompts, greedy(10, logprobs=2)), plain)
    assert sum(o.metrics["num_preemptions"] for o in plain) > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_counts_only_real_tokens(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 19, 2], seed=2)
    plain, piecewise = _llm(path, piecewise=False), _llm(path, piecewise=True)
    plain.generate(prompts, greedy(6))
    piecewise.generate(prompts, greedy(6))
    assert piecewise.engine.runner.layer_tokens == plain.engine.runner.layer_tokens


def test_padding_writes_kv_only_into_the_pad_block(tiny):
    path, hf = tiny
    llm = _llm(path, piecewise=True)
    runner, kv = llm.engine.runner, llm.engine.kv_cache
    a = Sequence(random_prompts(hf.config.vocab_size, [6], seed=4)[0], greedy(2))
    b = Sequence(random_prompts(hf.config.vocab_size, [3], seed=5)[0], greedy(2))
    a.block_table, b.block_table = [5, 9], [2]
    kv.tensor.zero_()
    inputs, hidden = runner.forward([Row(a, 0, a.prompt_token_ids), Row(b, 0, b.prompt_token_ids)])
    assert inputs.num_tokens == 16 and hidden.shape[0] == 9  # 9 tokens padded to the bucket of 16
    # [layers, 2, blocks, block_size, heads, dim]: the slots any layer's K or V was written to
    written = (kv.tensor != 0).flatten(4).any(-1).any(0).any(0)
    allowed = torch.zeros_like(written)
    for block, count in ((5, 4), (9, 2), (2, 3)):
        allowed[block, :count] = True
    allowed[kv.pad_block] = True
    assert written[kv.pad_block].any(), "the padding tokens wrote nothing"
    assert not (written & ~allowed).any(), "a padding token wrote K/V outside the pad block"


def test_buffers_are_reused_step_to_step(tiny):
    """What a graph replays reads and writes fixed addresses: each bucket's token inputs and
    residual stream are the same storage every time."""
    path, hf = tiny
    llm = _llm(path, piecewise=True)
    piecewise = llm.engine.runner.piecewise
    seen, run = {}, piecewise.run

    def spy(rows):
        inputs, hidden = run(rows)
        size = piecewise.padded_size(sum(len(r.tokens) for r in rows))
        ptrs = (inputs.token_ids.data_ptr(), inputs.attn.positions.data_ptr(), inputs.attn.slot_mapping.data_ptr(),
                hidden.data_ptr())
        assert seen.setdefault(size, ptrs) == ptrs
        return inputs, hidden

    piecewise.run = spy
    prompts = random_prompts(hf.config.vocab_size, [4, 13, 8, 30], seed=6)
    generate_arriving(llm, prompts, [greedy(6)] * 4, every=1)
    assert len(seen) >= 2


def test_not_taken(tiny):
    path, hf = tiny
    llm = _llm(path, piecewise=True, max_num_batched_tokens=16)
    piecewise = llm.engine.runner.piecewise
    seq = Sequence([1, 2, 3], greedy(2))
    assert not piecewise.takes([])
    assert not piecewise.takes([Row(seq, 0, [1] * 17)])  # more tokens than the largest bucket
    assert not piecewise.takes([Row(seq, 0, [1, 2, 3], parents=[-1, 0, 0])])  # token trees
    assert piecewise.takes([Row(seq, 0, [1] * 16)])


def test_token_padding_errors():
    builder = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=3, block_size=4, device=torch.device("cpu"),
                           pad_block=9)
    seq = Sequence([1, 2, 3], eecore.SamplingParams(max_tokens=4))
    seq.block_table = [0]
    with pytest.raises(ValueError, match="'pad_tokens_to' pads the 3 tokens of unpadded rows"):
        builder.build([Row(seq, 0, [1, 2, 3])], pad_tokens_to=2)
    with pytest.raises(ValueError, match=r"pad_to=2"):
        builder.build([Row(seq, 0, [1])], pad_to=2, pad_tokens_to=4)
    with pytest.raises(RuntimeError, match="exceeds the engine's 4 / 16"):
        builder.build([Row(seq, 0, [1, 2, 3])], pad_tokens_to=17)
    no_pad = InputBuilder(max_tokens=16, max_seqs=4, max_blocks_per_seq=3, block_size=4, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="padding needs the KV cache's pad block"):
        no_pad.build([Row(seq, 0, [1, 2, 3])], pad_tokens_to=8)


def test_no_piecewise_pass_on_the_cpu_or_eager(tiny, monkeypatch):
    path, _ = tiny
    monkeypatch.delenv("EECORE_PIECEWISE_GRAPHS", raising=False)  # the default: on where it can be
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=16)
    assert llm.engine.runner.piecewise is None
    assert maybe_piecewise(llm.engine.runner, enforce_eager=True) is None


@pytest.mark.parametrize("strategy", [
    dict(early_exit=eecore.EarlyExitConfig(measure="cosine", threshold=0.5)),
    dict(speculative=eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(1))),
    dict(speculative=eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
        2, copy=eecore.DraftCopy()), lookup=eecore.LookupDrafts())),
], ids=["early-exit", "layerskip", "copy-and-lookup"])
def test_other_strategies_prefill_through_it(tiny, strategy):
    """Every strategy's prefill steps go through the runner's forward, so through the pieces."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 29, 7, 61], seed=8)
    params = [greedy(8 + 2 * i, logprobs=2) for i in range(len(prompts))]
    plain = generate_arriving(_llm(path, piecewise=False, **strategy), prompts, params)
    llm = _llm(path, piecewise=True, **strategy)
    assert_same_outputs(generate_arriving(llm, prompts, params), plain)
    assert llm.engine.runner.piecewise.outputs, "no prefill went through the pieces"
