"""`eecore serve` on the embedded SmolLM2-135M-Instruct through the openai client: greedy outputs equal
LLM.generate / LLM.chat, streamed pieces concatenate to the whole text, and early exit and
self-speculation behind the server stream the offline text."""
import asyncio

import pytest

import eecore
from serve_utils import LiveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Early-exit language models save compute by"]
CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]]
MAX_TOKENS = 24


def _llm(**kw):
    return eecore.LLM(dtype="float32", device="cpu", max_num_seqs=8, **kw)


def _greedy():
    return eecore.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


async def _all(srv, stream: bool):
    client = srv.async_client()

    async def completion(prompt):
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=stream)
        if not stream:
            return r.choices[0].text, r.choices[0].finish_reason
        chunks = [c async for c in r]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def chat(messages):
        r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=stream)
        if not stream:
            return r.choices[0].message.content, r.choices[0].finish_reason
        chunks = [c async for c in r]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    return await asyncio.gather(*(completion(p) for p in PROMPTS), *(chat(m) for m in CHATS))


STRATEGIES = {
    "full": {},
    "early_exit": {"early_exit": eecore.EarlyExitConfig(measure="static", exit_layer=24)},
    "speculate": {"speculative": eecore.SelfSpeculativeConfig(exit_layer=12, num_speculations=3)},
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_server_equals_offline_streamed_and_not(strategy):
    offline_llm = _llm(**STRATEGIES[strategy])
    expected = [(o.text, o.finish_reason) for o in offline_llm.generate(PROMPTS, _greedy())]
    expected += [(o.text, o.finish_reason) for o in offline_llm.chat(CHATS, _greedy())]
    with LiveServer(_llm(**STRATEGIES[strategy]), model_name=MODEL) as srv:
        whole = asyncio.run(_all(srv, stream=False))
        streamed = asyncio.run(_all(srv, stream=True))
        m = srv.wait_idle()
    assert whole == expected
    assert streamed == expected
    assert m["eecore_kv_blocks_used"] == 0
    if strategy == "early_exit":
        assert m["eecore_mean_layers_per_token"] < 30
