"""One request in the engine, answered as a whole response or as a stream of server-sent events
(sse-starlette): the engine's deltas turned into OpenAI's objects, the client's disconnect and the
server's shutdown turned into the request's end."""
from __future__ import annotations

import asyncio
import json
from typing import Optional

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse

from eecore.serve import responses as R
from eecore.serve.async_engine import EngineDownError, EngineError, QueueFullError, RequestHandle, ShuttingDownError, SubRequest
from eecore.serve.protocol import APIError, error_body

# sse-starlette would cut a stream this long after SIGTERM: never, in effect. The engine ends every
# stream at once (its last chunk, then the shutdown's error event) and --shutdown-timeout bounds
# the rest (ShutdownGuard ends what the deadline cancels).
STREAM_SHUTDOWN_GRACE_S = 3600.0


class RequestRun:
    """One request in the engine, rendered as a whole response or as a stream."""

    def __init__(self, service, obj: str, request_id: str, body, subs: list[SubRequest],
                 prompt_tokens: int, top_logprobs: Optional[int]):
        self.s = service
        self.engine = service.engine
        self.obj = obj
        self.chat = obj == "chat.completion"
        self.id = request_id
        self.body = body
        self.subs = subs
        self.created = R.now()
        self.top = top_logprobs
        self.usage = R.Usage(self.engine.num_layers, prompt_tokens, service.speculative)
        self.offsets = [0] * len(subs)   # completions logprobs: text offset per choice
        self.handle: Optional[RequestHandle] = None

    async def respond(self, request: Request):
        try:
            # the client the request came from, where several API keys share the server
            self.handle = self.engine.add(self.subs, client=getattr(request.state, "api_key_index", None))
        except QueueFullError as exc:  # overload that clears as requests finish: retry later
            raise APIError(503, str(exc), type="service_unavailable", code="server_overloaded",
                           headers={"Retry-After": "1"}) from None
        except ShuttingDownError as exc:
            raise APIError(503, str(exc), type="service_unavailable") from None
        if self.body.stream:
            return EventSourceResponse(self._events(), sep="\n", shutdown_grace_period=STREAM_SHUTDOWN_GRACE_S,
                                       client_close_handler_callable=self._client_closed)
        return await self._whole(request)

    # ---- streaming -------------------------------------------------------------------------
    async def _client_closed(self, message) -> None:
        self.engine.abort(self.handle)

    async def _events(self):
        finished = False
        aborted = False
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        try:
            if self.chat:
                for sub in self.subs:
                    yield self._json(self._chunk(sub.index, "", None, None, role=True), include_usage)
            async for d in self.handle.deltas():
                self.usage.add(d)
                aborted |= d.finished and d.finish_reason == "abort"
                lp = self._logprobs(d)
                if d.text or d.finished or lp is not None:
                    yield self._json(self._chunk(d.index, d.text, lp, d.finish_reason if d.finished else None),
                                     include_usage)
            finished = True
            if include_usage:
                yield json.dumps(R.usage_chunk(self.id, self.created, self.s.model_name, self._chunk_object(),
                                               self.usage))
            if aborted and self.engine.shutting_down:
                # the choices cut short ended with finish_reason "abort" (vLLM's); the reason follows as an
                # error event, which OpenAI's clients raise as an APIError, then [DONE] as vLLM ends a stream
                yield json.dumps(error_body("the server is shutting down: this stream was cut short; retry the "
                                            "request", "service_unavailable", code="server_shutting_down"))
            yield "[DONE]"
        except EngineError as exc:
            finished = True
            kind = "service_unavailable" if isinstance(exc, EngineDownError) else "server_error"
            yield json.dumps(error_body(str(exc), kind))
        finally:
            if not finished:  # the client went away, or the server is stopping the stream
                self.engine.abort(self.handle)

    def _chunk(self, index: int, text: str, logprobs, finish_reason, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return R.chat_chunk(self.id, self.created, self.s.model_name, index, delta, logprobs, finish_reason)
        return R.completion_chunk(self.id, self.created, self.s.model_name, index, text, logprobs, finish_reason)

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @staticmethod
    def _json(chunk: dict, include_usage: bool) -> str:
        if include_usage:
            chunk["usage"] = None
        return json.dumps(chunk)

    def _logprobs(self, d) -> Optional[dict]:
        if self.top is None or not d.token_ids:
            return None
        if self.chat:
            return self.s.logprobs.chat(d, self.top)
        out, self.offsets[d.index] = self.s.logprobs.completion(d, self.offsets[d.index])
        return out

    # ---- whole responses -------------------------------------------------------------------
    async def _whole(self, request: Request):
        texts = [""] * len(self.subs)
        reasons: list[Optional[str]] = [None] * len(self.subs)
        logprobs: list[Optional[dict]] = [None] * len(self.subs)

        async def consume():
            async for d in self.handle.deltas():
                self.usage.add(d)
                texts[d.index] += d.text
                lp = self._logprobs(d)
                if lp is not None:
                    logprobs[d.index] = _merge_logprobs(logprobs[d.index], lp)
                if d.finished:
                    reasons[d.index] = d.finish_reason

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not consumer.done():  # the client went away before its answer: free its sequences now
            consumer.cancel()
            self.engine.abort(self.handle)
            return Response(status_code=499)
        try:
            consumer.result()
        except EngineDownError as exc:
            raise APIError(503, str(exc), type="service_unavailable") from None
        except EngineError as exc:
            raise APIError(500, str(exc), type="server_error") from None
        if "abort" in reasons and self.engine.shutting_down:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        choices = []
        for i in range(len(self.subs)):
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                                "logprobs": logprobs[i], "finish_reason": reasons[i]})
            else:
                choices.append({"index": i, "text": texts[i], "logprobs": logprobs[i], "finish_reason": reasons[i]})
        return {"id": self.id, "object": self.obj, "created": self.created, "model": self.s.model_name,
                "choices": choices, "usage": self.usage.body()}


def _merge_logprobs(acc: Optional[dict], new: dict) -> dict:
    if acc is None:
        return new
    for key, values in new.items():
        acc[key] = acc[key] + values
    return acc


async def _disconnected(request: Request) -> None:
    """Returns once the client closed the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
