"""The async engine: one thread owns the `LLMEngine` and steps it while any request is running or
waiting. Requests arrive from the event loop at any time, from any number of connections, and join
the running batch at the next step (continuous batching). Each step's deltas are routed to the
requests' asyncio queues with `loop.call_soon_threadsafe`, so the HTTP side never touches the
engine or a tensor, and stays responsive while a step runs (torch releases the GIL in its ops).

Thread ownership: everything on `self.engine` is read and written by the engine thread only. The
event loop hands it work through `_inbox` / `_aborts` under a lock and wakes it with an event;
an idle engine thread sleeps on that event (no busy-spin).

Fairness between requests: a request's sequences join the engine's queue a few at a time, in turn
with every other request's, so that no request has more than `max_prefill_tokens_per_request` of
its prompt tokens waiting or in prefill at once (at least one sequence). A request of 16 long
prompts then holds about one prompt's prefill at a time, and a short request that arrives behind
it is queued next to that one instead of behind all 16 (the scheduler shares each step's prefill
budget between the prompts in its queue). Where several clients share the server (several API
keys), the turns go client by client, and a client's requests together hold at most
`max_prefill_tokens_per_client` such tokens: a client that sends many requests at once cannot fill
the queue ahead of another's. The queue is bounded twice: `max_waiting` sequences and
`max_waiting_tokens` prompt tokens (beyond either a request gets 503 with Retry-After).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Union

from eecore.engine.sequence import Sequence
from eecore.engine.streaming import DeltaTracker
from eecore.outputs import RequestDelta
from eecore.sampling_params import SamplingParams
from eecore.serve.metrics import ServerMetrics

logger = logging.getLogger("eecore.serve")


class QueueFullError(RuntimeError):
    """The bound on waiting requests is reached (the server answers 503)."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down and takes no new requests (503)."""


class EngineError(RuntimeError):
    """A step failed inside the engine; the requests in it were aborted (500)."""


class EngineDownError(EngineError):
    """The engine cannot go on (a tensor-parallel rank died: an exception marked `fatal`); every
    request ends with this (503) and the server shuts down."""


@dataclass
class SubRequest:
    """One sequence to run: a prompt (its token ids) and its sampling params. `index` is the
    choice index the deltas carry back."""
    prompt: Union[str, list[int], None]
    token_ids: list[int]
    params: SamplingParams
    index: int


_request_ids = itertools.count()


@dataclass
class RequestHandle:
    """One HTTP request's sequences (n choices, several prompts) and the queue of their deltas."""
    subrequests: list[SubRequest]
    queue: asyncio.Queue
    request_id: int = field(default_factory=lambda: next(_request_ids))
    seqs: list[Sequence] = field(default_factory=list)   # set by the engine thread at admission
    aborted: bool = False
    client: Optional[int] = None  # which of several API keys sent it (None: one client, or none known)
    # engine thread only: the subrequests not yet in the engine's queue (fairness, see the module doc)
    held: deque = field(default_factory=deque)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(sub.token_ids) for sub in self.subrequests)

    def prefill_tokens_in_flight(self) -> int:
        """Prompt tokens of its admitted sequences still waiting or in prefill (engine thread)."""
        return sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in self.seqs
                   if not seq.is_finished)

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """Every delta of every choice, until all of them finished (an aborted choice ends with
        finish reason "abort"). Raises EngineError if the engine failed them."""
        open_choices = len(self.subrequests)
        while open_choices:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                open_choices -= 1
            yield item


