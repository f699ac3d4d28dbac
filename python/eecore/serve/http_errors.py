"""The HTTP edges of the server: every error in OpenAI's shape (`{"error": {...}}`, 4xx for anything a
client sent), JSON that cannot fail to encode, and the request-body limit (413 before parsing)."""
from __future__ import annotations

import json
import logging
import re
from typing import Optional

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
        exc = BodyTooLarge(self.max_bytes)
        body = json.dumps(error_body(exc.detail, "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than {max_bytes} bytes (--max-request-bytes)")


# ---- errors in OpenAI's shape -------------------------------------------------------------------


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return ASCIIJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return ASCIIJSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
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


def _path(loc) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out
