"""The server on a small running batch and token budget (as `eecore serve`'s defaults are): requests
that arrive while others stream have their prompts chunked into the running streams' steps (mixed
steps), every stream still equals what the offline engine gives its prompt alone, and no step goes
over the budget (tiny random model, live server on 127.0.0.1)."""
import asyncio
import random

from engine_utils import random_prompts
from model_factory import make_tiny_hf_model
from serve_utils import MODEL, LiveServer, greedy_params, tiny_llm

VOCAB = 320
BUDGET = 16


async def _stream(client, prompt, max_tokens: int, delay: float) -> str:
    await asyncio.sleep(delay)
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
    return text


def test_streams_arriving_under_load_ride_mixed_steps_and_equal_offline(tmp_path):
    path, _ = make_tiny_hf_model(tmp_path, num_layers=3)
    rng = random.Random(4)
    prompts = random_prompts(VOCAB, [rng.randint(3, 45) for _ in range(24)], seed=4)
    lengths = [rng.randint(6, 30) for _ in prompts]
    alone = tiny_llm(path, max_num_seqs=1)
    expected = [alone.generate([p], greedy_params(n))[0].text for p, n in zip(prompts, lengths)]

    async def run(srv):
        client = srv.async_client()
        # arrivals 2 ms apart: many land while the first four stream (4 slots), whatever the
        # machine's speed, so admissions ride decode steps (20 ms apart let fast machines finish
        # each stream before the next arrived: no mixed step at all)
        return await asyncio.gather(*(_stream(client, p, n, 0.002 * i)
                                      for i, (p, n) in enumerate(zip(prompts, lengths))))

    with LiveServer(tiny_llm(path, max_num_seqs=4, max_num_batched_tokens=BUDGET)) as srv:
        texts = asyncio.run(run(srv))
        m = srv.wait_idle()
    assert texts == expected
    assert m["eecore_engine_mixed_steps_total"] > 0
    steps = m["eecore_step_num_tokens_count"]
    assert steps > 0 and m[f'eecore_step_num_tokens_bucket{{le="{float(BUDGET)}"}}'] == steps
    assert m["eecore_step_num_requests_max"] <= 4
    assert m["eecore_kv_blocks_used"] == 0
