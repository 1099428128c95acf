"""KV events fanned out to subscribers, with the rules every publisher keeps (a rank for its L0, the kvstore
for L1, and the tests' stand-ins for either).

Each subscriber has its own sequence numbers, starting at 1 and increasing by one per batch; its first batch
is a snapshot (ALL_CLEARED, then STORED with every stored hash), later ones are deltas. A subscriber that
falls behind loses batches (it sees the gap and resubscribes) rather than growing the publisher's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence

from contracts.kv_events import KvEvent, KvEventBatch, KvEventKind

DEFAULT_MAX_BATCHES = 10_000


class KvEventsEndedError(RuntimeError):
    """The publisher is stopping: no more batches."""


def snapshot_events(block_hashes: Iterable[bytes]) -> tuple[KvEvent, ...]:
    """A subscription's first batch: forget what you knew of this publisher, then everything it holds now."""
    return (KvEvent(KvEventKind.ALL_CLEARED), KvEvent(KvEventKind.STORED, tuple(block_hashes)))


class KvEventSubscription:
    """One subscriber's bounded queue of batches, read with get() on the subscriber's event loop.

    The publisher calls publish() and end() on that loop, or, when `loop` is given, from any one thread of
    its own (a rank's engine thread): batches are numbered there and handed over to `loop` in order."""

    def __init__(
        self,
        max_batches: int,
        on_close: Callable[[KvEventSubscription], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.dropped_batches = 0
        self._on_close = on_close
        self._loop = loop
        self._queue: asyncio.Queue[KvEventBatch | None] = asyncio.Queue(max_batches)
        self._next_sequence = 1  # the publisher's side

    def publish(self, events: tuple[KvEvent, ...]) -> None:
        """The next batch (numbered even when it is dropped: that is how the subscriber sees the gap)."""
        batch = KvEventBatch(self._next_sequence, events)
        self._next_sequence += 1
        self._hand_over(self._offer, batch)

    def end(self) -> None:
        """No more batches: get() raises KvEventsEndedError once the queued ones are read."""
        self._hand_over(self._offer_end)

    def _hand_over(self, callback: Callable[..., object], *args: object) -> None:
        if self._loop is None:
            callback(*args)
            return
        with contextlib.suppress(RuntimeError):  # the subscriber's loop is closed
            self._loop.call_soon_threadsafe(callback, *args)

    def _offer(self, batch: KvEventBatch) -> None:
        if self._queue.full():
            self.dropped_batches += 1
        else:
            self._queue.put_nowait(batch)

    def _offer_end(self) -> None:
        if self._queue.full():
            self._queue.get_nowait()  # the end marker must get through; the subscriber sees the gap
        self._queue.put_nowait(None)

    async def get(self) -> KvEventBatch:
        """The next batch; KvEventsEndedError once the publisher has ended the subscription."""
        batch = await self._queue.get()
        if batch is None:
            self._queue.put_nowait(None)  # keep raising on later calls
            raise KvEventsEndedError("the publisher of these KV events is stopping")
        return batch

    @property
    def queued(self) -> int:
        """Batches handed over and not yet read."""
        return self._queue.qsize()

    def close(self) -> None:
        """The subscriber is gone: the publisher forgets it."""
        self._on_close(self)


class KvEventFeed:
    """Publishes batches of events to every subscriber, all on one event loop (so a snapshot and the deltas
    after it cannot interleave with a change); `snapshot` lists the stored hashes right now."""

    def __init__(self, snapshot: Callable[[], list[bytes]], max_batches: int = DEFAULT_MAX_BATCHES) -> None:
        self._snapshot = snapshot
        self._max_batches = max_batches
        self._subscribers: set[KvEventSubscription] = set()
        self._closed = False

    def publish(self, events: Sequence[KvEvent]) -> None:
        """One batch of events to every subscriber (nothing when there are no events)."""
        if events:
            batch = tuple(events)
            for subscription in self._subscribers:
                subscription.publish(batch)

    def subscribe(self) -> KvEventSubscription:
        """A new subscription whose first batch is the snapshot of what is stored now."""
        subscription = KvEventSubscription(self._max_batches, self._subscribers.discard)
        if self._closed:
            subscription.end()
            return subscription
        subscription.publish(snapshot_events(self._snapshot()))
        self._subscribers.add(subscription)
        return subscription

    def close(self) -> None:
        """End every subscription (the publisher is stopping), and any opened later at once."""
        self._closed = True
        for subscription in self._subscribers:
            subscription.end()
        self._subscribers.clear()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)
