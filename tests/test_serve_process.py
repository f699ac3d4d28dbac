"""`eecore serve` as a process: it serves, and SIGTERM / SIGINT under load stops it cleanly (open
streams end with [DONE], exit status 0, within a few seconds)."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("serve-proc"), num_layers=2)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(path: str, *extra: str):
    port = _free_port()
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


def _long_stream(url: str, results: list, i: int) -> None:
    body = {"prompt": [5 + i, 7, 9], "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
    except httpx.HTTPError as exc:
        events.append(f"error: {exc!r}")
    results[i] = events


def _wait_for_requests(url: str, n: int, timeout: float = 30.0) -> None:
    """Until the server has taken `n` requests (running, waiting for a place in the batch, or
    finished), so that none of them arrives after the signal (a loaded machine may be slow to send)."""
    from eecore.serve.metrics import parse_metrics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text)
        finished = sum(v for k, v in m.items() if k.startswith("eecore_requests_finished_total"))
        if m["eecore_num_requests_running"] + m["eecore_num_requests_waiting"] + finished >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server never took {n} requests")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_under_load_ends_streams_and_exits_0(tiny_path, sig):
    proc, url = _start(tiny_path)
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        results: list = [None] * 12
        threads = [threading.Thread(target=_long_stream, args=(url, results, i)) for i in range(12)]
        for t in threads:
            t.start()
        _wait_for_requests(url, 1 + 12)  # the "Hello" request and every stream
        start = time.monotonic()
        proc.send_signal(sig)
        status = proc.wait(timeout=15)
        elapsed = time.monotonic() - start
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.communicate()[0]
    assert status == 0, output
    print(f"exited {elapsed:.2f} s after the signal")
    assert elapsed < 5, elapsed
    for events in results:
        assert events and events[-1] == "data: [DONE]", events[-3:]
        assert '"finish_reason": "abort"' in events[-2] or '"finish_reason": "length"' in events[-2]
    assert any('"finish_reason": "abort"' in events[-2] for events in results)


def test_api_key_flag(tiny_path):
    proc, url = _start(tiny_path, "--api-key", "k3y")
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == os.path.basename(tiny_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
