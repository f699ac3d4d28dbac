"""The OpenAI-compatible HTTP layer (FastAPI): it parses and validates requests, hands sequences to
the AsyncEngine and turns its deltas into responses or server-sent events (sse-starlette). It never
touches the engine's state or a tensor.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed or not), GET /v1/models,
GET /health, GET /metrics (Prometheus). Every error has OpenAI's shape; user input gets a 4xx.
"""
from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Optional, Sequence, Union

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from eecore.sampling_params import SamplingParams
from eecore.serve import responses as R
from eecore.serve.async_engine import AsyncEngine, SubRequest
from eecore.serve.metrics import CONTENT_TYPE
from eecore.serve.http_errors import (APIKeyAuth, ASCIIJSONResponse, BodyDeadline, BodyLimit, ShutdownGuard,
                                      add_error_handlers)
from eecore.serve.server import quiet_accept_errors
from eecore.serve.prompt_bounds import PromptBounds
from eecore.serve.request_run import RequestRun
from eecore.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("eecore.serve")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# a request's body must arrive within this of its headers (408 otherwise)
DEFAULT_BODY_TIMEOUT_S = 30.0
# Request bodies past this get a 413 before they are parsed: a prompt the context can hold is far
# smaller (8,192 tokens as JSON ids or text are under 100 KB), and parsing is done on the event loop.
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024


def default_model_name(model: Optional[str]) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


