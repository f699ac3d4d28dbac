"""`eecore serve` as a process: it serves, and SIGTERM / SIGINT under load stops it cleanly (open
streams end with their last chunk, the shutdown's error event and [DONE]; stalled uploads get a
503; exit status 0 within a few seconds, no traceback in the log)."""
import json
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
from serve_utils import start_server_process as _start


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("serve-proc"), num_layers=2)
    return path


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
    assert all(_ended_cleanly(events) for events in results)
    assert any(_ended_cleanly(events) == "shut down" for events in results)
    assert "Traceback" not in output


def _ended_cleanly(events: list) -> str:
    """How a stream ended: "length" (it ran to its end), or "shut down": its choice ended with
    finish_reason "abort", then an error event said why, then [DONE]."""
    assert events and events[-1] == "data: [DONE]", events[-3:]
    if '"finish_reason": "length"' in events[-2]:
        return "length"
    assert '"code": "server_shutting_down"' in events[-2] and '"type": "service_unavailable"' in events[-2], events[-3:]
    assert '"finish_reason": "abort"' in events[-3], events[-3:]
    return "shut down"


def test_sigterm_with_stalled_uploads_exits_within_5_s_without_a_traceback(tiny_path):
    """100 uploads that promised 1,000 bytes and sent 10, a queue of streams: at SIGTERM every
    upload gets an OpenAI-shaped 503 at once and its connection closes, the streams end cleanly,
    and the process exits with status 0 within the 5 s --shutdown-timeout, logging no traceback."""
    proc, url = _start(tiny_path, "--log-level", "info", "--max-num-seqs", "1")
    port = int(url.rsplit(":", 1)[1])
    stalled = []
    try:
        results: list = [None] * 6  # one runs, the others wait for a place in the batch
        threads = [threading.Thread(target=_long_stream, args=(url, results, i)) for i in range(6)]
        for t in threads:
            t.start()
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\":")
            stalled.append(s)
        _wait_for_requests(url, 6)
        time.sleep(0.2)  # the uploads' headers are read
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=15)
        elapsed = time.monotonic() - start
        answers = [_read_all(s) for s in stalled]
        for t in threads:
            t.join(10)
    finally:
        for s in stalled:
            s.close()
        if proc.poll() is None:
            proc.kill()
    _assert_exited_cleanly(proc, status, elapsed)
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert all(_ended_cleanly(events) for events in results)
    assert any(_ended_cleanly(events) == "shut down" for events in results)


def _assert_exited_cleanly(proc, status: int, elapsed: float) -> None:
    """The server exited with status 0 within --shutdown-timeout (5 s) of SIGTERM, logging no traceback."""
    output = proc.communicate()[0]
    print(f"exited {elapsed:.2f} s after the signal")
    assert status == 0, output
    assert elapsed < 5, elapsed
    assert "Traceback" not in output and "CancelledError" not in output, output


def _read_all(s: socket.socket) -> bytes:
    out = b""
    s.settimeout(5)
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    return out


def test_api_key_flag(tiny_path):
    proc, url = _start(tiny_path, "--api-key", "k3y", "--api-key", "other")  # repeated: two clients
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        for key in ("k3y", "other"):
            r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == os.path.basename(tiny_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_a_client_that_does_not_read_its_stream_does_not_hold_the_shutdown(tiny_path):
    """A stream whose client stops reading (its socket buffers full): the shutdown deadline cancels
    it and the process still exits within the 5 s --shutdown-timeout, with no traceback."""
    proc, url = _start(tiny_path, "--log-level", "info")
    port = int(url.rsplit(":", 1)[1])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        s.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 480, "n": 16, "logprobs": 20, "stream": True,
                           "ignore_eos": True, "temperature": 1.0}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _wait_for_requests(url, 1)
        time.sleep(1.0)  # megabytes of logprobs fill the socket's buffers
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=15)
        elapsed = time.monotonic() - start
    finally:
        s.close()
        if proc.poll() is None:
            proc.kill()
    _assert_exited_cleanly(proc, status, elapsed)


def test_accept_errors_when_file_descriptors_run_out_are_logged_once_a_second(tiny_path):
    """Out of file descriptors, asyncio fails every accept and logs each (tens of thousands of lines
    a second): the server logs them at most once a second, with a count, and serves again once
    descriptors are free."""
    import resource

    proc, url = _start(tiny_path)
    port = int(url.rsplit(":", 1)[1])
    clients = []
    try:
        in_use = len(os.listdir(f"/proc/{proc.pid}/fd"))
        soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (in_use + 4, hard))
        for _ in range(40):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(2.5)
        for c in clients:
            c.close()
        clients = []
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        time.sleep(1.5)  # asyncio listens again a second after its last failed accept
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        for c in clients:
            c.close()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=15)
    output = proc.communicate()[0]
    assert status == 0
    lines = [line for line in output.splitlines() if "cannot accept connections" in line]
    assert 1 <= len(lines) <= 5, output[-3000:]
    assert "Too many open files" in lines[0]
    assert "socket.accept() out of system resource" not in output, output[-3000:]
