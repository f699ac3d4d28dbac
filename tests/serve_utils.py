"""Helpers for server tests: a live uvicorn server in a thread on 127.0.0.1 and a free port, an
OpenAI client for it, and the offline results it must reproduce."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import uvicorn

import eecore
from eecore.serve import AsyncEngine, build_app
from eecore.serve.metrics import parse_metrics
from eecore.serve.server import server_config

MODEL = "tiny"


class LiveServer:
    """`with LiveServer(llm) as srv:` serves `llm` at `srv.url` until the block ends."""

    def __init__(self, llm, *, max_waiting: int = 256, api_key: str | None = None, model_name: str = MODEL,
                 server_kw: dict | None = None, **app_kw):
        """`server_kw` goes to eecore.serve.server.server_config (timeouts, connection cap), the rest
        to build_app."""
        self.llm = llm
        self.server_kw = server_kw or {}
        self.engine = AsyncEngine(llm, max_waiting=max_waiting)
        self.app = build_app(self.engine, model_name, api_key=api_key, **app_kw)
        self.model_name = model_name

    def __enter__(self) -> "LiveServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = server_config(self.app, log_level="warning", **self.server_kw)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "the test server did not stop"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                                  timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics").text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """The metrics once no sequence runs or waits (client disconnects are noticed asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["eecore_num_requests_running"] == 0 and m["eecore_num_requests_waiting"] == 0) \
                    or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def tiny_llm(path: str, **kw) -> eecore.LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 8, "num_blocks": 512, **kw}
    return eecore.LLM(path, **kw)


def greedy_params(max_tokens: int, **kw) -> eecore.SamplingParams:
    return eecore.SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw})


def error_of(response: httpx.Response) -> dict:
    """The OpenAI-shaped error of a response, checked for its shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert re.search(r"\S", body["error"]["message"])
    return body["error"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(path: str, *extra: str):
    """`eecore serve` on a free port as a child process, once /health answers: (process, url)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "eecore.cli", "serve", "--model", path, "--port", str(port),
                             "--num-blocks", "256", "--block-size", "8", "--max-num-seqs", "8",
                             "--log-level", "warning", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start:\n{proc.communicate()[0]}")
        time.sleep(0.2)
