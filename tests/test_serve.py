"""`eecore serve` through the official openai client and plain HTTP (tiny random model, live server
on 127.0.0.1): completions and chat, streamed and not, equal to LLM.generate; logprobs, n, usage,
models, health, metrics; every bad request gets its OpenAI-shaped 4xx; the API key; overload."""
import asyncio
import math
import threading

import httpx
import openai
import pytest

from engine_utils import random_prompts
from model_factory import make_tiny_hf_model
from serve_utils import MODEL, LiveServer, error_of, greedy_params, tiny_llm

VOCAB = 320


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("serve"), num_layers=3)
    return path


@pytest.fixture(scope="module")
def oracle(tiny_path):
    return tiny_llm(tiny_path)


@pytest.fixture(scope="module")
def server(tiny_path):
    with LiveServer(tiny_llm(tiny_path, max_num_seqs=8)) as srv:
        yield srv


# ---- completions and chat: equal to the offline engine -------------------------------------------

def test_completions_equal_generate_streamed_and_not(server, oracle):
    client = server.client()
    prompts = ["Hello world! Hello there", "def add(a, b):", "The quick brown fox"]
    expected = oracle.generate(prompts, greedy_params(12))
    for prompt, exp in zip(prompts, expected):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert whole.choices[0].text == exp.text
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.prompt_tokens == len(exp.prompt_token_ids) and whole.usage.completion_tokens == 12
        assert whole.usage.total_tokens == len(exp.prompt_token_ids) + 12
        assert whole.usage.model_extra["mean_layers_per_token"] == 3.0
        assert whole.usage.model_extra["early_exit_rate"] == 0.0
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == exp.text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_of_token_ids_and_prompt_lists(server, oracle):
    client = server.client()
    prompts = random_prompts(VOCAB, [5, 9, 2], seed=1)
    expected = [o.text for o in oracle.generate(prompts, greedy_params(7))]
    one = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == expected[0]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == expected
    assert many.usage.prompt_tokens == 5 + 9 + 2 and many.usage.completion_tokens == 21
    texts = ["The quick", "Hello"]
    many = client.completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in many.choices] == [o.text for o in oracle.generate(texts, greedy_params(5))]


def test_chat_equals_llm_chat_streamed_and_not(server, oracle):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    expected = oracle.chat(messages, greedy_params(10))[0]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    # content as a list of text parts reads as the joined text
    parts = client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0, extra_body={"ignore_eos": True},
        messages=[messages[0], {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}])
    assert parts.choices[0].message.content == expected.text


def test_sse_ends_with_done(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_stop_strings_and_seeded_sampling(server, oracle):
    client = server.client()
    prompt = random_prompts(VOCAB, [6], seed=4)[0]
    free = oracle.generate([prompt], greedy_params(16))[0].text
    stop = free[3:5] if len(free.strip()) > 5 else None
    if stop:
        exp = oracle.generate([prompt], greedy_params(16, stop=[stop]))[0]
        for stream in (False, True):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                          stream=stream, extra_body={"ignore_eos": True})
            text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
            assert text == exp.text and stop not in text
    sampled = oracle.generate([prompt], greedy_params(8, temperature=0.9, top_p=0.9, top_k=30, seed=7))[0].text
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
                                  extra_body={"ignore_eos": True, "top_k": 30})
    assert r.choices[0].text == sampled


def test_n_choices_use_seed_plus_index(server, oracle):
    client = server.client()
    prompt = random_prompts(VOCAB, [5], seed=8)[0]
    exp = [oracle.generate([prompt], greedy_params(6, temperature=1.0, seed=100 + j))[0].text for j in range(3)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=100, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == exp
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, n=2, stream=True, temperature=0))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 2


def test_logprobs_equal_the_engine(server, oracle):
    client = server.client()
    prompt = random_prompts(VOCAB, [7], seed=2)[0]
    exp = oracle.generate([prompt], greedy_params(5, logprobs=3))[0]
    tok = oracle.tokenizer
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in exp.token_ids]
    for j, t in enumerate(exp.token_ids):
        assert math.isclose(lp.token_logprobs[j], exp.logprobs[j][t], abs_tol=1e-6)
        assert len(lp.top_logprobs[j]) <= 4
    assert lp.text_offset[0] == 0
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                              logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed if c.choices[0].logprobs), []) \
        == pytest.approx(lp.token_logprobs, abs=1e-6)
    chat_exp = oracle.chat([{"role": "user", "content": "Hi"}], greedy_params(4, logprobs=2))[0]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry, t, d in zip(content, chat_exp.token_ids, chat_exp.logprobs):
        assert math.isclose(entry.logprob, d[t], abs_tol=1e-6)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


