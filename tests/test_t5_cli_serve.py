"""T5 directories through the CLI and the OpenAI-compatible server: the same text as LLM.generate."""
import pytest

import eecore
from engine_utils import greedy
from serve_utils import MODEL, LiveServer
from t5_factory import make_tiny_t5

PROMPT = "summarize: the quick brown fox"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_t5(tmp_path_factory.mktemp("t5cli"), "v1.1", num_decoder_layers=4)
    return path


def test_cli_generate_prints_the_decoder_text(tiny, capsys):
    from eecore.cli import main

    expected = eecore.LLM(tiny, dtype="float32", device="cpu").generate(PROMPT, greedy(8))[0].text
    for extra in ([], ["--early-exit", "static", "--exit-layer", "2"]):
        assert main(["generate", PROMPT, "--model", tiny, "--dtype", "float32", "--max-tokens", "8",
                     "--ignore-eos", *extra]) == 0
        out = capsys.readouterr().out
        if not extra:
            assert out.startswith(expected)


def test_server_completions_equal_generate(tiny):
    llm = eecore.LLM(tiny, dtype="float32", device="cpu", max_num_seqs=4)
    expected = llm.generate(PROMPT, greedy(8))[0]
    with LiveServer(llm) as server:
        reply = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids) and reply.usage.completion_tokens == 8
