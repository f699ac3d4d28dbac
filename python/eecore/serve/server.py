"""How `eecore serve` runs its app over HTTP/1.1 (uvicorn, h11), bounded against slow, idle and
half-closed clients, and how it stops.

uvicorn's own settings do what they can: `timeout_keep_alive` (an idle keep-alive connection is
closed), `limit_concurrency` (beyond that many connections or requests at once, a new request gets
uvicorn's 503), h11's limit on a request line and its headers (16 KiB, else 400) and
`timeout_graceful_shutdown`. What uvicorn does not do is done here:

- **header timeout**: a request line and headers must arrive within `header_timeout` seconds of
  the connection's opening or of the first byte after the previous answer; otherwise the
  connection is closed (with a 408 when part of a request came). A connection that never sends a
  byte is closed the same way.
- **half-closed clients**: a client that shuts its side down (`shutdown(SHUT_WR)`) after a
  complete request still gets its answer; the connection closes after it.
- **accept errors**: when file descriptors run out, asyncio logs an accept error per attempt
  (tens of thousands of lines a second); they are logged at most once a second, with a count.
- **shutdown**: on SIGINT / SIGTERM the engine ends its requests at once; uvicorn waits for the
  connections to close at most `shutdown_timeout - 1.5` seconds (at least half of it), then cancels
  what is left (app.py's ShutdownGuard ends each quietly); a watchdog ends the process
  `shutdown_timeout` seconds after the signal whatever is still running.

The body timeout is the app's (http_errors.BodyDeadline): it needs the request's ASGI receive.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("eecore.serve")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def server_config(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                  keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                  max_connections: Optional[int] = DEFAULT_MAX_CONNECTIONS,
                  shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> uvicorn.Config:
    """uvicorn's configuration for `app` with eecore's limits and its HTTP protocol (h11 with a
    header timeout and half-close support)."""
    for name, value in (("header_timeout", header_timeout), ("keep_alive_timeout", keep_alive_timeout),
                        ("shutdown_timeout", shutdown_timeout)):
        if not value > 0:
            raise ValueError(f"server_config: '{name}' must be > 0, got {value!r}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"server_config: 'max_connections' must be >= 1, got {max_connections!r}")
    # loop="asyncio": quiet_accept_errors hooks asyncio's loop, and uvicorn would take uvloop where it
    # is installed (Ray Serve brings it), whose accept errors go elsewhere
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=EecoreH11Protocol, loop="asyncio",
                            timeout_keep_alive=keep_alive_timeout, limit_concurrency=max_connections,
                            timeout_graceful_shutdown=graceful_shutdown_s(shutdown_timeout))
    config.eecore_header_timeout = header_timeout
    return config


def graceful_shutdown_s(shutdown_timeout: float) -> float:
    """uvicorn's wait for open connections after a signal: the shutdown timeout less 1.5 s for the
    rest of the shutdown (at least half of it)."""
    return max(shutdown_timeout - 1.5, shutdown_timeout / 2)


# ---- the HTTP protocol ---------------------------------------------------------------------------


class EecoreH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and answers to half-closed clients."""

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout = getattr(config, "eecore_header_timeout", DEFAULT_HEADER_TIMEOUT_S)
        self._header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()  # the first bytes of the next request (or the rest of an unread body)
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's line and headers arrived
            self._cancel_header_timer()

    def eof_received(self):
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            # the client half-closed after a complete request: answer it, then close
            cycle.keep_alive = False
            return True
        return super().eof_received()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered (its headers came in the meantime)
        if self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a request came
            body = json.dumps({"error": {
                "message": f"the request's line and headers did not arrive within {self.header_timeout:g} s",
                "type": "invalid_request_error", "param": None, "code": None}}).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


# ---- accept errors -------------------------------------------------------------------------------

ACCEPT_ERROR = "socket.accept() out of system resource"


def quiet_accept_errors(loop, interval: float = 1.0):
    """Makes `loop` log its accept errors (file descriptors or memory exhausted) at most once per
    `interval` seconds, with how many there were; other errors go to the handler it had. Returns a
    function that restores that handler."""
    previous = loop.get_exception_handler()
    state = {"last": float("-inf"), "count": 0}

    def handler(loop, context):
        if context.get("message") != ACCEPT_ERROR:
            return previous(loop, context) if previous is not None else loop.default_exception_handler(context)
        state["count"] += 1
        now = time.monotonic()
        if now - state["last"] >= interval:
            since = "" if state["last"] == float("-inf") else f" in the last {now - state['last']:.1f} s"
            logger.error("cannot accept connections: %s (%d time(s)%s; the open-file limit, ulimit -n, is reached)",
                         context.get("exception"), state["count"], since)
            state["last"], state["count"] = now, 0

    loop.set_exception_handler(handler)

    def restore() -> None:
        if loop.get_exception_handler() is handler:
            loop.set_exception_handler(previous)

    return restore


# ---- the server and its shutdown ----------------------------------------------------------------


class EngineServer(uvicorn.Server):
    """uvicorn's server which, on SIGINT / SIGTERM, also begins the engine's shutdown (its requests
    end at once: open streams get their last chunk) and arms a watchdog that ends the process
    `shutdown_timeout` seconds after the signal, whatever is still running."""

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._watchdog: Optional[threading.Timer] = None
        # an engine that cannot go on (a tensor-parallel rank died) shuts the server down as a signal would
        engine.on_fatal = lambda: self.handle_exit(signal.SIGTERM, None)

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_shutdown()
        if self._watchdog is None:
            self._watchdog = threading.Timer(self.shutdown_timeout, self._exit_now)
            self._watchdog.daemon = True
            self._watchdog.start()
        super().handle_exit(sig, frame)

    def _exit_now(self) -> None:
        logger.warning("still running %g s after the signal (--shutdown-timeout): exiting now", self.shutdown_timeout)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(1)
