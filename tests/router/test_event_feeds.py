"""KV event feeds over real gRPC against a test double of the publisher: snapshot then deltas, a sequence
gap resubscribes, a short outage reconnects, a long one marks the rank down; the kvstore feed fills L1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from router_event_source import KvEventSource
from router_prompts import lookup_hashes, prompt_tokens
from service_processes import free_port

from router.event_feeds import EventFeeds
from router.rank_registry import RankIdentity, RankLoad
from router.route_score import RoutePolicy
from router.router_state import RouterState

DOWN_AFTER_S = 0.8


@pytest.fixture
def source() -> Iterator[KvEventSource]:
    source = KvEventSource(free_port()).start()
    try:
        yield source
    finally:
        source.stop()


def blocks(count: int, conversation: int = 1) -> list[bytes]:
    return lookup_hashes(prompt_tokens(conversation, count * 16 + 1))


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not true after {timeout_s}s")
        await asyncio.sleep(0.02)


def new_state() -> tuple[RouterState, EventFeeds]:
    state = RouterState(RoutePolicy(0.05, 10_000), session_ttl_s=60, rank_down_after_s=DOWN_AFTER_S)
    feeds = EventFeeds(state, DOWN_AFTER_S)
    state.follower = feeds
    return state, feeds


def register(state: RouterState, source: KvEventSource, incarnation: str = "i1") -> None:
    state.register_rank(RankIdentity("r", source.address, incarnation, 16, b""), RankLoad())


def test_snapshot_then_deltas_then_gap_resubscribes(source: KvEventSource) -> None:
    prompt = blocks(12)
    source.store(prompt[:4])

    async def scenario() -> None:
        state, feeds = new_state()
        register(state, source)
        await wait_until(lambda: state.index.l0_blocks("r") == 4, 5, "snapshot applied")
        source.store(prompt[4:10])
        await wait_until(lambda: state.index.l0_blocks("r") == 10, 5, "delta applied")
        source.remove(prompt[8:10])
        await wait_until(lambda: state.index.l0_blocks("r") == 8, 5, "removal applied")
        assert state.index.match(prompt, ["r"])["r"].l0_blocks == 8

        source.skip_a_sequence_number()
        source.store(prompt[10:12])  # arrives with a gap: dropped, then the resubscription's snapshot has it
        await wait_until(lambda: source.subscriptions == 2, 5, "resubscribed after the gap")
        await wait_until(lambda: state.index.l0_blocks("r") == 10, 5, "snapshot after the gap")
        assert state.registry.healthy(), "a gap is not an outage"
        await feeds.close()

    asyncio.run(scenario())


def test_short_outage_reconnects_and_the_new_snapshot_replaces_the_old(source: KvEventSource) -> None:
    source.store(blocks(5))

    async def scenario() -> None:
        state, feeds = new_state()
        register(state, source)
        await wait_until(lambda: state.index.l0_blocks("r") == 5, 5, "snapshot applied")
        source.stop()
        restarted = KvEventSource(source.port).start()  # a restarted rank: same address, empty cache
        try:
            restarted.store(blocks(2, conversation=2))
            await wait_until(lambda: restarted.subscriptions == 1, 5, "reconnected")
            reconnected_at = time.monotonic()  # after the break: the outage's deadline is before this + DOWN_AFTER_S
            await wait_until(lambda: state.index.l0_blocks("r") == 2, 5, "new snapshot replaced the old")
            await wait_until(lambda: time.monotonic() > reconnected_at + DOWN_AFTER_S, 5, "past the outage's deadline")
            restarted.store(blocks(1, conversation=3))  # a marker: applied once the feed has dealt with all before it
            await wait_until(lambda: state.index.l0_blocks("r") == 3, 5, "a delta sent past the deadline applied")
            assert [entry.rank_id for entry in state.registry.healthy()] == ["r"]
        finally:
            await feeds.close()
            restarted.stop()

    asyncio.run(scenario())


def test_stream_down_past_the_deadline_marks_the_rank_down(source: KvEventSource) -> None:
    source.store(blocks(3))

    async def scenario() -> None:
        state, feeds = new_state()
        register(state, source)
        await wait_until(lambda: state.index.l0_blocks("r") == 3, 5, "snapshot applied")
        source.stop()
        stopped = time.monotonic()
        await wait_until(lambda: not state.registry.healthy(), 5, "rank marked down")
        assert time.monotonic() - stopped >= DOWN_AFTER_S * 0.9, "not before the deadline"
        entry = state.registry.get("r")
        assert entry is not None and "event stream lost" in entry.down_reason
        assert feeds.following() == [] and state.index.l0_blocks("r") == 0

        back = KvEventSource(source.port).start()
        try:
            back.store(blocks(1))
            register(state, back, incarnation="i2")  # the rank comes back and registers again
            await wait_until(lambda: state.index.l0_blocks("r") == 1, 5, "followed again")
        finally:
            await feeds.close()
            back.stop()

    asyncio.run(scenario())


def test_kvstore_feed_fills_l1_and_empties_it_when_lost(source: KvEventSource) -> None:
    prompt = blocks(6)
    source.store(prompt)

    async def scenario() -> None:
        state, feeds = new_state()
        feeds.follow_kvstore(source.address)
        await wait_until(lambda: state.index.l1_blocks == 6, 5, "L1 snapshot applied")
        assert state.index.match(prompt, ["any"])["any"].l1_blocks == 6
        source.stop()
        await wait_until(lambda: state.index.l1_blocks == 0, 5, "L1 emptied")
        back = KvEventSource(source.port).start()
        try:
            back.store(prompt[:2])
            await wait_until(lambda: state.index.l1_blocks == 2, 5, "L1 back")
        finally:
            await feeds.close()
            back.stop()

    asyncio.run(scenario())
