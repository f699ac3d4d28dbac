"""`eecore serve` at its HTTP edges (tiny random model, live server on 127.0.0.1, raw sockets where
a client library would not misbehave on purpose): the API key checked before the body, timeouts on
slow clients, half-closed connections, and the OpenAI-compatibility details (nulls, stop token ids,
content types, HEAD, trailing slashes, long model names, stop strings with logprobs)."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from model_factory import make_tiny_hf_model
from serve_utils import LiveServer, error_of, tiny_llm

VOCAB = 320


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("serve-edges"), num_layers=2)
    return path


def _raw(srv, data: bytes, *, shut_write: bool = False, timeout: float = 10.0) -> bytes:
    """Sends `data` on a fresh connection and returns everything the server sends until it closes
    the connection or `timeout` passes (half-closing the client's side first with `shut_write`)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        return _read_until_closed(s, timeout)


def _read_until_closed(s: socket.socket, timeout: float) -> bytes:
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out


def _read_response(s: socket.socket, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """One response (with a Content-Length) from a connection that stays open."""
    data, deadline = b"", time.monotonic() + timeout
    while b"\r\n\r\n" not in data:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = s.recv(65536)
        assert chunk, "the connection closed inside a response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body[:length]


def _status(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split()[1])


def _json_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


# ---- the API key: checked from the headers, before the body -------------------------------------

def test_the_api_key_is_checked_before_the_body_is_read(tiny_path):
    with LiveServer(tiny_llm(tiny_path, num_blocks=32), api_key="k3y") as srv:
        url = f"{srv.url}/v1/completions"
        # malformed JSON without the key: 401 (the body is never parsed), in OpenAI's shape
        r = httpx.post(url, content=b"{bad", headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert error_of(r)["code"] == "invalid_api_key"
        # a body that never arrives: the 401 comes from the headers alone, at once
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\":")
            start = time.monotonic()
            status, headers, body = _read_response(s, timeout=5)
            assert status == 401 and time.monotonic() - start < 2
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
        # 1.5 MB unauthenticated: 401, the body is discarded unparsed, the connection still serves
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            big = json.dumps({"prompt": "x" * 1_500_000}).encode()
            r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            assert r.status_code == 401
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"authorization": "Bearer k3y"})
            assert r.status_code == 200
        # two Authorization headers are refused, even when both hold the key
        for pair in (["Bearer k3y", "Bearer k3y"], ["Bearer k3y", "Bearer nope"], ["Bearer nope", "Bearer k3y"]):
            r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2},
                           headers=[("authorization", value) for value in pair])
            assert r.status_code == 401 and "2 Authorization headers" in error_of(r)["message"], pair
        # with the key, the body is read and checked as before
        r = httpx.post(url, content=b"{bad", headers={"content-type": "application/json",
                                                      "authorization": "Bearer k3y"})
        assert r.status_code == 400
        # unknown paths need the key too; /health and /metrics stay open
        assert httpx.get(f"{srv.url}/v1/nothing").status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/metrics").status_code == 200


# ---- OpenAI compatibility -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_path):
    with LiveServer(tiny_llm(tiny_path, max_num_seqs=8)) as srv:
        yield srv


@pytest.fixture(scope="module")
def oracle(tiny_path):
    return tiny_llm(tiny_path)


def _post(srv, route: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/{route}", json=body, timeout=60, **kw)


NULLABLE_COMPLETION = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                       "ignore_eos", "n", "stream", "stream_options", "user", "presence_penalty",
                       "frequency_penalty", "logit_bias", "logprobs", "echo", "suffix", "best_of"]
NULLABLE_CHAT = [f for f in NULLABLE_COMPLETION if f not in ("logprobs", "echo", "suffix", "best_of")] + \
    ["logprobs", "top_logprobs", "max_completion_tokens"]


