"""KV event subscriptions: one task per followed rank (RankWorker.KvEvents) and one for the node's kvstore
(KvStore.KvEvents), each applying batches to the router's prefix index.

Every subscription starts with a snapshot (ALL_CLEARED, then STORED for everything held), so after any
reconnect or sequence gap we simply resubscribe and the index for that publisher is rebuilt. A rank whose
stream stays broken for rank_down_after_secs is reported (it is most likely dead); a lost kvstore stream
empties L1 until it is back (a restarted kvstore starts empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from contracts import internal_auth
from contracts.kv_events import KvEvent, batch_of_message
from protos import kv_events_pb2 as events_pb
from protos import kvstore_pb2_grpc, rank_worker_pb2_grpc
from router.rank_registry import RankIdentity
from router.router_state import RouterState

log = logging.getLogger("router.events")

RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0
MAX_MESSAGE_BYTES = 512 * 1024 * 1024  # a snapshot of a large cache may arrive as one batch
RANK_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Ranks permit pings every 5 s; 30 s finds a half-open connection to a vanished host.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
KVSTORE_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


OpenStream = Callable[[grpc.aio.Channel], AsyncIterator[events_pb.KvEventBatch]]


class EventFeeds:
    """Implements router_state.RankFollower with real subscriptions; also follows the kvstore."""

    def __init__(self, state: RouterState, rank_down_after_s: float) -> None:
        self._state = state
        self._down_after_s = rank_down_after_s
        self._rank_tasks: dict[str, asyncio.Task[None]] = {}
        self._l1_task: asyncio.Task[None] | None = None

    def follow_rank(self, identity: RankIdentity) -> None:
        self.unfollow_rank(identity.rank_id)
        task = asyncio.get_running_loop().create_task(self._follow_rank(identity), name=f"kv-events-{identity.rank_id}")
        self._rank_tasks[identity.rank_id] = task

    def unfollow_rank(self, rank_id: str) -> None:
        task = self._rank_tasks.pop(rank_id, None)
        if task is not None:
            task.cancel()

    def follow_kvstore(self, address: str) -> None:
        """Follow the node's kvstore for L1 presence (nothing to do for an empty address)."""
        if address:
            self._l1_task = asyncio.get_running_loop().create_task(self._follow_kvstore(address), name="kv-events-l1")

    def following(self) -> list[str]:
        return sorted(self._rank_tasks)

    async def close(self) -> None:
        tasks = [*self._rank_tasks.values(), *([self._l1_task] if self._l1_task else [])]
        self._rank_tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow_rank(self, identity: RankIdentity) -> None:
        rank_id, incarnation = identity.rank_id, identity.incarnation

        def open_stream(channel: grpc.aio.Channel) -> AsyncIterator[events_pb.KvEventBatch]:
            return rank_worker_pb2_grpc.RankWorkerStub(channel).KvEvents(events_pb.KvEventsRequest())

        def on_lost(detail: str) -> None:
            self._state.feed_lost(rank_id, incarnation, detail)

        await _Feed(
            f"rank {rank_id} at {identity.address}",
            identity.address,
            RANK_CHANNEL_OPTIONS,
            open_stream,
            on_reset=lambda: self._state.reset_rank_events(rank_id, incarnation),
            on_events=lambda events: self._state.apply_rank_events(rank_id, incarnation, events),
            on_broken=lambda: None,  # keep the rank's entries: a rank that stays away is marked down
            on_lost=on_lost,
            lost_after_s=self._down_after_s,
        ).run()

    async def _follow_kvstore(self, address: str) -> None:
        def open_stream(channel: grpc.aio.Channel) -> AsyncIterator[events_pb.KvEventBatch]:
            return kvstore_pb2_grpc.KvStoreStub(channel).KvEvents(events_pb.KvEventsRequest())

        await _Feed(
            f"kvstore at {address}",
            address,
            KVSTORE_CHANNEL_OPTIONS,
            open_stream,
            on_reset=self._state.index.clear_l1,
            on_events=self._state.index.apply_l1,
            on_broken=self._state.index.clear_l1,  # a restarted kvstore comes back empty
            on_lost=None,
            lost_after_s=self._down_after_s,
        ).run()


class _Feed:
    """One publisher's subscription, resubscribed after every break."""

    def __init__(
        self,
        name: str,
        address: str,
        options: list[tuple[str, int]],
        open_stream: OpenStream,
        *,
        on_reset: Callable[[], None],
        on_events: Callable[[Sequence[KvEvent]], None],
        on_broken: Callable[[], None],
        on_lost: Callable[[str], None] | None,
        lost_after_s: float,
    ) -> None:
        self.name = name
        self._address = address
        self._options = options
        self._open_stream = open_stream
        self._on_reset = on_reset
        self._on_events = on_events
        self._on_broken = on_broken
        self._on_lost = on_lost
        self._lost_after_s = lost_after_s
        self._batches = 0  # in the current subscription

    async def run(self) -> None:
        """Subscribe and apply until cancelled; call on_lost (and return) once the publisher has been
        unreachable for lost_after_s: whoever follows it again starts a new feed."""
        loop = asyncio.get_running_loop()
        broken_since = loop.time()  # a feed that never connects counts as broken from its start
        retry_s = RETRY_MIN_S
        while True:
            self._batches = 0
            detail = await self._subscribe_once()
            now = loop.time()
            if self._batches:  # it was up: the outage starts now
                broken_since, retry_s = now, RETRY_MIN_S
                self._on_broken()
                log.warning("KV events from %s broken (%s); resubscribing", self.name, detail)
            else:
                log.debug("KV events from %s: cannot subscribe (%s)", self.name, detail)
            if self._on_lost is not None and now - broken_since >= self._lost_after_s:
                log.warning("KV events from %s unreachable for %.1fs (%s)", self.name, now - broken_since, detail)
                self._on_lost(detail)
                return
            sleep_s = retry_s
            if self._on_lost is not None:  # wake up at the deadline, not a whole backoff step past it
                sleep_s = min(sleep_s, max(self._lost_after_s - (now - broken_since), 0.01))
            await asyncio.sleep(sleep_s)
            retry_s = min(retry_s * 2, RETRY_MAX_S)

    async def _subscribe_once(self) -> str:
        """One subscription until it breaks; returns why it ended."""
        try:
            async with internal_auth.aio_channel(self._address, options=self._options) as channel:
                expected = 1
                async for batch in self._open_stream(channel):
                    if batch.sequence != expected:
                        return f"sequence gap: expected {expected}, got {batch.sequence}"
                    events = batch_of_message(batch).events
                    if expected == 1:
                        # The snapshot follows (ALL_CLEARED first by contract; cleared here in any case).
                        self._on_reset()
                    self._on_events(events)
                    if expected == 1:
                        log.info("KV events from %s: subscribed", self.name)
                    expected += 1
                    self._batches += 1
            return "stream ended"
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        except (ValueError, TypeError) as exc:  # a malformed batch: resubscribe rather than die
            log.exception("KV events from %s: bad batch", self.name)
            return f"{type(exc).__name__}: {exc}"
