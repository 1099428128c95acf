"""The L1 tier's kvstore calls, made on a thread of their own so that a slow or hung kvstore never stalls
the engine thread (as vLLM's KV connector: the scheduler decides, a worker talks to the store).

The engine thread submits calls and goes on stepping; the worker makes them in order and posts each
finished call, with its answer or error, to the tier's Mailbox, which the engine thread drains between
steps without waiting. Every call belongs to an attach epoch: once a call of an epoch fails, the calls of
that epoch still queued fail at once instead of each waiting out its deadline on a dead kvstore.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from rank_worker.l1.kvstore_client import KvStoreClient, L1UnavailableError

log = logging.getLogger(__name__)


class CallKind(enum.Enum):
    LOOKUP = "lookup"
    ALLOCATE = "allocate"
    RESERVE = "reserve"
    COMMIT = "commit"
    RELEASE = "release"


@dataclass(eq=False)
class L1Call:
    kind: CallKind
    epoch: int
    arena_id: str
    hashes: list[bytes] = field(default_factory=list)  # lookup, allocate; commit: the blocks of reserved slots
    slots: list[int] = field(default_factory=list)  # commit, release
    purpose: object = None  # what the tier does with the answer (a HostFetch, an offload)
    answer: list[int] = field(default_factory=list)
    error: BaseException | None = None
    restored: bool = False  # release: the slots' blocks were copied into the pool
    gpu_holds: bool = False  # commit: written through, the pool still holds the blocks
    count: int = 0  # reserve: how many slots


class Mailbox:
    """What the tier's threads hand to the engine thread: finished calls, kvstore news, attach results.
    post() wakes the engine (it may be idle), take() never waits, wait() does only when told to."""

    def __init__(self) -> None:
        self._items: collections.deque[object] = collections.deque()
        self._cond = threading.Condition()
        self.wake: Callable[[], None] = lambda: None  # set by the engine's owner (EngineLoop)

    def post(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
        self.wake()

    def take(self) -> list[object]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
        return items

    def __bool__(self) -> bool:
        return bool(self._items)

    def wait(self, timeout_s: float) -> None:
        """Block until something is posted or timeout_s passes (only when the engine has nothing to run)."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout_s)


class L1Calls:
    """One worker thread making the tier's kvstore calls in submission order."""

    def __init__(self, client: KvStoreClient, mailbox: Mailbox) -> None:
        self.client = client
        self._mailbox = mailbox
        self._queue: collections.deque[L1Call | None] = collections.deque()
        self._cond = threading.Condition()
        self._failed_epoch = -1  # worker thread only
        self._thread = threading.Thread(target=self._run, name="l1-calls", daemon=True)
        self._thread.start()

    def submit(self, call: L1Call) -> None:
        with self._cond:
            self._queue.append(call)
            self._cond.notify()

    def close(self) -> None:
        """Stop after the calls already queued (each bounded by its deadline)."""
        with self._cond:
            self._queue.append(None)
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                call = self._queue.popleft()
            if call is None:
                return
            self._make(call)
            self._mailbox.post(call)

    def _make(self, call: L1Call) -> None:
        if call.epoch <= self._failed_epoch:
            call.error = L1UnavailableError("an earlier call of this attach failed")
            return
        try:
            if call.kind is CallKind.LOOKUP:
                call.answer = self.client.lookup(call.arena_id, call.hashes)
            elif call.kind is CallKind.ALLOCATE:
                call.answer = self.client.allocate(call.arena_id, call.hashes)
            elif call.kind is CallKind.RESERVE:
                call.answer = self.client.reserve(call.arena_id, call.count)
            elif call.kind is CallKind.COMMIT:
                self.client.commit(
                    call.arena_id, call.slots, gpu_holds=call.gpu_holds, block_hashes=call.hashes or None
                )
            else:
                self.client.release(call.arena_id, call.slots, restored=call.restored)
        except Exception as exc:  # L1StaleArenaError, L1UnavailableError, or a bug: L1 goes down, serving goes on
            call.error = exc
            self._failed_epoch = max(self._failed_epoch, call.epoch)
