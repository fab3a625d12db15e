"""AsyncEngine: an ``LLMEngine`` driven by its own thread, fed and drained from asyncio code.

The engine thread owns the engine: nothing else calls into it. HTTP handlers (on the event loop)
send it commands through a thread-safe queue (add a request, abort one, stop), and it pushes each
request's ``RequestOutput`` deltas into that request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``, so an engine step never waits for HTTP and a slow client never
holds up a step. Between steps the thread applies every pending command; when the engine is idle
it blocks on the command queue.

``add_request`` returns once the engine thread has accepted the request: engine validation errors
(``ValueError`` naming the field) and ``QueueFullError`` are raised in the caller. ``abort`` is
fire-and-forget; the request's blocks are freed when the engine thread applies it, and its stream
receives a final output with ``finish_reason="abort"``.

``shutdown`` stops accepting requests, lets in-flight ones finish for up to ``drain_timeout``
seconds, aborts the rest (their streams end with ``abort``) and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from rlt_compile.engine.llm_engine import LLMEngine
from rlt_compile.engine.outputs import RequestOutput
from rlt_compile.engine.sampling_params import SamplingParams
from rlt_compile.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its thread died) and takes no new requests."""


class EngineStepError(RuntimeError):
    """An engine step raised; every request in flight at the time fails with this error."""


class RequestStream:
    """One engine request as seen from asyncio: its deltas arrive on ``queue`` as ``(index, item)``.

    Several streams may share one queue (a completion request with several prompts); ``index``
    tells them apart. ``item`` is a ``RequestOutput`` delta or an exception.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, out_queue: asyncio.Queue, index: int):
        self.request_id = request_id
        self.loop = loop
        self.queue = out_queue
        self.index = index
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished = False  # set on the event loop when the final output is consumed
        self.prompt_tokens = 0

    def _push(self, item) -> None:  # engine thread
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))


def _deliver(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    """Runs on the event loop: hand one step's outputs to their queues."""
    for out_queue, item in items:
        out_queue.put_nowait(item)


async def iterate_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(stream index, delta)`` from streams sharing one queue, until all have finished.

    An exception pushed by the engine (a failed step, shutdown) is raised here.
    """
    if not streams:
        return
    out_queue = streams[0].queue
    by_index = {s.index: s for s in streams}
    pending = sum(1 for s in streams if not s.finished)
    while pending:
        index, item = await out_queue.get()
        stream = by_index[index]
        if isinstance(item, BaseException):
            stream.finished = True
            raise item
        if item.finished and not stream.finished:
            stream.finished = True
            pending -= 1
        yield index, item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, idle_wait_s: float = 0.05):
        self.engine = engine
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._lock = threading.Lock()  # orders "add" commands against the thread's exit
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._submitted = 0  # "add" commands sent and not yet applied (under _lock)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="rlt-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished (including those the engine thread has not seen yet)."""
        return self._submitted + len(self._streams)

    @property
    def accepting(self) -> bool:
        return self._accepting and self._thread is not None and self.error is None

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop taking requests, wait up to ``drain_timeout`` s for in-flight ones, abort the rest.

        Safe to call more than once (later calls wait for the first to finish)."""
        self._accepting = False
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while self.is_running and self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._commands.put(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    def shutdown_sync(self, drain_timeout: float = 30.0) -> None:
        """``shutdown`` for code without an event loop."""
        self._accepting = False
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while self.is_running and self.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(30.0)

    # -- requests (event loop side) -------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        out_queue: asyncio.Queue | None = None,
        index: int = 0,
    ) -> RequestStream:
        """Queue a request; raises ValueError / QueueFullError / EngineStoppedError like the engine."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, out_queue if out_queue is not None else asyncio.Queue(), index)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.accepting:
                raise EngineStoppedError(
                    "the engine is shutting down" if self.is_running else "the engine is not running"
                )
            self._submitted += 1
            self._commands.put(("add", stream, prompt, params, priority, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away while the engine was accepting it
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once; unknown or finished ids are ignored)."""
        self._commands.put(("abort", request_id))

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request; aborts it if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for _, out in iterate_streams([stream]):
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if self._apply_commands(block=not engine.has_unfinished()):
                    break
                if engine.has_unfinished():
                    self._step()
                self.metrics.snapshot(engine)
        except BaseException as e:  # the thread must report, not vanish
            log.exception("engine thread died")
            self.error = e
            self._fail_all(EngineStoppedError(f"engine thread died: {e!r}"))
        finally:
            with self._lock:
                self._accepting = False
                self._reject_pending()

    def _apply_commands(self, block: bool) -> bool:
        """Apply pending commands (waiting a little for one when ``block``); True on "stop"."""
        try:
            command = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self.engine.abort_request(command[1])
            elif kind == "stop":
                self._stop()
                return True
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return False

    def _add(self, stream: RequestStream, prompt, params, priority, done: concurrent.futures.Future) -> None:
        try:
            if not done.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_request(stream.request_id, prompt, params, priority=priority)
            except Exception as e:
                done.set_exception(e)
                return
            stream.prompt_tokens = len(self.engine.requests[stream.request_id].prompt_token_ids)
            self._streams[stream.request_id] = stream
        finally:
            with self._lock:
                self._submitted -= 1
        self.metrics.request_received(stream.prompt_tokens)
        done.set_result(None)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing every request in flight")
            self._fail_all(EngineStepError(f"engine step failed: {e!r}"))
            return
        now = time.perf_counter()
        generated = 0
        # one wake-up per event loop per step (not one per request): fewer GIL hand-offs
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            new_tokens = sum(len(c.token_ids) for c in out.outputs)
            generated += new_tokens
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if new_tokens and stream.first_token_at is None:
                stream.first_token_at = now
                self.metrics.first_token(now - stream.arrival)
            deliveries.setdefault(stream.loop, []).append((stream.queue, (stream.index, out)))
            if out.finished:
                del self._streams[out.request_id]
                reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
                self.metrics.request_finished(reasons[0] if reasons else "stop", now - stream.arrival)
        self.metrics.step(now - start, generated)
        self.metrics.snapshot(self.engine)  # before delivery: a client that saw its end sees it in /metrics
        for loop, items in deliveries.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_deliver, items)

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)

    def _stop(self) -> None:
        """Abort what is left, deliver the final ``abort`` outputs, and end every stream."""
        self._accepting = False
        self._abort_all()
        try:
            while self.engine.has_unfinished():
                self._step()
        finally:
            self._fail_all(EngineStoppedError("the engine stopped"))
            self.metrics.snapshot(self.engine)

    def _fail_all(self, error: BaseException) -> None:
        """Send ``error`` to every open stream and drop every request from the engine."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._push(error)
        try:
            self._abort_all()
            if self.engine.has_unfinished():
                self.engine.step()  # flush the aborted outputs (nobody listens to them any more)
        except Exception:
            log.exception("could not clean up after a failed step")

    def _reject_pending(self) -> None:
        """Fail the add commands that arrived after the thread stopped."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._submitted -= 1  # the caller holds _lock
                done = command[-1]
                if done.set_running_or_notify_cancel():
                    done.set_exception(EngineStoppedError("the engine stopped"))