# ---- other routes ----------------------------------------------------------------------------

def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = server.wait_idle()
    for name in ("eecore_num_requests_running", "eecore_num_requests_waiting", "eecore_generation_tokens_total",
                 "eecore_kv_blocks_used", "eecore_kv_blocks_free", "eecore_early_exit_rate",
                 "eecore_mean_layers_per_token", "eecore_spec_acceptance_rate", "eecore_step_num_requests_max",
                 "eecore_prefix_cache_hit_tokens", "eecore_kv_blocks_cached"):
        assert name in m, name
    assert m["eecore_kv_blocks_used"] == 0 and m["eecore_kv_blocks_free"] == 512
    assert m["eecore_mean_layers_per_token"] == 3.0


# ---- bad input -------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 1000}, 400, "n"),
    ({"prompt": "hi", "seed": "x"}, 400, "seed"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "echo": True}, 400, "echo"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ({"prompt": "hi", "tools": []}, 400, "tools"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [1, VOCAB]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [1] * 600}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
]

BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("body, status, param", BAD_COMPLETIONS)
def test_bad_completion_requests(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, status, param", BAD_CHATS)
def test_bad_chat_requests(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert error_of(r)["param"] == param


def test_malformed_bodies_and_routes(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = httpx.post(f"{server.url}/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    error_of(r)
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405
    # the server still serves after all of that
    assert server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_openai_client_raises_bad_request(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


# ---- the API key -----------------------------------------------------------------------------

def test_api_key(tiny_path):
    with LiveServer(tiny_llm(tiny_path, num_blocks=64), api_key="s3cret") as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, route in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                                  ("POST", "/v1/chat/completions")):
                r = httpx.request(method, f"{srv.url}{route}", headers=headers, json={"prompt": "hi"})
                assert r.status_code == 401, (route, headers)
                assert error_of(r)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        good = srv.client(api_key="s3cret")
        assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(f"{srv.url}/health").status_code == 200   # health and metrics stay open
        assert httpx.get(f"{srv.url}/metrics").status_code == 200


def test_several_api_keys_each_name_a_client(tiny_path):
    with LiveServer(tiny_llm(tiny_path, num_blocks=64), api_key=["alpha", "beta"]) as srv:
        clients = []
        add = srv.engine.add
        srv.engine.add = lambda subs, client=None: clients.append(client) or add(subs, client=client)
        for key in ("beta", "alpha"):
            srv.client(api_key=key).completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert clients == [1, 0]
        for key in ("gamma", "alph", "alphabeta"):
            with pytest.raises(openai.AuthenticationError):
                srv.client(api_key=key).models.list()


# ---- overload --------------------------------------------------------------------------------

def test_full_waiting_queue_gets_503_and_the_rest_complete(tiny_path, oracle):
    llm = tiny_llm(tiny_path, num_blocks=64)
    gate = threading.Event()
    step = llm.engine.step

    def gated_step():  # hold the engine so that requests pile up in the waiting queue
        gate.wait(30)
        return step()

    llm.engine.step = gated_step
    prompts = random_prompts(VOCAB, [4, 6], seed=11)
    expected = [o.text for o in oracle.generate(prompts, greedy_params(5))]

    async def scenario(srv):
        client = srv.async_client()
        first = [asyncio.ensure_future(client.completions.create(
            model=MODEL, prompt=p, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})) for p in prompts]
        while srv.engine.num_waiting < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model=MODEL, prompt="Hi", max_tokens=5)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "server_overloaded"
        gate.set()
        return [r.choices[0].text for r in await asyncio.gather(*first)]

    with LiveServer(llm, max_waiting=2) as srv:
        assert asyncio.run(scenario(srv)) == expected
        assert srv.metrics()["eecore_requests_rejected_overload_total"] == 1


def test_prefix_caching_behind_the_server(tiny_path, oracle):
    # chat requests share the template's first tokens: later ones take them from the cache, and
    # every output still equals the offline engine's
    prompts = [f"question {i}: " + "tell me about the weather " * (2 + i % 3) for i in range(6)]
    with LiveServer(tiny_llm(tiny_path, block_size=4, enable_prefix_caching=True)) as srv:
        client = srv.client()
        for prompt in prompts + prompts[:2]:
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
            expected = oracle.generate([prompt], greedy_params(5))[0]
            assert out.choices[0].text == expected.text
        m = srv.wait_idle()
    assert m["eecore_prefix_cache_hit_tokens"] > 0
    assert m["eecore_prefix_cache_query_tokens"] >= m["eecore_prefix_cache_hit_tokens"]
    assert m["eecore_kv_blocks_cached"] > 0 and m["eecore_kv_blocks_used"] == 0
