"""The one thread that owns the Engine: requests come in from any thread, outputs go out to asyncio.

The engine is single-threaded by contract, so everything that touches it (add, abort, step, stats,
KV events) happens on this loop's thread. Callers hand work over through an inbox guarded by a
condition variable; the thread sleeps on it while the engine has nothing to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from contracts.kv_event_feed import DEFAULT_MAX_BATCHES, KvEventSubscription, snapshot_events
from contracts.kv_events import KvEvent
from rank_worker.engine.interface import (
    Engine,
    EngineRequest,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    RequestsFailedError,
)
from rank_worker.engine.step_trace import StepTrace, phase
from rank_worker.step_timing import StepTiming, StepTimingSummary

log = logging.getLogger(__name__)

# How often the per-request progress the Generate streams report is refreshed (on the engine thread).
PROGRESS_REFRESH_S = 0.5
SHUTDOWN_DRAIN_S = 3.0  # the longest a stopping loop steps to let in-flight work land (L1 calls: 1 s deadline)


@dataclass(frozen=True)
class RequestProgress:
    """Where a request stands, for a client that has had no token for a while (a long prefill, a queue)."""

    computed_prompt_tokens: int = 0
    queued: bool = True  # not yet admitted (or preempted back into the queue)


_QUEUED = RequestProgress()


class EngineFailedError(RuntimeError):
    """The engine raised while serving this request; the request is over, the loop keeps serving."""


class EngineLoopStoppedError(RuntimeError):
    """The loop is stopping or stopped: no new requests, and in-flight ones end."""


class RequestStream:
    """One request's outputs, pushed from the engine thread into the consumer's event loop.

    Iterate it with `async for`; iteration ends after the finished output, or raises the error that
    ended the request (EngineFailedError, EngineLoopStoppedError, InvalidRequestError).
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False  # consumer side: the last output (or an error) has been taken
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def _push(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: hand one item to the consumer's loop."""
        # RuntimeError: the consumer's event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return self._take(await self._queue.get())

    def ready(self) -> list[RequestOutput]:
        """Outputs already delivered, without waiting, so a slow consumer can send them as one message."""
        outputs: list[RequestOutput] = []
        while not self.finished and not self._queue.empty():
            outputs.append(self._take(self._queue.get_nowait()))
        return outputs

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On the consumers' event loop: one step's outputs into their streams' queues."""
    for stream, output in items:
        stream._queue.put_nowait(output)


class EngineLoop:
    """Owns an Engine on a dedicated thread; every public method is safe to call from any thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        failure_backoff_s: float = 0.05,
        timing_log_interval_s: float = 10.0,
        max_step_s: float = math.inf,
        kv_event_sink: Callable[[tuple[KvEvent, ...]], None] | None = None,
    ) -> None:
        self._engine = engine
        # Every batch of KV events also goes here, on the engine thread (vLLM-format KV events: a publisher
        # whose publish() only queues, contracts/vllm_kv_events.py); its STORED events then carry their tokens.
        self._kv_event_sink = kv_event_sink
        if kv_event_sink is not None:
            engine.record_stored_block_tokens()
        # An iteration running longer than this is a stuck engine thread: progress() stops answering, so the
        # clients' streams go quiet and fail over (a step may legitimately be long: a CPU prefill chunk).
        self._max_step_s = max_step_s
        self._iteration_started: float | None = None  # monotonic; set while an iteration does work
        self._progress: dict[str, RequestProgress] = {}  # replaced, never mutated, by the engine thread
        self._progress_at = 0.0
        self._timing = StepTiming()
        self._trace = StepTrace()  # KVSERVE_STEP_TRACE: a profiler timeline of some iterations (off by default)
        self._timing_log_interval_s = timing_log_interval_s
        self.last_step_timing: StepTimingSummary | None = None
        self._failure_backoff_s = failure_backoff_s
        self._cond = threading.Condition()
        # Guarded by _cond: the inbox, every live request's stream, the KV event subscribers.
        self._new: deque[tuple[EngineRequest, RequestStream]] = deque()
        self._aborts: deque[str] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._subscribers: list[KvEventSubscription] = []
        self._joining: list[KvEventSubscription] = []  # get a snapshot of the cache first, on the engine thread
        self._stopping = False
        self._kv_events_ended = False
        self._woken = False  # the engine asked to be stepped although idle (Engine.set_wakeup)
        # Engine thread only: requests the engine currently holds.
        self._in_engine: set[str] = set()
        self._stats = engine.stats()  # replaced (never mutated) by the engine thread after each iteration
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        engine.set_wakeup(self._wake)

    # ---- public, any thread ----

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: EngineRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue a request; raises InvalidRequestError here, in the caller, when the engine would refuse it.

        Outputs are delivered into `loop` (default: the running event loop)."""
        self._engine.validate(request)
        if request.arrival_time is None:
            request.arrival_time = time.monotonic()  # queue wait includes time spent in our inbox
        stream = RequestStream(request.request_id, loop or asyncio.get_running_loop())
        with self._cond:
            if self._stopping:
                raise EngineLoopStoppedError("engine loop is stopping")
            if request.request_id in self._streams:
                raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
            self._streams[request.request_id] = stream
            self._new.append((request, stream))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> bool:
        """Ask the engine to drop a request and free its blocks; False if it is not in flight."""
        with self._cond:
            if request_id not in self._streams:
                return False
            self._aborts.append(request_id)
            self._cond.notify()
        return True

    def queued(self) -> int:
        """Requests waiting for their first step: submitted but not yet in the engine, or in its queue."""
        with self._cond:
            return len(self._new) + self._stats.waiting

    def stats(self) -> EngineStats:
        """The engine's counters as of the end of the last loop iteration."""
        return dataclasses.replace(self._stats)

    def progress(self, request_id: str) -> RequestProgress | None:
        """The request's progress as of the last refresh; None while the engine thread is not making progress
        (an iteration stuck past max_step_s, or the thread gone), so a hang never looks like a long prefill."""
        started = self._iteration_started
        if not self._thread.is_alive() or (started is not None and time.monotonic() - started > self._max_step_s):
            return None
        return self._progress.get(request_id, _QUEUED)

    def in_flight(self) -> int:
        with self._cond:
            return len(self._streams)

    def subscribe_kv_events(
        self, loop: asyncio.AbstractEventLoop | None = None, max_batches: int = DEFAULT_MAX_BATCHES
    ) -> KvEventSubscription:
        """KV events delivered into `loop` (default: the running event loop): the cache's snapshot, then deltas."""
        subscription = KvEventSubscription(max_batches, self._unsubscribe, loop or asyncio.get_running_loop())
        with self._cond:
            if self._stopping or self._kv_events_ended:
                subscription.end()
            else:
                self._joining.append(subscription)
                self._cond.notify()
        return subscription

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort what is in flight, end every stream and subscription, and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.1fs (a step is still running)", timeout)

    def end_kv_event_subscriptions(self) -> None:
        """End every KV event stream now, and any opened later at once: a stopping server's subscribers (the
        router) would otherwise hold its shutdown grace period open, as would their reconnects."""
        with self._cond:
            self._kv_events_ended = True
            ended = self._subscribers + self._joining
            self._subscribers = []
            self._joining = []
        for subscription in ended:
            subscription.end()

    def _unsubscribe(self, subscription: KvEventSubscription) -> None:
        with self._cond:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)
            if subscription in self._joining:
                self._joining.remove(subscription)

    def _wake(self) -> None:
        """Any thread: the engine has something to poll although idle (an L1 answer, the kvstore gone)."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    # ---- engine thread ----

    def _run(self) -> None:
        busy = False  # the engine holds unfinished requests
        while True:
            with self._cond:
                while not (self._stopping or self._new or self._aborts or self._joining or busy or self._woken):
                    self._cond.wait()
                self._woken = False
                if self._stopping:
                    break
                iteration_started = time.perf_counter()
                self._iteration_started = time.monotonic()
                new = list(self._new)
                self._new.clear()
                aborts = list(self._aborts)
                self._aborts.clear()
            try:
                self._trace.tick()
                with phase("loop.add"):
                    self._add(new)
                    self._abort(aborts)  # after adds, so an abort racing its own submit still finds the request
                step_s = self._step() if self._must_step() else None
                with phase("loop.after"):
                    self._publish_kv_events()
                    self._stats = self._engine.stats()
                    busy = self._must_step()
                    self._refresh_progress()
                if step_s is not None:
                    self._record_timing(step_s, time.perf_counter() - iteration_started)
            except RequestsFailedError as exc:
                # One request's own failure (its sampling, its data) is that request's alone.
                log.error("engine step failed for %s; the other requests go on", exc.request_ids, exc_info=exc.cause)
                if not self._fail_requests(exc.request_ids, exc):
                    self._fail_in_engine(exc)  # named nobody we hold: it would recur on every step
                busy = self._safe_has_unfinished()
            except Exception as exc:
                log.exception("engine loop iteration failed; failing %d in-flight requests", len(self._in_engine))
                self._fail_in_engine(exc)
                busy = self._safe_has_unfinished()
                time.sleep(self._failure_backoff_s)  # a persistently broken engine must not spin and flood logs
            finally:
                self._iteration_started = None
        self._trace.close()
        self._shutdown()

    def _refresh_progress(self) -> None:
        now = time.monotonic()
        if now - self._progress_at < PROGRESS_REFRESH_S:
            return
        self._progress_at = now
        progress: dict[str, RequestProgress] = {}
        for request_id in self._in_engine:
            state = self._engine.request_progress(request_id)
            if state is not None:
                progress[request_id] = RequestProgress(*state)
        self._progress = progress

    def _add(self, new: list[tuple[EngineRequest, RequestStream]]) -> None:
        for request, stream in new:
            try:
                self._engine.add_request(request)
            except InvalidRequestError as exc:  # validate() passed, but add_request knows more (e.g. pool size)
                self._end(request.request_id, stream, exc)
                continue
            except Exception as exc:
                log.exception("engine.add_request(%s) failed", request.request_id)
                self._end(request.request_id, stream, EngineFailedError(f"engine failed to add the request: {exc!r}"))
                continue
            self._in_engine.add(request.request_id)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id not in self._in_engine:
                continue  # finished (or failed) before the abort got here
            try:
                output = self._engine.abort_request(request_id)
            except Exception as exc:
                log.exception("engine.abort_request(%s) failed", request_id)
                with self._cond:
                    stream = self._streams.get(request_id)
                if stream is not None:
                    self._end(request_id, stream, EngineFailedError(f"engine failed to abort the request: {exc!r}"))
                continue
            if output is None:
                output = RequestOutput(request_id, [], finished=True, finish_reason=FinishReason.ABORT)
            self._stats = self._engine.stats()
            self._deliver([output])

    def _step(self) -> float:
        """Step the engine and deliver its outputs; returns the step's own duration."""
        started = time.perf_counter()
        with phase("engine.step"):
            outputs = self._engine.step()
        step_s = time.perf_counter() - started
        with phase("loop.deliver"):
            # Refresh the snapshot before anyone hears of this step, so a client that saw its request finish
            # never reads stats from before it.
            self._stats = self._engine.stats()
            self._deliver(outputs)
        return step_s

    def _record_timing(self, step_s: float, iteration_s: float) -> None:
        computed, prefill = self._engine.last_step_tokens()
        if computed == 0:
            return  # a step that only finished copies: not a model step
        self._timing.record(step_s, iteration_s, computed, prefill, self._engine.last_step_gpu_s())
        if self._timing.elapsed() >= self._timing_log_interval_s:
            self.last_step_timing = self._timing.take()
            log.info("engine loop: %s", self.last_step_timing.describe())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One hand-over per consumer event loop per step, not one per output: call_soon_threadsafe wakes the
        # loop through its self-pipe each time, and a decode step of 128 rows made 128 of those syscalls on
        # the engine thread, between two steps.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with self._cond:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                by_loop.setdefault(stream._loop, []).append((stream, output))
                if output.finished:
                    del self._streams[output.request_id]
                    self._in_engine.discard(output.request_id)
        for loop, items in by_loop.items():
            # RuntimeError: the consumers' event loop is closed, nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)

    def _end(self, request_id: str, stream: RequestStream, error: BaseException) -> None:
        with self._cond:
            self._streams.pop(request_id, None)
        self._in_engine.discard(request_id)
        stream._push(error)

    def _publish_kv_events(self, subscribers: list[KvEventSubscription] | None = None) -> None:
        events = tuple(self._engine.drain_kv_events())
        with self._cond:
            joining, self._joining = self._joining, []
            if subscribers is None:
                subscribers = list(self._subscribers)
            self._subscribers.extend(joining)
        if events:
            for subscription in subscribers:
                subscription.publish(events)
            if self._kv_event_sink is not None:
                try:
                    self._kv_event_sink(events)
                except Exception:
                    log.exception("publishing KV events in vLLM's format failed")
        if joining:
            # A late subscriber (a restarted router) learns the whole cache first; later batches are deltas
            # from that state.
            snapshot = snapshot_events(self._engine.cached_block_hashes())
            for subscription in joining:
                subscription.publish(snapshot)

    def _fail_requests(self, request_ids: list[str], cause: RequestsFailedError) -> bool:
        """Abort and fail just these requests; False if none of them was in the engine."""
        failed = [request_id for request_id in request_ids if request_id in self._in_engine]
        for request_id in failed:
            try:
                self._engine.abort_request(request_id)
            except Exception:
                log.exception("engine.abort_request(%s) failed after its own failure", request_id)
            with self._cond:
                stream = self._streams.get(request_id)
            if stream is not None:
                self._end(request_id, stream, EngineFailedError(f"the request failed: {cause.cause!r}"))
            self._in_engine.discard(request_id)
        try:
            self._publish_kv_events()
            self._stats = self._engine.stats()
        except Exception:
            log.exception("engine bookkeeping failed after a request's failure")
        return bool(failed)

    def _fail_in_engine(self, cause: Exception) -> None:
        for request_id in list(self._in_engine):
            try:
                self._engine.abort_request(request_id)  # free its blocks if the engine still can
            except Exception:
                log.exception("engine.abort_request(%s) failed after an engine error", request_id)
            with self._cond:
                stream = self._streams.get(request_id)
            if stream is not None:
                self._end(request_id, stream, EngineFailedError(f"engine failed: {cause!r}"))
            self._in_engine.discard(request_id)
        try:
            self._stats = self._engine.stats()
        except Exception:
            log.exception("engine.stats() failed")

    def _must_step(self) -> bool:
        """Work of the engine's own, or an expert-parallel group stepping that needs this rank in its steps."""
        return self._engine.has_unfinished() or self._engine.wants_step()

    def _safe_has_unfinished(self) -> bool:
        try:
            return self._must_step()
        except Exception:
            log.exception("engine.has_unfinished() failed; idling until new work arrives")
            return False

    def _drain(self) -> None:
        """After the last aborts: step until what is still in flight has landed (a pipelined step whose blocks go
        back once it is read, L1 copies and calls), nothing new being admitted; a hung kvstore is waited for no
        longer than its calls' deadline and a little."""
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S
        while self._engine.has_unfinished() and time.monotonic() < deadline:
            self._engine.step()

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._new)
            self._new.clear()
            subscribers = list(self._subscribers)
            self._subscribers.clear()
        for request, stream in pending:
            self._end(request.request_id, stream, EngineLoopStoppedError("the rank worker is shutting down"))
        try:
            self._abort(list(self._in_engine))
            self._drain()
            self._publish_kv_events(subscribers)
            self._stats = self._engine.stats()
        except Exception:
            log.exception("engine failed while stopping")
            self._fail_in_engine(EngineLoopStoppedError("the rank worker is shutting down"))
        for subscription in subscribers:
            subscription.end()
