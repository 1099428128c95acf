"""The KV event feed (the kvstore's; a rank's subscriptions are the same class): per-subscriber sequences,
a snapshot first for late subscribers, bounded queues."""

from __future__ import annotations

import asyncio

import pytest

from contracts.block_hash import BLOCK_HASH_BYTES
from contracts.kv_event_feed import KvEventFeed, KvEventsEndedError
from contracts.kv_events import KvEvent, KvEventKind


def h(n: int) -> bytes:
    return n.to_bytes(BLOCK_HASH_BYTES, "big")


def stored(*ids: int) -> KvEvent:
    return KvEvent(KvEventKind.STORED, tuple(h(i) for i in ids))


def test_snapshot_first_then_deltas_with_per_subscriber_sequences() -> None:
    async def scenario() -> None:
        held = [h(1)]
        feed = KvEventFeed(lambda: list(held))
        early = feed.subscribe()
        feed.publish([stored(2)])
        held.append(h(2))
        late = feed.subscribe()
        feed.publish([KvEvent(KvEventKind.REMOVED, (h(1),))])

        first = await early.get()
        assert first.sequence == 1
        assert first.events == (KvEvent(KvEventKind.ALL_CLEARED), stored(1))
        assert (await early.get()).events == (stored(2),)
        assert (await early.get()).sequence == 3

        snapshot = await late.get()
        assert snapshot.sequence == 1
        assert snapshot.events == (KvEvent(KvEventKind.ALL_CLEARED), stored(1, 2))
        delta = await late.get()
        assert delta.sequence == 2 and delta.events == (KvEvent(KvEventKind.REMOVED, (h(1),)),)

    asyncio.run(scenario())


def test_empty_publish_sends_nothing() -> None:
    async def scenario() -> None:
        feed = KvEventFeed(list)
        subscription = feed.subscribe()
        feed.publish([])
        feed.publish([stored(1)])
        await subscription.get()
        assert (await subscription.get()).sequence == 2

    asyncio.run(scenario())


def test_a_slow_subscriber_loses_batches_and_sees_the_gap() -> None:
    async def scenario() -> None:
        feed = KvEventFeed(list, max_batches=2)
        subscription = feed.subscribe()  # the snapshot takes one place
        for i in range(4):
            feed.publish([stored(i)])
        assert subscription.dropped_batches == 3
        assert (await subscription.get()).sequence == 1
        assert (await subscription.get()).sequence == 2
        feed.publish([stored(9)])
        assert (await subscription.get()).sequence == 6  # 3, 4 and 5 were lost

    asyncio.run(scenario())


def test_close_ends_every_subscription_and_later_ones() -> None:
    async def scenario() -> None:
        feed = KvEventFeed(list, max_batches=1)
        subscription = feed.subscribe()  # its queue is full: the end marker still gets through
        feed.close()
        with pytest.raises(KvEventsEndedError):
            await subscription.get()
        with pytest.raises(KvEventsEndedError):
            await subscription.get()
        with pytest.raises(KvEventsEndedError):
            await feed.subscribe().get()
        assert feed.subscriber_count == 0

    asyncio.run(scenario())


def test_a_closed_subscription_gets_nothing_more() -> None:
    async def scenario() -> None:
        feed = KvEventFeed(list)
        subscription = feed.subscribe()
        subscription.close()
        assert feed.subscriber_count == 0
        live = feed.subscribe()
        feed.publish([stored(1)])
        await live.get()  # its snapshot
        assert (await live.get()).events == (stored(1),), "the batch went out, to the subscribers still there"
        await subscription.get()  # the snapshot
        assert subscription.queued == 0, "nothing after the close"

    asyncio.run(scenario())
