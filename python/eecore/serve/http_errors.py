"""The HTTP edges of the server: every error in OpenAI's shape (`{"error": {...}}`, 4xx for anything a
client sent), JSON that cannot fail to encode, the API key (checked from the headers, before the
body is read), the request-body limits (413 before parsing; 408 for a body that does not arrive in
time; 503 for one still arriving when the server shuts down) and a quiet end for requests that the
shutdown deadline cancels."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eecore.serve.protocol import APIError, error_body

logger = logging.getLogger("eecore.serve")


class ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: whatever text a response carries (an error that
    quotes the request, a decoded token), its encoding cannot fail."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


# ---- the API key ---------------------------------------------------------------------------------

OPEN_PATHS = frozenset({"/health", "/metrics"})


class APIKeyAuth:
    """ASGI middleware, outside every other: with an API key, a request to any path but /health and
    /metrics needs exactly one `Authorization: Bearer KEY` header. It is checked from the headers
    alone, so a request without it gets its 401 before its body is read or parsed (the server
    then discards the body as it arrives, without parsing it). Two Authorization headers are
    refused, whatever they hold: proxies and frameworks disagree on which one counts."""

    def __init__(self, app, api_keys):
        """`api_keys`: one key or several (each a client, among which the engine shares its queue:
        the matching key's index is the request's `state["api_key_index"]`)."""
        self.app = app
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
        self.expected = [f"Bearer {key}".encode() for key in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        values = [value for name, value in scope.get("headers") or () if name.lower() == b"authorization"]
        if len(values) == 1:
            # every key compared, in constant time each: which one matched leaks nothing by its timing
            matches = [secrets.compare_digest(values[0], expected) for expected in self.expected]
            if any(matches):
                if len(self.expected) > 1:
                    scope.setdefault("state", {})["api_key_index"] = matches.index(True)
                return await self.app(scope, receive, send)
        if len(values) > 1:
            message = f"{len(values)} Authorization headers: send exactly one, 'Authorization: Bearer <key>'"
        else:
            message = "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'"
        await send_error(send, 401, error_body(message, "invalid_request_error", code="invalid_api_key"),
                         headers=[(b"www-authenticate", b"Bearer")])


async def send_error(send, status: int, body: dict, headers=(), close: bool = False) -> None:
    """An error answered from ASGI middleware, outside FastAPI's handlers (same shape and encoding)."""
    data = json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


# ---- request size -------------------------------------------------------------------------------


class BodyLimit:
    """ASGI middleware: a body longer than `max_bytes` (by its Content-Length, or as it streams in
    when it has none) gets a 413 in OpenAI's error shape, and is never buffered whole."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # the error handlers answer it (FastAPI re-raises HTTP errors)
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted_receive, send)

    async def _refuse(self, send) -> None:
        await send_error(send, 413, error_body(BodyTooLarge(self.max_bytes).detail, "invalid_request_error"),
                         close=True)


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than {max_bytes} bytes (--max-request-bytes)")


# ---- slow bodies and the shutdown -----------------------------------------------------------------

POLL_S = 0.1  # how often a body read looks for the server's shutdown


class BodyDeadline:
    """ASGI middleware: a request's body must arrive whole within `timeout` seconds of its headers,
    else a 408 and the connection is closed (a client that promises a Content-Length and sends
    less is not held); a body still arriving when the server begins to shut down (`shutting_down()`)
    gets a 503 at once, and the connection is closed."""

    def __init__(self, app, timeout: float, shutting_down: Callable[[], bool]):
        self.app = app
        self.timeout = timeout
        self.shutting_down = shutting_down

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        whole = False

        async def timed_receive():
            nonlocal whole
            if whole:  # after the body: the wait for a disconnect is not timed
                return await receive()
            pending = asyncio.ensure_future(receive())
            try:
                while True:
                    if self.shutting_down():
                        raise ShuttingDownWhileReading()
                    left = deadline - loop.time()
                    if left <= 0:
                        raise BodyTimeout(self.timeout)
                    done, _ = await asyncio.wait({pending}, timeout=min(left, POLL_S))
                    if done:
                        break
            finally:
                if not pending.done():
                    pending.cancel()
            message = pending.result()
            if message["type"] != "http.request" or not message.get("more_body", False):
                whole = True
            return message

        await self.app(scope, timed_receive, send)


class BodyTimeout(StarletteHTTPException):
    def __init__(self, timeout: float):
        super().__init__(408, f"the request body did not arrive within {timeout:g} s of its headers (--body-timeout)",
                         headers={"Connection": "close"})


class ShuttingDownWhileReading(StarletteHTTPException):
    error_type = "service_unavailable"

    def __init__(self):
        super().__init__(503, "the server is shutting down", headers={"Connection": "close"})


class ShutdownGuard:
    """ASGI middleware, outside every other: a request that the shutdown deadline cancels (a client
    that does not read its stream, say) ends without a traceback: a 503 if its response had not
    started, its response ended (and the connection closed) if it had. Only while
    `shutting_down()`: any other cancellation goes on as it came."""

    def __init__(self, app, shutting_down: Callable[[], bool]):
        self.app = app
        self.shutting_down = shutting_down

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = ended = False

        async def tracked_send(message):
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            if not self.shutting_down():
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
            logger.warning("%s %s: cut short by the shutdown deadline (--shutdown-timeout)", scope.get("method"),
                           scope.get("path"))
            try:
                if not started:
                    finish = send_error(send, 503, error_body("the server is shutting down", "service_unavailable"),
                                        close=True)
                elif not ended:
                    finish = send({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    return
                await asyncio.wait_for(finish, POLL_S)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                pass  # the client does not read: the server closes its connection


# ---- errors in OpenAI's shape -------------------------------------------------------------------


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return ASCIIJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("loc") == ("body",) and isinstance(e.get("input"), (bytes, bytearray)) for e in errors):
            # a body FastAPI did not parse as JSON: its Content-Type is not JSON (or missing)
            kind = request.headers.get("content-type")
            said = f"its Content-Type is {_quoted(kind)}" if kind else "it has no Content-Type"
            return ASCIIJSONResponse(error_body(f"the body must be JSON sent with 'Content-Type: application/json'; "
                                                f"{said}", "invalid_request_error"), status_code=415)
        message, param = _validation_message(errors)
        return ASCIIJSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = getattr(exc, "error_type", None) or ("invalid_request_error" if exc.status_code < 500
                                                    else "server_error")
        return ASCIIJSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return ASCIIJSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


def _validation_message(errors) -> tuple[str, Optional[str]]:
    """The first schema error as '<param path>: <what is wrong>', and the top-level param."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if e.get("type") == "json_invalid":
        return f"the body is not valid JSON: {e.get('ctx', {}).get('error', msg)}", None
    if e.get("type") == "extra_forbidden" and loc:
        return f"{_path(loc)}: unknown or unsupported parameter", str(loc[0])
    if not loc:
        if e.get("type") == "missing":
            return "the request has no body: expected a JSON object", None
        head = re.split(r"[.\[]", msg.split(":", 1)[0], maxsplit=1)[0]  # "prompt[0]: ..." names "prompt"
        return msg, head if head.isidentifier() and ":" in msg else None
    return f"{_path(loc)}: {msg}", str(loc[0])


def _quoted(text: str, limit: int = 64) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _path(loc) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out
