"""The router's durable state in Redis: sessions (kvserve:session:<id> -> rank id, expiring with the
session TTL) and ranks (kvserve:rank:<id> -> JSON of address, incarnation, block size, namespace hex).

Memory is the truth while the router runs; Redis is a write-behind copy read back at start. Writes never
sit in a request's path: Route marks a key dirty and a background task writes dirty keys. When Redis is
unreachable the router keeps routing from memory, logs that once, counts the writes it owes, and on
reconnect writes back every live session and rank (and merges what Redis held, if it never could read it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from router.rank_registry import RankIdentity
from router.router_state import RouterState

log = logging.getLogger("router.redis")

SESSION_PREFIX = "kvserve:session:"
RANK_PREFIX = "kvserve:rank:"
WRITES_PER_PIPELINE = 1000
PROBE_INTERVAL_S = 1.0
STILL_DOWN_LOG_INTERVAL_S = 60.0
# Errors that mean "Redis is not there (or not answering)", as opposed to a bug in what we send.
_UNREACHABLE = (RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class LoadedState:
    sessions: int
    ranks: int


def rank_record(identity: RankIdentity) -> str:
    """The JSON stored for a rank."""
    return json.dumps(
        {
            "address": identity.address,
            "incarnation": identity.incarnation,
            "block_size": identity.block_size,
            "hash_namespace": identity.hash_namespace.hex(),
        },
        sort_keys=True,
    )


def parse_rank_record(rank_id: str, data: bytes | str) -> RankIdentity:
    """The identity stored for a rank; ValueError for anything malformed (Redis is not trusted blindly)."""
    fields = json.loads(data)
    if not isinstance(fields, dict):
        raise ValueError("not a JSON object")
    address, incarnation = fields.get("address"), fields.get("incarnation")
    block_size, namespace = fields.get("block_size"), fields.get("hash_namespace")
    if not isinstance(address, str) or not address or not isinstance(incarnation, str):
        raise ValueError("address and incarnation must be strings")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError("block_size must be a positive integer")
    if not isinstance(namespace, str):
        raise ValueError("hash_namespace must be a hex string")
    return RankIdentity(rank_id, address, incarnation, block_size, bytes.fromhex(namespace))


def redacted_url(url: str) -> str:
    """The Redis URL for logs, without a password."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class DurableState:
    """Write-behind mirror of a RouterState's sessions and ranks (implements router_state.DurableChanges)."""

    def __init__(self, state: RouterState, redis_url: str, socket_timeout_s: float = 2.0) -> None:
        self._state = state
        self._url = redacted_url(redis_url)
        self._client = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=min(socket_timeout_s, 1.0),
            retry=Retry(NoBackoff(), 1),  # one immediate retry covers a pooled connection Redis closed
        )
        self.connected = False
        self.errors = 0  # Redis calls that failed (the metrics)
        self._loaded = False
        self._dirty_sessions: dict[str, None] = {}  # insertion-ordered set
        self._dirty_ranks: set[str] = set()
        self._forgotten_ranks: set[str] = set()
        self._wake = asyncio.Event()
        self._down_since: float | None = None
        self._last_down_log = 0.0

    # --- DurableChanges: called from the router's logic, never blocks ---

    def session_changed(self, session_id: str) -> None:
        self._dirty_sessions[session_id] = None
        self._wake.set()

    def rank_changed(self, rank_id: str) -> None:
        self._forgotten_ranks.discard(rank_id)
        self._dirty_ranks.add(rank_id)
        self._wake.set()

    def rank_forgotten(self, rank_id: str) -> None:
        self._dirty_ranks.discard(rank_id)
        self._forgotten_ranks.add(rank_id)
        self._wake.set()

    @property
    def pending_writes(self) -> int:
        """Keys changed in memory and not yet in Redis."""
        return len(self._dirty_sessions) + len(self._dirty_ranks) + len(self._forgotten_ranks)

    # --- lifecycle ---

    async def start(self) -> LoadedState | None:
        """Read sessions and ranks back from Redis; None (logged) when Redis is unreachable: the router
        starts from memory and merges Redis's state in once it is back."""
        try:
            loaded = await self._load()
        except _UNREACHABLE as exc:
            self._went_down(exc)
            return None
        self.connected = True
        log.info("Redis %s: restored %d sessions and %d ranks", self._url, loaded.sessions, loaded.ranks)
        return loaded

    async def run(self) -> None:
        """Write dirty keys as they appear; while Redis is down, probe it and resync when it returns."""
        while True:
            if not self.connected:
                await asyncio.sleep(PROBE_INTERVAL_S)
                if not self.connected:  # start() may have connected meanwhile
                    await self._probe()
                continue
            if not self.pending_writes:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self._flush()
            except _UNREACHABLE as exc:
                self._went_down(exc)

    async def close(self) -> None:
        """Write what is still pending if Redis is there, then close the client."""
        if self.connected and self.pending_writes:
            try:
                await asyncio.wait_for(self._flush(), timeout=2.0)
            except (*_UNREACHABLE, asyncio.CancelledError) as exc:
                log.warning("Redis %s: %d writes not saved at exit: %s", self._url, self.pending_writes, exc)
        await self._client.aclose()

    # --- internals ---

    async def _probe(self) -> None:
        try:
            await self._client.ping()
            merged = None if self._loaded else await self._load()
            pending_before = self.pending_writes
            written_sessions, written_ranks = self._mark_everything_dirty()
            await self._flush()
        except _UNREACHABLE as exc:
            self._still_down(exc)
            return
        down_s = time.monotonic() - (self._down_since or time.monotonic())
        self.connected = True
        self._down_since = None
        log.warning(
            "Redis %s is back after %.1fs: resynced %d sessions and %d ranks from memory "
            "(%d writes had been pending)%s",
            self._url,
            down_s,
            written_sessions,
            written_ranks,
            pending_before,
            f"; merged {merged.sessions} sessions and {merged.ranks} ranks it held" if merged else "",
        )

    def _went_down(self, exc: BaseException) -> None:
        self.errors += 1
        self.connected = False
        self._down_since = time.monotonic()
        self._last_down_log = self._down_since
        log.error(
            "Redis %s is unreachable (%s): routing continues from memory; changes are kept and written back "
            "when it returns (%d writes pending)",
            self._url,
            str(exc) or type(exc).__name__,
            self.pending_writes,
        )

    def _still_down(self, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._last_down_log >= STILL_DOWN_LOG_INTERVAL_S:
            self._last_down_log = now
            log.error(
                "Redis %s still unreachable after %.0fs (%s): %d writes pending",
                self._url,
                now - (self._down_since or now),
                str(exc) or type(exc).__name__,
                self.pending_writes,
            )

    def _mark_everything_dirty(self) -> tuple[int, int]:
        now = self._state.now()
        sessions = 0
        for session_id, _ in self._state.sessions.live(now):
            self._dirty_sessions[session_id] = None
            sessions += 1
        ranks = 0
        for entry in self._state.registry:
            self._dirty_ranks.add(entry.rank_id)
            ranks += 1
        return sessions, ranks

    async def _flush(self) -> None:
        sessions, ranks, forgotten = self._dirty_sessions, self._dirty_ranks, self._forgotten_ranks
        self._dirty_sessions, self._dirty_ranks, self._forgotten_ranks = {}, set(), set()
        try:
            await self._write(list(sessions), ranks, forgotten)
        except BaseException:
            # Put them back (newer changes made meanwhile are already in the fresh sets).
            for session_id in sessions:
                self._dirty_sessions.setdefault(session_id, None)
            self._dirty_ranks |= ranks - self._forgotten_ranks
            self._forgotten_ranks |= forgotten - self._dirty_ranks
            raise

    async def _write(self, sessions: list[str], ranks: set[str], forgotten: set[str]) -> None:
        now = self._state.now()
        pipe = self._client.pipeline(transaction=False)
        queued = 0
        for session_id in sessions:
            entry = self._state.sessions.entry(session_id, now)
            if entry is None:
                continue  # expired meanwhile: Redis expires its copy by itself
            remaining_ms = max(int((entry.expires_at - now) * 1000), 1)
            pipe.set(SESSION_PREFIX + session_id, entry.rank_id, px=remaining_ms)
            queued += 1
            if queued % WRITES_PER_PIPELINE == 0:
                await pipe.execute()
        for rank_id in ranks:
            rank = self._state.registry.get(rank_id)
            if rank is not None:
                pipe.set(RANK_PREFIX + rank_id, rank_record(rank.identity))
        for rank_id in forgotten:
            pipe.delete(RANK_PREFIX + rank_id)
        await pipe.execute()

    async def _load(self) -> LoadedState:
        rank_keys = [key async for key in self._client.scan_iter(match=RANK_PREFIX + "*", count=1000)]
        ranks = 0
        for start in range(0, len(rank_keys), WRITES_PER_PIPELINE):
            chunk = rank_keys[start : start + WRITES_PER_PIPELINE]
            for key, value in zip(chunk, await self._client.mget(chunk), strict=True):
                rank_id = key.decode(errors="replace")[len(RANK_PREFIX) :]
                if value is None:
                    continue
                try:
                    identity = parse_rank_record(rank_id, value)
                except ValueError as exc:
                    log.warning("Redis: ignoring malformed rank record %r: %s", rank_id, exc)
                    continue
                self._state.restore_rank(identity)
                ranks += 1
        session_keys = [key async for key in self._client.scan_iter(match=SESSION_PREFIX + "*", count=1000)]
        found: list[tuple[float, str, str]] = []
        for start in range(0, len(session_keys), WRITES_PER_PIPELINE):
            chunk = session_keys[start : start + WRITES_PER_PIPELINE]
            pipe = self._client.pipeline(transaction=False)
            for key in chunk:
                pipe.get(key)
                pipe.pttl(key)
            replies = await pipe.execute()
            for index, key in enumerate(chunk):
                rank_id, ttl_ms = replies[2 * index], replies[2 * index + 1]
                if rank_id is None or not isinstance(ttl_ms, int) or ttl_ms <= 0:
                    continue  # gone, or stored without expiry by someone else
                found.append((ttl_ms / 1000.0, key.decode(errors="replace")[len(SESSION_PREFIX) :], rank_id.decode()))
        now = self._state.now()
        sessions = 0
        for remaining_s, session_id, rank_id in sorted(found):  # oldest first: the table's expiry order
            sessions += self._state.sessions.restore(session_id, rank_id, remaining_s, now)
        self._loaded = True
        return LoadedState(sessions, ranks)
