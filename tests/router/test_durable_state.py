"""The Redis mirror with a real redis-server: write-behind, read-back at start, Redis stopped (routing goes
on from memory, logged once, writes counted), Redis started again on the same port (state written back)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
from router_prompts import lookup_hashes, prompt_tokens
from service_processes import free_port, redis_client, redis_url, start_redis

from router.durable_state import (
    RANK_PREFIX,
    SESSION_PREFIX,
    DurableState,
    LoadedState,
    parse_rank_record,
    redacted_url,
)
from router.rank_registry import RankHealth, RankIdentity, RankLoad
from router.route_score import RoutePolicy
from router.router_state import RouteQuery, RouterState

SESSION_TTL_S = 60


class RedisServer:
    """A redis-server that a test can stop and start again on the same port with the same data."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = redis_url(self.port)
        self._tmp = tmp
        self._stack: contextlib.ExitStack | None = None
        self._starts = 0

    def start(self) -> None:
        self._starts += 1
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(start_redis(self._tmp / f"redis-{self._starts}.log", self.port, self._tmp / "data"))

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def client(self) -> redis.Redis:
        return redis_client(self.port, socket_timeout=2)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def new_state() -> RouterState:
    return RouterState(RoutePolicy(0.05, 10_000), session_ttl_s=SESSION_TTL_S, rank_down_after_s=5)


def register(state: RouterState, rank_id: str) -> None:
    state.register_rank(
        RankIdentity(rank_id, f"127.0.0.1:{7000 + len(state.registry)}", "inc-1", 16, b"\xab" * 16), RankLoad()
    )


def route(state: RouterState, session: str) -> str:
    tokens = prompt_tokens(hash(session) % 1000, 200)
    return state.route(RouteQuery("r", session, lookup_hashes(tokens), len(tokens))).choice.rank_id


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not true after {timeout_s}s")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def mirrored(state: RouterState, url: str) -> AsyncIterator[tuple[DurableState, LoadedState | None]]:
    """A DurableState for `state`, started as the router's main does: read back first, then the writer."""
    durable = DurableState(state, url)
    state.durable = durable
    started = time.monotonic()
    loaded = await durable.start()
    assert time.monotonic() - started < 3, "an unreachable Redis must not hold up the start"
    writer = asyncio.ensure_future(durable.run())
    try:
        yield durable, loaded
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        await durable.close()


def test_state_is_written_behind_and_read_back_by_a_new_router(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        first = new_state()
        async with mirrored(first, redis_server.url) as (durable, loaded):
            assert loaded is not None and durable.connected
            register(first, "a")
            register(first, "b")
            ranks = {session: route(first, session) for session in ("s1", "s2", "s3")}
            await wait_until(lambda: durable.pending_writes == 0, 5, "writes flushed")

        client = redis_server.client()
        assert client.get(SESSION_PREFIX + "s1") == ranks["s1"].encode()
        assert SESSION_TTL_S - 5 < client.ttl(SESSION_PREFIX + "s1") <= SESSION_TTL_S
        record = json.loads(client.get(RANK_PREFIX + "a") or b"")
        assert record == {
            "address": "127.0.0.1:7000",
            "incarnation": "inc-1",
            "block_size": 16,
            "hash_namespace": "ab" * 16,
        }
        client.set(RANK_PREFIX + "broken", b"not json")

        second = new_state()
        async with mirrored(second, redis_server.url) as (durable, loaded):
            assert loaded is not None and (loaded.sessions, loaded.ranks) == (3, 2), "the broken record is skipped"
            for session, rank_id in ranks.items():
                assert second.sessions.rank_of(session, second.now()) == rank_id
            entry = second.registry.get("a")
            assert entry is not None and entry.health is RankHealth.UNCONFIRMED
            assert entry.identity.hash_namespace == b"\xab" * 16

    asyncio.run(scenario())


def test_redis_stopped_routing_continues_then_state_is_resynced(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        state = new_state()
        async with mirrored(state, redis_server.url) as (durable, _):
            register(state, "a")
            route(state, "before")
            await wait_until(lambda: durable.pending_writes == 0, 5, "writes flushed")

            redis_server.stop()
            during = [f"during-{n}" for n in range(50)]
            with caplog.at_level(logging.WARNING, logger="router.redis"):
                for session in during:
                    assert route(state, session) == "a", "Route answers from memory"
                    await asyncio.sleep(0.005)
                await wait_until(lambda: not durable.connected, 5, "Redis seen down")
                register(state, "b")
                assert durable.pending_writes >= 2
                errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
                assert len(errors) == 1 and "unreachable" in errors[0].getMessage(), "logged once, not per write"

                redis_server.start()
                await wait_until(lambda: durable.connected, 10, "Redis seen back")
                await wait_until(lambda: durable.pending_writes == 0, 5, "writes flushed")
            assert any("is back" in r.getMessage() and "resynced 51 sessions" in r.getMessage() for r in caplog.records)
            assert not any("is back" in r.getMessage() and "resynced 1 " in r.getMessage() for r in caplog.records)

        client = redis_server.client()
        for session in [*during, "before"]:
            assert client.get(SESSION_PREFIX + session) == b"a", session
        assert client.exists(RANK_PREFIX + "b")

    asyncio.run(scenario())


def test_redis_down_at_start_merges_its_state_when_it_comes_up(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.set(SESSION_PREFIX + "old", "a", ex=SESSION_TTL_S)
    client.set(
        RANK_PREFIX + "a",
        json.dumps({"address": "127.0.0.1:7000", "incarnation": "i", "block_size": 16, "hash_namespace": ""}),
    )
    redis_server.stop()

    async def scenario() -> None:
        state = new_state()
        async with mirrored(state, redis_server.url) as (durable, loaded):
            assert loaded is None and not durable.connected
            register(state, "b")
            assert route(state, "new") == "b"
            redis_server.start()
            await wait_until(lambda: durable.connected and durable.pending_writes == 0, 10, "Redis resynced")
            assert state.sessions.rank_of("old", state.now()) == "a", "Redis's sessions merged in"
            assert state.registry.get("a") is not None
        assert redis_server.client().get(SESSION_PREFIX + "new") == b"b"

    asyncio.run(scenario())


def test_rank_records_are_validated_and_urls_redacted() -> None:
    with pytest.raises(ValueError):
        parse_rank_record("a", b'{"address": "h:1", "incarnation": "i", "block_size": -1, "hash_namespace": ""}')
    with pytest.raises(ValueError):
        parse_rank_record("a", b"[1, 2]")
    assert parse_rank_record(
        "a", b'{"address": "h:1", "incarnation": "i", "block_size": 4, "hash_namespace": "0f"}'
    ) == RankIdentity("a", "h:1", "i", 4, b"\x0f")
    assert redacted_url("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted_url("redis://host:6379/0") == "redis://host:6379/0"
