"""End to end on the embedded default model, SmolLM2-135M-Instruct (GGUF), against HF transformers."""
import pytest
import torch

import eecore
from engine_utils import greedy, hf_greedy
from model_factory import hf_model_from_gguf

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Early-exit language models save compute by",
]


@pytest.fixture(scope="module")
def llm():
    return eecore.LLM(dtype="float32", device="cpu", max_num_seqs=8)


@pytest.fixture(scope="module")
def hf():
    from eecore.models.loader import default_model_path

    return hf_model_from_gguf(default_model_path())


def test_greedy_tokens_match_hf_transformers(llm, hf):
    assert llm.weight_format == "Q4_1"  # the file's own blocks, computed by linear_gguf
    outs = llm.generate(PROMPTS, greedy(32))
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(hf, ids, 32)
        assert out.text == llm.tokenizer.decode(out.token_ids)


def test_self_speculation_matches_full_depth(llm):
    full = [o.token_ids for o in llm.generate(PROMPTS, greedy(64))]
    spec = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=8,
                      speculative=eecore.SelfSpeculativeConfig(exit_layer=12, num_speculations=4))
    outs = spec.generate(PROMPTS, greedy(64))
    assert [o.token_ids for o in outs] == full
    assert all(0 <= o.metrics["acceptance_rate"] <= 1 for o in outs)


def test_chat_and_stop_strings(llm):
    messages = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    out = llm.chat(messages, eecore.SamplingParams(max_tokens=40))[0]
    assert out.prompt.startswith("<|im_start|>") and len(out.text) > 12
    stop = out.text[8:11]
    cut = llm.chat(messages, eecore.SamplingParams(max_tokens=40, stop=[stop]))[0]
    assert cut.text == out.text[: out.text.find(stop)]
    assert cut.finish_reason == "stop"


def test_eos_ends_a_chat_answer(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], eecore.SamplingParams(max_tokens=200))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.config.eos_token_ids


def test_cli_generate_streams_a_completion(capsys):
    from eecore.cli import main

    assert main(["generate", "The capital of France is", "--chat", "off", "--max-tokens", "8",
                 "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tok/s" in captured.err


def test_cli_generate_with_early_exit_flags(capsys):
    from eecore.cli import main

    assert main(["generate", "Hello", "--max-tokens", "6", "--early-exit", "cosine", "--threshold", "0.95",
                 "--min-exit-layer", "10", "--batch-rule", "compact"]) == 0
    assert "mean layers/token" in capsys.readouterr().err
