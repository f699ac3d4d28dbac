"""The async engine: one thread owns the `LLMEngine` and steps it while any request is running or
waiting. Requests arrive from the event loop at any time, from any number of connections, and join
the running batch at the next step (continuous batching). Each step's deltas are routed to the
requests' asyncio queues with `loop.call_soon_threadsafe`, so the HTTP side never touches the
engine or a tensor, and stays responsive while a step runs (torch releases the GIL in its ops).

Thread ownership: everything on `self.engine` is read and written by the engine thread only. The
event loop hands it work through `_inbox` / `_aborts` under a lock and wakes it with an event;
an idle engine thread sleeps on that event (no busy-spin).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Union

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
    """Owns `llm.engine` from a background thread. `max_waiting` bounds the sequences that wait
    for a place in the running batch (beyond it `add` raises QueueFullError)."""

    def __init__(self, llm, max_waiting: int = 256):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"AsyncEngine: 'max_waiting' must be a positive int, got {max_waiting!r}")
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.num_layers = llm.model.num_layers
        self.max_waiting = max_waiting
        self.metrics = ServerMetrics(self.engine.blocks.num_blocks, self.num_layers)
        self._tracker = DeltaTracker(self.engine)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[RequestHandle] = []
        self._aborts: list[RequestHandle] = []
        self._live: dict[int, RequestHandle] = {}          # engine thread only
        self._owner: dict[int, RequestHandle] = {}         # seq_id -> handle, engine thread only
        self._num_inbox_seqs = 0
        self._failed_in_a_row = 0                          # engine thread only
        self._shutting_down = False
        self._stop = False
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
        return self._num_inbox_seqs + len(self.engine.scheduler.waiting)

    def add(self, subrequests: list[SubRequest]) -> RequestHandle:
        """Queues one request's sequences; they join the batch at the next step."""
        if self._shutting_down:
            raise ShuttingDownError("the server is shutting down")
        if self._thread is None:
            raise RuntimeError("AsyncEngine: start() it first")
        waiting = self.num_waiting
        if waiting + len(subrequests) > self.max_waiting:
            self.metrics.rejected_overload.inc()
            raise QueueFullError(f"the server is overloaded: {waiting} sequences are waiting and this request adds "
                                 f"{len(subrequests)}, past --max-waiting-requests {self.max_waiting}; retry later")
        handle = RequestHandle(subrequests, asyncio.Queue())
        with self._lock:
            self._inbox.append(handle)
            self._num_inbox_seqs += len(subrequests)
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
                self._num_inbox_seqs = 0
            out: list[tuple[RequestHandle, object]] = []
            for handle in adds:
                self._admit(handle)
            for handle in aborts:
                self._abort(handle, out)
            if self._shutting_down or stop:
                for handle in list(self._live.values()):
                    self._abort(handle, out)
            if self._live and not stop:
                self._step(out)
            self._deliver(out)
            self.metrics.update_engine(self.engine, self.num_waiting)
            if stop:
                return
            if not self._live:
                self._wake.wait()

    def _admit(self, handle: RequestHandle) -> None:
        if handle.aborted:
            return
        for sub in handle.subrequests:
            seq = self.engine.enqueue(sub.prompt, sub.token_ids, sub.params, sub.index)
            handle.seqs.append(seq)
            self._owner[seq.seq_id] = handle
        self._live[handle.request_id] = handle

    def _abort(self, handle: RequestHandle, out: list) -> None:
        for seq in handle.seqs:
            if self.engine.abort_request(seq):
                self._route(seq, out)
        self._live.pop(handle.request_id, None)

    def _step(self, out: list) -> None:
        try:
            seqs = self.engine.step()
        except Exception as exc:  # one request's failure must not take the others (or the server) down
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
            for seq in handle.seqs:
                if self.engine.abort_request(seq):
                    self.metrics.finished.labels("error").inc()
                self._tracker.forget(seq)
                self._owner.pop(seq.seq_id, None)
            self._live.pop(handle.request_id, None)
            out.append((handle, error))


    def _route(self, seq: Sequence, out: list) -> None:
        delta = self._tracker.delta(seq)
        handle = self._owner.get(seq.seq_id)
        if delta is None or handle is None:
            return
        self.metrics.observe_delta(delta)
        out.append((handle, delta))
        if seq.is_finished:
            del self._owner[seq.seq_id]
            if all(s.is_finished for s in handle.seqs):
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
