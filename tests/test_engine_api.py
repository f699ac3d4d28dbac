"""Sampling, stopping, streaming, logprobs and bad input through the public API (tiny models)."""
import math

import pytest
import torch

import eecore
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = make_tiny_hf_model(tmp_path_factory.mktemp("api"), arch="llama")
    llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=128, block_size=8)
    return llm, hf


def test_max_tokens_is_exact(tiny):
    llm, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [4, 9, 2])
    outs = llm.generate(prompts, [greedy(n) for n in (1, 7, 13)])
    assert [len(o.token_ids) for o in outs] == [1, 7, 13]


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    llm, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 8, 3, 12])
    params = eecore.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[1]], params)[0].token_ids
    together = llm.generate(prompts, [greedy(10), params, greedy(4), params])[1].token_ids
    assert alone == together
    other_seed = llm.generate([prompts[1]], eecore.SamplingParams(max_tokens=10, temperature=1.0, seed=99,
                                                                  ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(tiny):
    llm, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [6, 11])
    sampled = llm.generate(prompts, eecore.SamplingParams(max_tokens=8, temperature=0.7, top_k=1, ignore_eos=True))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in llm.generate(prompts, greedy(8))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype):
    """argmax_rows (numpy's argmax for fp32 on the CPU, torch's max elsewhere) picks what torch.argmax
    picks: the first maximal index, a NaN counting as maximal; rows of a matrix, a strided view, one row."""
    from eecore.engine.sampler import argmax_rows

    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, 10] = logits[1, 500] = 50.0  # a tie: the first
    logits[2, 7] = float("nan")
    logits[3, 3] = logits[3, 900] = float("nan")  # the first NaN
    for rows in (logits, logits[:, ::3], logits[4]):
        got = argmax_rows(rows)
        assert got.dtype == torch.int64 and got.shape == rows.shape[:-1]
        assert torch.equal(got, rows.argmax(dim=-1))


def test_top_p_keeps_the_smallest_nucleus():
    from eecore.engine.sampler import Sampler

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = Sampler.probabilities(logits, [eecore.SamplingParams(temperature=1.0, top_p=0.75)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = Sampler.probabilities(logits, [eecore.SamplingParams(temperature=1.0, top_k=3)])
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_stop_token_ids_end_the_output(tiny):
    llm, hf = tiny
    prompt = random_prompts(hf.config.vocab_size, [7])[0]
    free = llm.generate([prompt], greedy(12))[0].token_ids
    stop_at = free[4]
    out = llm.generate([prompt], greedy(12, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_logprobs_are_the_model_log_softmax(tiny):
    llm, hf = tiny
    prompt = random_prompts(hf.config.vocab_size, [6])[0]
    out = llm.generate([prompt], greedy(3, logprobs=5))[0]
    assert len(out.logprobs) == 3
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits, dim=-1)
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token in lp and len(lp) == 5  # greedy: the sampled token is the top-1
        for t, v in lp.items():
            assert math.isclose(v, float(expected[j, t]), abs_tol=1e-4)


def test_streaming_adds_up_to_generate(tiny):
    llm, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 10, 6])
    full = llm.generate(prompts, greedy(9))
    got = {i: [] for i in range(3)}
    finished = set()
    for delta in llm.generate_stream(prompts, greedy(9)):
        got[delta.index] += delta.token_ids
        if delta.finished:
            finished.add(delta.index)
    assert finished == {0, 1, 2}
    assert [got[i] for i in range(3)] == [o.token_ids for o in full]


def test_metrics_are_reported(tiny):
    llm, hf = tiny
    out = llm.generate(random_prompts(hf.config.vocab_size, [5]), greedy(6))[0]
    for key in ("ttft_s", "prefill_s", "time_per_output_token_s", "tokens_per_s", "mean_layers_per_token"):
        assert out.metrics[key] > 0, key
    assert out.metrics["early_exit_rate"] == 0.0


# ---- bad input ------------------------------------------------------------------------------

def test_empty_prompt_list(tiny):
    llm, _ = tiny
    with pytest.raises(ValueError, match="'prompts' is empty"):
        llm.generate([], greedy(4))


def test_prompt_longer_than_the_context(tiny):
    llm, hf = tiny
    too_long = [1] * llm.engine.max_model_len
    with pytest.raises(ValueError, match="prompt 1: .* do not fit the context"):
        llm.generate([[1, 2, 3], too_long], greedy(4))


@pytest.mark.parametrize("bad", [0, -3])
def test_max_tokens_must_be_positive(bad):
    with pytest.raises(ValueError, match="'max_tokens'"):
        eecore.SamplingParams(max_tokens=bad)


def test_token_ids_outside_the_vocabulary(tiny):
    llm, hf = tiny
    with pytest.raises(ValueError, match=r"prompt 0: token ids \[\d+\] are outside the vocabulary"):
        llm.generate([[1, hf.config.vocab_size]], greedy(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[-1]], greedy(2))


def test_empty_prompt(tiny):
    llm, _ = tiny
    with pytest.raises(ValueError, match="prompt 0: is empty"):
        llm.generate([[]], greedy(2))


def test_unknown_options(tiny):
    with pytest.raises(TypeError, match="bogus"):
        eecore.SamplingParams(bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        eecore.generate("hi", bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        eecore.LLM(None, bogus=True)


def test_bad_request_leaves_requests_in_flight_unharmed(tiny):
    llm, hf = tiny
    engine = llm.engine
    prompts = random_prompts(hf.config.vocab_size, [4, 8])
    expected = [o.token_ids for o in llm.generate(prompts, greedy(10))]
    seqs = [engine.add_request(p, greedy(10), i) for i, p in enumerate(prompts)]
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([hf.config.vocab_size + 5], greedy(3), 2)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1, 2], {"max_tokens": 3}, 3)
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