def build_app(engine: AsyncEngine, model_name: str, api_key: Union[str, Sequence[str], None] = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              body_timeout: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """The server's ASGI app over a (not yet started) AsyncEngine; its lifespan starts and stops
    the engine thread. With `api_key` (one key, or several: each a client, and clients take turns in
    the engine's queue) the API docs are off (they would describe the API to anyone).
    Run it with eecore.serve.server's config (its timeouts and HTTP protocol), as `eecore serve` does."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        restore = quiet_accept_errors(asyncio.get_running_loop())
        engine.start()
        try:
            yield
        finally:
            engine.stop(timeout=1.0)  # a daemon thread: the process need not wait for a step to end
            restore()

    docs = {} if not api_key else dict(docs_url=None, redoc_url=None, openapi_url=None)
    # no redirect_slashes: a 307 to the path with(out) a trailing slash would be built from the Host header
    app = FastAPI(title="eecore", version=_version(), lifespan=lifespan, default_response_class=ASCIIJSONResponse,
                  redirect_slashes=False, **docs)
    app.state.engine = engine
    # middleware added last runs first: the key is checked from the headers before the body limits
    # and before anything reads or parses the body
    shutting_down = lambda: engine.shutting_down  # noqa: E731
    app.add_middleware(BodyDeadline, timeout=body_timeout, shutting_down=shutting_down)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyAuth, api_keys=api_key)
    app.add_middleware(ShutdownGuard, shutting_down=shutting_down)
    add_error_handlers(app)

    v1 = APIRouter(prefix="/v1")
    service = _Service(engine, model_name)
    vocab_size = engine.engine.model.config.vocab_size

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": service.created,
                                            "owned_by": "eecore", "max_model_len": engine.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_stop_token_ids(body.stop_token_ids, vocab_size)
        return await service.completions(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_stop_token_ids(body.stop_token_ids, vocab_size)
        return await service.chat(body, request)

    app.include_router(v1)

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health():
        if engine.shutting_down:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    @app.head("/metrics", include_in_schema=False)
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return app


# ---- requests → sequences → responses ----------------------------------------------------------


class _Service:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.created = R.now()
        self.logprobs = R.Logprobs(engine.tokenizer)
        self.speculative = engine.engine.strategy.lookahead > 1
        self.bounds = PromptBounds(engine.llm, engine.max_model_len)
        # Tokenizing and rendering templates take a worker thread: on the event loop, a long prompt
        # would stall every other connection (health checks, open streams) while it is encoded. Two
        # workers: rendering is Python, which holds the interpreter, so more would only take turns
        # with the streams (the work before a refusal is bounded: PromptBounds).
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="eecore-prompts")

    async def _in_worker(self, work):
        return await asyncio.get_running_loop().run_in_executor(self.workers, work)

    # ---- endpoints -------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        self._check_fits_the_queue(body.n * len(body.prompt))
        for i, p in enumerate(body.prompt):
            self.bounds.check_text(p, f"prompt {i}", "prompt")
        prompts = await self._in_worker(
            lambda: [(p, self._encode(p, i, "prompt")) for i, p in enumerate(body.prompt)])
        subs = self._subrequests(body, prompts, COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs)
        run = RequestRun(self, "text_completion", R.new_id("cmpl"), body, subs, sum(len(ids) for _, ids in prompts),
                   top_logprobs=body.logprobs)
        return await run.respond(request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        self._check_fits_the_queue(body.n)
        conversation = [m.as_template_dict() for m in body.messages]
        self.bounds.check_messages(conversation)
        ids = await self._in_worker(lambda: self._chat_ids(conversation))
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "pass max_tokens or max_completion_tokens, not both", param="max_tokens")
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        subs = self._subrequests(body, [(None, ids)], None, top, max_tokens)
        run = RequestRun(self, "chat.completion", R.new_id("chatcmpl"), body, subs, len(ids), top_logprobs=top)
        return await run.respond(request)

    def _chat_ids(self, conversation: list[dict]) -> list[int]:
        self.bounds.check_tokens("".join(str(m.get("content") or "") for m in conversation), "messages", "messages",
                                 boundaries=len(conversation))
        try:
            _, ids = self.engine.llm.chat_prompt(conversation)
        except Exception as exc:  # no template, or the template refused the conversation
            raise APIError(400, f"messages: the chat template cannot format them: {exc}", param="messages") \
                from None
        return self._encode(ids, 0, "messages")

    # ---- validation ------------------------------------------------------------------------
    def _check_fits_the_queue(self, num_seqs: int) -> None:
        """A request of more sequences than may ever wait can never run: a 400, not a 503 that
        clients would retry forever."""
        if num_seqs > self.engine.max_waiting:
            raise APIError(400, f"this request asks for {num_seqs} sequences (prompts x n); the server queues at "
                                f"most {self.engine.max_waiting} (--max-waiting-requests)", param="n")

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model {_shown(model)} does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _encode(self, prompt, index: int, param: str) -> list[int]:
        if param == "prompt":
            self.bounds.check_tokens(prompt, f"prompt {index}", param)
        try:
            return self.engine.engine.encode_prompt(prompt, index)
        except (ValueError, TypeError) as exc:
            message = str(exc) if param == "prompt" else str(exc).replace(f"prompt {index}:", f"{param}:")
            raise APIError(400, message, param=param) from None

    def _subrequests(self, body, prompts, default_max_tokens: Optional[int], logprobs: Optional[int],
                     max_tokens: Optional[int] = None) -> list[SubRequest]:
        max_tokens = max_tokens if max_tokens is not None else body.max_tokens
        limit = self.engine.max_model_len
        subs = []
        for i, (prompt, ids) in enumerate(prompts):
            room = limit - len(ids)
            want = max_tokens if max_tokens is not None else min(default_max_tokens or room, room)
            if want > room:
                raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                    f"{len(ids)} tokens, so at most {room} can be generated, but {want} were asked "
                                    f"for", param="max_tokens")
            for j in range(body.n):
                subs.append(SubRequest(prompt if isinstance(prompt, str) else None, ids,
                                       self._sampling(body, want, logprobs, j), i * body.n + j))
        return subs

    @staticmethod
    def _sampling(body, max_tokens: int, logprobs: Optional[int], j: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=max(body.top_k or 0, 0),
                seed=None if body.seed is None else _choice_seed(body.seed, j), stop=body.stop,
                stop_token_ids=body.stop_token_ids or (), ignore_eos=body.ignore_eos, logprobs=logprobs)
        except ValueError as exc:  # a combination the schema let through
            message = str(exc).replace("SamplingParams: ", "")
            param = message.split("'")[1] if message.count("'") >= 2 else None
            raise APIError(400, message, param=param) from None


def _check_stop_token_ids(ids: Optional[list[int]], vocab_size: int) -> None:
    for i, t in enumerate(ids or ()):
        if not 0 <= t < vocab_size:
            raise APIError(400, f"stop_token_ids[{i}]: {_shown(t)} is not a token id of this model's vocabulary "
                                f"[0, {vocab_size})", param="stop_token_ids")


def _shown(value, limit: int = 64) -> str:
    """A value of the request quoted in an error, cut to `limit` characters (the error must not
    echo a megabyte back)."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _choice_seed(seed: int, choice: int) -> int:
    """Choice j of a seeded request with n > 1 draws with seed + j, wrapped into the signed 64-bit
    range torch takes (the schema bounds `seed` to it)."""
    return (seed + choice + 2 ** 63) % 2 ** 64 - 2 ** 63


def _version() -> str:
    from eecore import __version__

    return __version__
