"""KV events of the L1 tier, fanned out to subscribers (the router) with the same rules as a rank's.

Each subscriber has its own sequence numbers, starting at 1 and increasing by one per batch; its first
batch is a snapshot (ALL_CLEARED, then STORED with every stored hash), later ones are deltas. A
subscriber that falls behind loses batches (it sees the gap and resubscribes) rather than growing the
kvstore's memory. Everything runs on one asyncio event loop, so a snapshot and the deltas after it
cannot interleave with a change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from contracts.kv_events import KvEvent, KvEventBatch, KvEventKind

DEFAULT_MAX_BATCHES = 10_000


class FeedClosedError(RuntimeError):
    """The kvstore is stopping: no more batches."""


class KvEventSubscription:
    def __init__(self, feed: KvEventFeed, max_batches: int) -> None:
        self.dropped_batches = 0
        self._feed = feed
        self._queue: asyncio.Queue[KvEventBatch | None] = asyncio.Queue(max_batches)
        self._next_sequence = 1

    def _publish(self, events: tuple[KvEvent, ...]) -> None:
        batch = KvEventBatch(self._next_sequence, events)
        self._next_sequence += 1  # also for a dropped batch: that is how the subscriber sees the gap
        if self._queue.full():
            self.dropped_batches += 1
        else:
            self._queue.put_nowait(batch)

    def _end(self) -> None:
        if self._queue.full():
            self._queue.get_nowait()  # the end marker must get through; the subscriber sees the gap
        self._queue.put_nowait(None)

    async def get(self) -> KvEventBatch:
        """The next batch; FeedClosedError once the feed is closed."""
        batch = await self._queue.get()
        if batch is None:
            self._queue.put_nowait(None)  # keep raising on later calls
            raise FeedClosedError("the kvstore is stopping")
        return batch

    def close(self) -> None:
        self._feed._subscribers.discard(self)


class KvEventFeed:
    """Publishes batches of events to every subscriber; `snapshot` lists the stored hashes right now."""

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
                subscription._publish(batch)

    def subscribe(self) -> KvEventSubscription:
        """A new subscription whose first batch is the snapshot of the tier as it is now."""
        subscription = KvEventSubscription(self, self._max_batches)
        if self._closed:
            subscription._end()
            return subscription
        subscription._publish((KvEvent(KvEventKind.ALL_CLEARED), KvEvent(KvEventKind.STORED, tuple(self._snapshot()))))
        self._subscribers.add(subscription)
        return subscription

    def close(self) -> None:
        """End every subscription (the kvstore is stopping)."""
        self._closed = True
        for subscription in self._subscribers:
            subscription._end()
        self._subscribers.clear()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)