def test_null_means_the_default(server):
    base = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    expected = _post(server, "completions", base).json()["choices"][0]["text"]
    nulls = {f: None for f in NULLABLE_COMPLETION if f not in base}
    r = _post(server, "completions", {**base, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["text"] == expected
    assert r.json()["choices"][0]["logprobs"] is None
    r = _post(server, "completions", {**base, "max_tokens": None, "temperature": None, "seed": 1, "ignore_eos": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16  # completions' default
    chat = {"messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": 3}
    r = _post(server, "chat/completions", {**chat, **{f: None for f in NULLABLE_CHAT if f not in chat}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = _post(server, "chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert '"usage"' not in r.text
    # a required field stays required
    for route, body, param in (("completions", {"prompt": None}, "prompt"),
                               ("chat/completions", {"messages": None}, "messages"),
                               ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages")):
        r = _post(server, route, body)
        assert r.status_code == 400 and error_of(r)["param"] == param, (body, r.text)


@pytest.mark.parametrize("ids", [[VOCAB], [-1], [2 ** 64], [3, 2 ** 70], [10 ** 300]])
def test_stop_token_ids_outside_the_vocabulary_get_400(server, ids):
    for route, body in (("completions", {"prompt": "hi"}), ("chat/completions",
                                                             {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(server, route, {**body, "max_tokens": 2, "stop_token_ids": ids})
        assert r.status_code == 400, r.text
        error = error_of(r)
        assert error["param"] == "stop_token_ids" and f"[0, {VOCAB})" in error["message"]
        assert len(error["message"]) < 200


def test_stop_token_ids_in_the_vocabulary_stop(server, oracle):
    from serve_utils import greedy_params

    prompt = [11, 12, 13, 14]
    out = oracle.generate([prompt], greedy_params(8))[0]
    stop = out.token_ids[3]
    r = _post(server, "completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                      "stop_token_ids": [0, stop, VOCAB - 1]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == out.token_ids.index(stop) + 1


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_a_json_body_of_another_content_type_gets_415_naming_it(server, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 2}),
                   headers=headers)
    if content_type is None and r.status_code == 200:
        return  # an older FastAPI (no strict_content_type) parses a body without a Content-Type as JSON
    assert r.status_code == 415, r.text
    message = error_of(r)["message"]
    assert "application/json" in message
    assert (content_type or "no Content-Type") in message


def test_head_health_and_metrics(server):
    for route in ("/health", "/metrics"):
        r = httpx.head(f"{server.url}{route}")
        assert r.status_code == 200 and r.content == b"", route


def test_a_trailing_slash_is_a_plain_404_not_a_redirect(server):
    for method, route in (("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"), ("GET", "/v1/models/"),
                          ("GET", "/health/")):
        r = httpx.request(method, f"{server.url}{route}", json={"prompt": "hi"} if method == "POST" else None,
                          headers={"host": "evil.example"})
        assert r.status_code == 404 and "location" not in r.headers, (route, r.status_code, r.headers)
        error_of(r)


def test_a_long_model_name_is_not_echoed_whole(server):
    name = "m" * 100_000
    r = _post(server, "completions", {"prompt": "hi", "model": name})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    assert len(r.content) < 1000 and "100002 characters" in error_of(r)["message"]
    r = _post(server, "completions", {"prompt": "hi", "model": "other"})
    assert r.status_code == 404 and "'other'" in error_of(r)["message"]


def test_stop_string_logprobs_and_usage_agree_with_the_tokens(server, oracle):
    """As vLLM: the text ends before the stop string; logprobs and completion_tokens cover every
    generated token up to and including the one that completed the stop string, the same streamed
    or whole."""
    from serve_utils import greedy_params

    tok = oracle.tokenizer
    prompt = [21, 22, 23, 24, 25]
    full = oracle.generate([prompt], greedy_params(24))[0]
    pieces = [tok.decode([t], skip_special_tokens=False) for t in full.token_ids]
    # a stop string that spans two tokens: the end of token k and the start of token k + 1
    k = next(i for i in range(3, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip()
             and pieces[i].isascii() and pieces[i + 1].isascii())
    stop = pieces[k][-1] + pieces[k + 1][0]
    expected = oracle.generate([prompt], greedy_params(24, stop=[stop], logprobs=0))[0]
    assert expected.finish_reason == "stop" and stop not in expected.text
    n = len(expected.token_ids)
    assert stop in tok.decode(expected.token_ids) and stop not in tok.decode(expected.token_ids[:-1])
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stop, "logprobs": 0}
    whole = _post(server, "completions", body).json()
    choice = whole["choices"][0]
    assert choice["text"] == expected.text and choice["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == n == len(choice["logprobs"]["tokens"])
    assert choice["logprobs"]["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    assert "".join(choice["logprobs"]["tokens"]).startswith(expected.text)
    r = _post(server, "completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    tokens = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["tokens"]]
    assert text == expected.text and tokens == choice["logprobs"]["tokens"]
    assert events[-1]["usage"]["completion_tokens"] == n
    # chat: the same count of logprobs entries and completion tokens
    r = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 24,
                                           "temperature": 0, "ignore_eos": True, "stop": stop, "logprobs": True})
    c = r.json()
    assert len(c["choices"][0]["logprobs"]["content"]) == c["usage"]["completion_tokens"]


# ---- slow, idle and half-closed clients ----------------------------------------------------------

REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s")


def _request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return REQUEST % (len(data), data)


@pytest.fixture(scope="module")
def strict_server(tiny_path):
    """A server with short timeouts: 1 s for headers, bodies and idle keep-alive connections."""
    with LiveServer(tiny_llm(tiny_path, num_blocks=64), body_timeout=1.0,
                    server_kw=dict(header_timeout=1.0, keep_alive_timeout=1.0)) as srv:
        yield srv


def test_a_body_that_does_not_arrive_gets_408_and_the_connection_closed(strict_server):
    # Content-Length 1000, 10 bytes sent: a 408 in OpenAI's shape once the body timeout passes
    start = time.monotonic()
    out = _raw(strict_server, REQUEST % (1000, b'{"prompt":'), timeout=10)
    elapsed = time.monotonic() - start
    assert _status(out) == 408 and 0.9 < elapsed < 5, (out[:200], elapsed)
    assert b"connection: close" in out.lower() and "1 s" in _json_of(out)["error"]["message"]
    # a chunked body that stalls: the same
    out = _raw(strict_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n", timeout=10)
    assert _status(out) == 408
    # the server is unharmed
    assert httpx.post(f"{strict_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_headers_that_do_not_arrive_close_the_connection(strict_server):
    # part of a request line: 408, closed
    start = time.monotonic()
    out = _raw(strict_server, b"POST /v1/compl", timeout=10)
    assert _status(out) == 408 and time.monotonic() - start < 5
    # a connection that sends nothing: closed without a word
    start = time.monotonic()
    assert _raw(strict_server, b"", timeout=10) == b"" and time.monotonic() - start < 5
    # headers dripped a byte at a time do not extend the deadline
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=10) as s:
        start = time.monotonic()
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - start > 4:
                break
        out = _read_until_closed(s, 5)
        assert closed or _status(out) == 408
        assert time.monotonic() - start < 5


def test_an_idle_keep_alive_connection_is_closed(strict_server):
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = _read_response(s)
        assert status == 200
        start = time.monotonic()
        assert _read_until_closed(s, 5) == b""
        assert 0.5 < time.monotonic() - start < 4
        # a request whose answer came early (no body read) and whose body never ends: closed too
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        status, _, _ = _read_response(s)
        assert status == 200
        start = time.monotonic()
        _read_until_closed(s, 5)
        assert time.monotonic() - start < 4


def test_a_half_closed_client_gets_its_answer(server, oracle):
    from serve_utils import greedy_params

    prompt = [31, 32, 33]
    expected = oracle.generate([prompt], greedy_params(6))[0].text
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = _raw(server, _request(body), shut_write=True)
    assert _status(out) == 200 and _json_of(out)["choices"][0]["text"] == expected
    # streamed: every event, to [DONE]
    out = _raw(server, _request({**body, "stream": True}), shut_write=True)
    assert _status(out) == 200 and b"data: [DONE]" in out
    # a half-closed client that had not finished its request is not answered (nothing to answer)
    out = _raw(server, REQUEST % (100, b'{"prompt": "hi"'), shut_write=True)
    assert out == b"" or _status(out) >= 400


def test_connections_beyond_the_cap_get_503(tiny_path):
    with LiveServer(tiny_llm(tiny_path, num_blocks=32), server_kw=dict(max_connections=4)) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        try:
            time.sleep(0.2)
            assert httpx.get(f"{srv.url}/health").status_code == 503
        finally:
            for s in idle:
                s.close()
        time.sleep(0.2)
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_accept_errors_are_logged_at_most_once_a_second(caplog):
    import asyncio
    import errno
    import logging

    from eecore.serve.server import ACCEPT_ERROR, quiet_accept_errors

    seen = []

    async def flood():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: seen.append(context["message"]))
        restore = quiet_accept_errors(loop, interval=0.5)
        error = OSError(errno.EMFILE, "Too many open files")
        start = time.monotonic()
        while time.monotonic() - start < 1.2:
            for _ in range(1000):
                loop.call_exception_handler({"message": ACCEPT_ERROR, "exception": error})
            await asyncio.sleep(0)
        loop.call_exception_handler({"message": "something else"})
        restore()
        loop.call_exception_handler({"message": ACCEPT_ERROR, "exception": error})

    with caplog.at_level(logging.ERROR, logger="eecore.serve"):
        asyncio.run(flood())
    lines = [r.getMessage() for r in caplog.records if "cannot accept connections" in r.getMessage()]
    assert 2 <= len(lines) <= 4, lines
    assert "Too many open files" in lines[0] and "time(s) in the last" in lines[-1]
    assert int(lines[-1].split("(")[1].split()[0]) > 100  # the count of the errors it stood for
    # other errors go to the handler that was there, and restore() puts it back
    assert seen == ["something else", ACCEPT_ERROR]


def test_the_shutdown_guard_ends_a_cancelled_request_quietly():
    import asyncio

    from eecore.serve.http_errors import ShutdownGuard

    async def stuck(scope, receive, send):
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.sleep(3600)

    async def run(path: str, shutting_down: bool):
        sent = []

        async def send(message):
            sent.append(message)

        guard = ShutdownGuard(stuck, shutting_down=lambda: shutting_down)
        task = asyncio.ensure_future(guard({"type": "http", "method": "POST", "path": path}, None, send))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return sent, "cancelled"
        return sent, "returned"

    sent, how = asyncio.run(run("/whole", True))
    assert how == "returned" and sent[0]["status"] == 503 and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["type"] == "service_unavailable"
    sent, how = asyncio.run(run("/stream", True))
    assert how == "returned" and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    sent, how = asyncio.run(run("/whole", False))  # not shutting down: the cancellation goes on
    assert how == "cancelled" and sent == []


def test_the_watchdog_ends_the_process_at_the_shutdown_timeout(monkeypatch):
    """Whatever still runs (a stuck step, a thread), the process ends --shutdown-timeout seconds
    after the signal."""
    import signal

    from sse_starlette.sse import AppStatus

    from eecore.serve import server as S

    class Engine:
        shut = False

        def begin_shutdown(self):
            self.shut = True

    exits = []
    monkeypatch.setattr(S.os, "_exit", exits.append)
    monkeypatch.setattr(AppStatus, "should_exit", False)  # sse-starlette's flag, which handle_exit sets
    engine = Engine()
    srv = S.EngineServer(S.server_config(lambda *a: None, shutdown_timeout=0.3), engine, shutdown_timeout=0.3)
    assert srv.config.timeout_graceful_shutdown == pytest.approx(0.15)
    srv.handle_exit(signal.SIGTERM, None)
    srv.handle_exit(signal.SIGTERM, None)  # a second signal arms no second watchdog
    assert engine.shut and srv.should_exit and not exits
    time.sleep(0.6)
    assert exits == [1]
