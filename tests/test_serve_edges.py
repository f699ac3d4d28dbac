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
