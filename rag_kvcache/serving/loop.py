"""The engine loop: one thread owns the batch decoder (so the model and the prefix tree) and
drives `step()` while there is work; callers in any thread or event loop talk to it through
queues.

A caller `submit`s a request with a *sink*, a function the loop thread calls with each of
the request's `StepOutput`s (a token and its text, then the finished record or an error). The
loop takes new requests and aborts between decode steps, so requests arriving from many
callers join the running batch (continuous batching) and share its linked prefixes. With no
work the thread blocks on a condition; it never spins.

`AsyncTokenStream` is the asyncio front end: its sink hands outputs to the caller's event
loop (`call_soon_threadsafe`), and closing the stream or cancelling the task awaiting it
aborts the request, so its references into the tree go and its KV can be evicted.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import threading
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from rag_kvcache.config import GenerationConfig
from rag_kvcache.errors import EngineClosedError, RagKVCacheError
from rag_kvcache.serving.batch import BatchDecoder, Finished, StepOutput
from rag_kvcache.strategy import Strategy

Sink = Callable[[StepOutput], None]
R = TypeVar("R")
EXIT_WAIT_S = 5.0  # at interpreter exit, how long a running loop's step is waited for
_RUNNING: weakref.WeakSet[EngineLoop] = weakref.WeakSet()  # closed at exit (`_close_running`)


@dataclass(frozen=True)
class LoopRequest:
    """A request as the decoder takes it: cache IDs of its context in linked order (system
    prefix first), its question's token ids, how to generate, how to link."""

    path: tuple[str, ...]
    question: tuple[int, ...]
    config: GenerationConfig
    strategy: Strategy


@dataclass(frozen=True)
class _Add:
    ticket: int
    request: LoopRequest
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    ticket: int


def _close_running() -> None:
    """At interpreter exit, stop the loops still running (an engine never closed): a daemon
    thread left in place while the interpreter is torn down aborted the process now and then
    ("terminate called without an active exception", exit code 134) after asyncio use."""
    for loop in list(_RUNNING):
        loop.close(timeout=EXIT_WAIT_S)


class EngineLoop:
    """Runs `decoder` on a daemon thread. `submit` / `abort` / `close` are thread-safe.

    `lock` is held while the thread touches the decoder (a step, an admission, an abort):
    whoever else must use the same prefix tree (`RagKVCache.generate_batch`) takes it too.
    """

    def __init__(self, decoder: BatchDecoder, lock: threading.Lock | None = None):
        self.decoder = decoder
        self._lock = lock or threading.Lock()
        self._wake = threading.Condition()
        self._inbox: deque[_Add | _Abort] = deque()
        self._tickets = itertools.count()
        self._request_of: dict[int, int] = {}  # ticket -> the decoder's request ID
        self._sinks: dict[int, tuple[int, Sink]] = {}  # request ID -> (ticket, sink)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rag-kvcache-loop", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def submit(self, request: LoopRequest, sink: Sink) -> int:
        """Queue a request; returns its ticket (for `abort`). `sink` is called on the loop
        thread with each output; it must be quick and must not raise."""
        with self._wake:
            if self._closed:
                raise EngineClosedError("the engine is closed; open a new one to answer")
            ticket = next(self._tickets)
            self._inbox.append(_Add(ticket, request, sink))
            self._wake.notify()
        return ticket

    def abort(self, ticket: int) -> None:
        """Drop a request (waiting or decoding); nothing more reaches its sink. A finished
        or unknown ticket is ignored."""
        with self._wake:
            self._inbox.append(_Abort(ticket))
            self._wake.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread; requests still in flight get an EngineClosedError. `timeout`:
        wait at most this long for a step in progress (at exit: then left as it was)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        _RUNNING.discard(self)

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self.decoder.has_work or self._closed):
                    self._wake.wait()
                if self._closed:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            with self._lock:
                for command in commands:
                    self._apply(command)
                if self.decoder.has_work:
                    self._step()
        with self._wake:
            commands = list(self._inbox)
            self._inbox.clear()
        with self._lock:
            closed = EngineClosedError("the engine was closed before this request finished")
            for command in commands:
                if isinstance(command, _Add):
                    _deliver(command.sink, StepOutput(-1, None, "", True, error=closed))
            self._fail_all(closed)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            request_id = self._request_of.pop(command.ticket, None)
            if request_id is not None:
                self._sinks.pop(request_id, None)
                self.decoder.abort(request_id)
            return
        r = command.request
        try:
            request_id = self.decoder.add_request(
                list(r.path), list(r.question), r.config, r.strategy
            )
        except RagKVCacheError as error:
            _deliver(command.sink, StepOutput(-1, None, "", True, error=error))
            return
        self._request_of[command.ticket] = request_id
        self._sinks[request_id] = (command.ticket, command.sink)

    def _step(self) -> None:
        """One decoder step, each output handed to its caller as soon as it exists (a newly
        linked request's first token does not wait for the others admitted with it)."""
        gone: list[int] = []  # tickets nobody listens to any more: aborted after the step

        def deliver(out: StepOutput) -> None:
            ticket, sink = self._sinks[out.request_id]
            if out.finished:
                del self._sinks[out.request_id]
                del self._request_of[ticket]
            if not _deliver(sink, out) and not out.finished:
                gone.append(ticket)

        try:
            self.decoder.step(deliver)
        except Exception as error:  # a bug, not one request's fault: fail every request
            self._fail_all(error)
            return
        for ticket in gone:
            self._apply(_Abort(ticket))

    def _fail_all(self, error: Exception) -> None:
        """Hand `error` to every request in flight and drop them from the decoder."""
        sinks, self._sinks, self._request_of = self._sinks, {}, {}
        for request_id, (_, sink) in sinks.items():
            self.decoder.abort(request_id)
            _deliver(sink, StepOutput(request_id, None, "", True, error=error))


def _deliver(sink: Sink, out: StepOutput) -> bool:
    """Hand `out` to a caller; False if the caller's event loop is closed (it left)."""
    try:
        sink(out)
    except RuntimeError:  # asyncio: "Event loop is closed"
        return False
    return True


class AsyncTokenStream(Generic[R]):
    """One request's text pieces as an async iterator (`async for piece in stream`); once
    exhausted, `result` is `finish` of its finished record. The request is submitted when
    iteration starts; cancelling the task iterating it, or `aclose()`, aborts it."""

    def __init__(
        self, loop: EngineLoop, request: LoopRequest, finish: Callable[[Finished], R]
    ) -> None:
        self.result: R | None = None
        self._loop, self._request, self._finish = loop, request, finish
        self._pieces = self._run()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._pieces

    async def aclose(self) -> None:
        await self._pieces.aclose()

    async def finish(self) -> R:
        """Run the request to its end (the pieces not yet read are dropped); its result
        (as `AnswerStream.finish` does for `generate`)."""
        async for _ in self._pieces:
            pass
        assert self.result is not None
        return self.result

    async def _run(self) -> AsyncGenerator[str, None]:
        events = asyncio.get_running_loop()
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()

        def sink(out: StepOutput) -> None:  # on the loop thread
            events.call_soon_threadsafe(queue.put_nowait, out)

        ticket = self._loop.submit(self._request, sink)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                if out.error is not None:
                    raise out.error
                if out.done is not None:
                    self.result = self._finish(out.done)
                if out.text:
                    yield out.text
        finally:
            if not finished:
                self._loop.abort(ticket)


atexit.register(_close_running)
