"""The Llama-family models on the paged engine against HF transformers: logits and greedy tokens."""
import pytest
import torch

import eecore
from eecore.engine.inputs import Row
from engine_utils import greedy, hf_greedy, random_prompts
from model_factory import make_tiny_hf_model

ARCHS = ["llama", "mistral", "qwen2"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path, hf = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    return path, hf


def test_prefill_logits_match_hf(tiny):
    path, hf = tiny
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=64, block_size=16)
    prompt = random_prompts(hf.config.vocab_size, [37])[0]
    seq = llm.engine.add_request(prompt, greedy(1))
    llm.engine.blocks.grow(seq, len(prompt))
    _, hidden = llm.engine.runner.forward([Row(seq, 0, prompt)])
    runner = llm.engine.runner
    ours = torch.cat([runner.logits(hidden[i:i + 16]).clone() for i in range(0, len(prompt), 16)])
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)


def test_greedy_tokens_match_hf_for_a_batch_of_prompts(tiny):
    path, hf = tiny
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=128, block_size=8)
    prompts = random_prompts(hf.config.vocab_size, [5, 17, 1, 33], seed=1)
    outs = llm.generate(prompts, greedy(12))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 12)
        assert out.exit_layers == [hf.config.num_hidden_layers] * 12
        assert out.finish_reason == "length"


def test_chunked_prefill_matches_hf(tiny):
    path, hf = tiny
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompt = random_prompts(hf.config.vocab_size, [50], seed=2)[0]
    out = llm.generate([prompt], greedy(6))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 6)


def test_batch_invariance(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path, arch="llama")
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=256, block_size=16)
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14, 7, 30, 2, 11], seed=3)
    alone = llm.generate([prompts[2]], greedy(16))[0].token_ids
    batched = llm.generate(prompts, greedy(16))[2].token_ids
    assert alone == batched


def test_preemption_gives_the_same_outputs_and_returns_every_block(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path, arch="llama")
    prompts = random_prompts(hf.config.vocab_size, [6, 10, 3, 8], seed=4)
    roomy = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=128, block_size=4)
    expected = [o.token_ids for o in roomy.generate(prompts, greedy(20))]
    tight = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=12, block_size=4)
    outs = tight.generate(prompts, greedy(20))
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the cache was meant to be too small"
    assert tight.engine.blocks.num_free_blocks == 12


def test_blocks_return_after_many_requests(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path, arch="qwen2")
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=40, block_size=8, max_num_seqs=4)
    prompts = random_prompts(hf.config.vocab_size, [3 + (i * 7) % 20 for i in range(16)], seed=5)
    outs = llm.generate(prompts, [greedy(1 + i % 9) for i in range(16)])
    assert [len(o.token_ids) for o in outs] == [1 + i % 9 for i in range(16)]
    assert llm.engine.blocks.num_free_blocks == 40


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_stay_close_to_hf(tmp_path, dtype):
    path, hf = make_tiny_hf_model(tmp_path, arch="qwen2")
    llm = eecore.LLM(path, dtype=dtype, device="cpu", num_blocks=32, block_size=16)
    assert llm.model.embed.dtype == dtype and llm.engine.kv_cache.tensor.dtype == dtype
    prompt = random_prompts(hf.config.vocab_size, [11], seed=6)[0]
    seq = llm.engine.add_request(prompt, greedy(1))
    llm.engine.blocks.grow(seq, len(prompt))
    _, hidden = llm.engine.runner.forward([Row(seq, 0, prompt)])
    ours = llm.engine.runner.logits(hidden[-1:])[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0, -1]  # fp32
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() < 0.05 * scale
    outs = llm.generate([prompt], greedy(8))
    assert len(outs[0].token_ids) == 8