class AsyncEngine:
    """Owns `llm.engine` from a background thread. `max_waiting` bounds the sequences and
    `max_waiting_tokens` the prompt tokens that wait for a place in the running batch (beyond
    either `add` raises QueueFullError; default: 8 contexts' worth); `max_prefill_tokens_per_request`
    bounds one request's prompt tokens waiting or in prefill at once (default: a step's token budget)."""

    def __init__(self, llm, max_waiting: int = 256, max_waiting_tokens: Optional[int] = None,
                 max_prefill_tokens_per_request: Optional[int] = None,
                 max_prefill_tokens_per_client: Optional[int] = None):
        for name, value in (("max_waiting", max_waiting), ("max_waiting_tokens", max_waiting_tokens),
                            ("max_prefill_tokens_per_request", max_prefill_tokens_per_request),
                            ("max_prefill_tokens_per_client", max_prefill_tokens_per_client)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"AsyncEngine: '{name}' must be a positive int, got {value!r}")
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.num_layers = llm.model.num_layers
        self.max_waiting = max_waiting
        self.max_waiting_tokens = max_waiting_tokens or 8 * self.max_model_len
        self.max_prefill_tokens_per_request = \
            max_prefill_tokens_per_request or self.engine.scheduler.max_num_batched_tokens
        # two steps' worth: the scheduler always has a step's prefill to take from a busy client
        self.max_prefill_tokens_per_client = \
            max_prefill_tokens_per_client or 2 * self.engine.scheduler.max_num_batched_tokens
        self.metrics = ServerMetrics(self.engine.blocks.num_blocks, self.num_layers)
        self._tracker = DeltaTracker(self.engine)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[RequestHandle] = []
        self._aborts: list[RequestHandle] = []
        self._live: dict[int, RequestHandle] = {}          # engine thread only
        self._owner: dict[int, RequestHandle] = {}         # seq_id -> handle, engine thread only
        self._num_inbox_seqs = 0
        self._num_inbox_tokens = 0
        # what waits in the engine thread, held back or in the scheduler's queue (written by the
        # engine thread after each pass, read by `add` as an estimate)
        self._queued_seqs = 0
        self._queued_tokens = 0
        self._failed_in_a_row = 0                          # engine thread only
        self._shutting_down = False
        self._stop = False
        self.failure: Optional[Exception] = None  # what stopped the engine for good (EngineDownError)
        self.on_fatal: Optional[Callable[[], None]] = None  # called once the engine is down (the server exits)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    # ---- life cycle (event loop side) ------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Starts the engine thread; deltas go to `loop` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="eecore-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Takes no new requests; the running and waiting ones end (finish reason "abort") at the
        next step, so every open stream closes cleanly. Safe from a signal handler or any thread."""
        self._shutting_down = True
        self._wake.set()

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is left and ends the engine thread."""
        self._shutting_down = True
        with self._lock:
            self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---- requests (event loop side) --------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences not yet in the running batch (an estimate from outside the engine thread)."""
        return self._num_inbox_seqs + self._queued_seqs

    @property
    def num_waiting_tokens(self) -> int:
        """Their prompt tokens (an estimate from outside the engine thread)."""
        return self._num_inbox_tokens + self._queued_tokens

    def add(self, subrequests: list[SubRequest], client: Optional[int] = None) -> RequestHandle:
        """Queues one request's sequences; they join the batch in turn with other requests' (and,
        with `client`, which of several API keys sent it, in turn with other clients')."""
        if self._shutting_down:
            raise ShuttingDownError("the server is shutting down")
        if self._thread is None:
            raise RuntimeError("AsyncEngine: start() it first")
        handle = RequestHandle(subrequests, asyncio.Queue(), client=client)
        with self._lock:  # (the engine thread moves the inbox's counts to the queue's under it)
            waiting, tokens = self.num_waiting, self.num_waiting_tokens
        if waiting + len(subrequests) > self.max_waiting:
            self.metrics.rejected_overload.inc()
            raise QueueFullError(f"the server is overloaded: {waiting} sequences are waiting and this request adds "
                                 f"{len(subrequests)}, past --max-waiting-requests {self.max_waiting}; retry later")
        if tokens and tokens + handle.prompt_tokens > self.max_waiting_tokens:  # (an empty queue takes any request)
            self.metrics.rejected_overload.inc()
            raise QueueFullError(f"the server is overloaded: {tokens} prompt tokens are waiting and this request adds "
                                 f"{handle.prompt_tokens}, past --max-waiting-tokens {self.max_waiting_tokens}; "
                                 f"retry later")
        with self._lock:
            self._inbox.append(handle)
            self._num_inbox_seqs += len(subrequests)
            self._num_inbox_tokens += handle.prompt_tokens
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Ends a request (its client went away); its blocks are free by the next step. Idempotent."""
        with self._lock:
            if handle.aborted:
                return
            handle.aborted = True
            self._aborts.append(handle)
        self._wake.set()

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                adds, aborts, stop = self._inbox, self._aborts, self._stop
                self._inbox, self._aborts = [], []
                self._queued_seqs += self._num_inbox_seqs
                self._queued_tokens += self._num_inbox_tokens
                self._num_inbox_seqs = self._num_inbox_tokens = 0
            out: list[tuple[RequestHandle, object]] = []
            for handle in adds:
                self._admit(handle)
            for handle in aborts:
                self._abort(handle, out)
            if self._shutting_down or stop:
                for handle in list(self._live.values()):
                    self._abort(handle, out)
            self._release_held()
            if self._live and not stop:
                self._step(out)
            self._count_queued()
            self._deliver(out)
            self.metrics.update_engine(self.engine, self.num_waiting)
            if stop:
                return
            if not self._live:
                self._wake.wait()

    def _admit(self, handle: RequestHandle) -> None:
        """Registers a request; its sequences join the engine's queue in turn (_release_held)."""
        if handle.aborted:
            return
        handle.held.extend(handle.subrequests)
        self._live[handle.request_id] = handle

    def _release_held(self) -> None:
        """Moves held sequences into the engine's queue in turns: each pass, one sequence a request
        (one a client, for requests that name their client), while each request's prompt tokens
        waiting or in prefill stay under max_prefill_tokens_per_request and each client's under
        max_prefill_tokens_per_client."""
        cap, client_cap = self.max_prefill_tokens_per_request, self.max_prefill_tokens_per_client
        open_handles = [h for h in self._live.values() if h.held]
        if not open_handles:
            return
        in_flight = {h.request_id: h.prefill_tokens_in_flight() for h in self._live.values()}
        by_client: dict[int, int] = {}
        for handle in self._live.values():
            if handle.client is not None:
                by_client[handle.client] = by_client.get(handle.client, 0) + in_flight[handle.request_id]
        admitted = True
        while admitted:  # passes, until one admits nothing
            admitted = False
            took_turn: set[int] = set()  # the clients that admitted a sequence this pass
            for handle in open_handles:
                client = handle.client
                if not handle.held or in_flight[handle.request_id] >= cap or (client is not None and (
                        client in took_turn or by_client.get(client, 0) >= client_cap)):
                    continue
                sub = handle.held.popleft()
                self._enqueue(handle, sub)
                admitted = True
                in_flight[handle.request_id] += len(sub.token_ids)
                if client is not None:
                    took_turn.add(client)
                    by_client[client] = by_client.get(client, 0) + len(sub.token_ids)

    def _enqueue(self, handle: RequestHandle, sub: SubRequest) -> None:
        seq = self.engine.enqueue(sub.prompt, sub.token_ids, sub.params, sub.index)
        handle.seqs.append(seq)
        self._owner[seq.seq_id] = handle

    def _count_queued(self) -> None:
        held = [sub for h in self._live.values() for sub in h.held]
        waiting = self.engine.scheduler.waiting
        seqs = len(held) + len(waiting)
        tokens = sum(len(s.token_ids) for s in held) + sum(s.num_prompt_tokens for s in waiting)
        with self._lock:
            self._queued_seqs, self._queued_tokens = seqs, tokens

    def _abort(self, handle: RequestHandle, out: list) -> None:
        while handle.held:  # each choice still ends with a delta (finish reason "abort")
            self._enqueue(handle, handle.held.popleft())
        for seq in handle.seqs:
            if self.engine.abort_request(seq):
                self._route(seq, out)
        self._live.pop(handle.request_id, None)

    def _step(self, out: list) -> None:
        try:
            seqs = self.engine.step()
        except Exception as exc:  # one request's failure must not take the others (or the server) down
            if getattr(exc, "fatal", False):  # unless the engine itself is gone
                self._go_down(exc, out)
            else:
                self._recover(exc, out)
            return
        self._failed_in_a_row = 0
        self.metrics.observe_step(len(seqs), self.engine.last_step)
        for seq in seqs:
            self._route(seq, out)

    def _recover(self, exc: Exception, out: list) -> None:
        """A step raised. The engine recomputes every running sequence and names the requests whose
        own code fails on its own (LLMEngine.recover_from_failed_step): those end with the error and
        the others go on. If none is named, or steps keep failing, every request in flight ends."""
        self._failed_in_a_row += 1
        error = EngineError(f"the engine failed: {type(exc).__name__}: {exc}")
        suspects = {seq.seq_id for seq in self.engine.recover_from_failed_step()}
        # a sequence may have finished inside the failed step before it raised: its end goes out now
        for handle in list(self._live.values()):
            for seq in handle.seqs:
                if seq.is_finished:
                    self._route(seq, out)
        culprits = [h for h in self._live.values() if any(s.seq_id in suspects for s in h.seqs)]
        if not culprits or self._failed_in_a_row > 1:
            culprits = list(self._live.values())
        logger.exception("engine step failed; ending %d of the %d requests in flight", len(culprits),
                         len(self._live))
        for handle in culprits:
            handle.held.clear()
            for seq in handle.seqs:
                if self.engine.abort_request(seq):
                    self.metrics.finished.labels("error").inc()
                self._tracker.forget(seq)
                self._owner.pop(seq.seq_id, None)
            self._live.pop(handle.request_id, None)
            out.append((handle, error))


    def _go_down(self, exc: Exception, out: list) -> None:
        """The engine cannot step again: every request ends with an EngineDownError, no new one is
        taken, and `on_fatal` (the server's shutdown) is called."""
        logger.error("the engine cannot go on: %s: %s", type(exc).__name__, exc)
        self.failure = exc
        self._shutting_down = True
        error = EngineDownError(f"the engine cannot go on: {exc}")
        for handle in list(self._live.values()):
            handle.held.clear()
            out.append((handle, error))
        self._live.clear()
        if self.on_fatal is not None:
            self.on_fatal()

    def _route(self, seq: Sequence, out: list) -> None:
        delta = self._tracker.delta(seq)
        handle = self._owner.get(seq.seq_id)
        if delta is None or handle is None:
            return
        self.metrics.observe_delta(delta)
        out.append((handle, delta))
        if seq.is_finished:
            del self._owner[seq.seq_id]
            if not handle.held and all(s.is_finished for s in handle.seqs):
                self._live.pop(handle.request_id, None)

    def _deliver(self, out: list) -> None:
        if out and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_put_all, out)
            except RuntimeError:  # the loop closed in between: nobody is listening any more
                pass


def _put_all(items: list) -> None:
    for handle, item in items:
        handle.queue.put_nowait(item)
