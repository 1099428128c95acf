"""A test double of a KV event publisher: a real gRPC server implementing only RankWorker.KvEvents and
KvStore.KvEvents, publishing through contracts.kv_event_feed as a rank and the kvstore do (a snapshot first:
ALL_CLEARED + STORED, then deltas with per-subscriber sequence numbers from 1). It serves on an event loop of
its own thread, so a test drives it from anywhere. The whole-stack tests use real rank workers and kvstores."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc

from contracts.kv_event_feed import KvEventFeed, KvEventsEndedError
from contracts.kv_events import KvEvent, KvEventKind, batch_message
from protos import kv_events_pb2 as events_pb
from protos import kvstore_pb2_grpc, rank_worker_pb2_grpc

T = TypeVar("T")
CALL_TIMEOUT_S = 5.0


class KvEventSource(rank_worker_pb2_grpc.RankWorkerServicer, kvstore_pb2_grpc.KvStoreServicer):
    """Holds a set of blocks; store()/remove() publish deltas to every subscriber."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.subscriptions = 0
        self._blocks: set[bytes] = set()  # the serving loop's only
        self._feed = KvEventFeed(lambda: sorted(self._blocks))
        self._skip_next_sequence = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"kv-event-source-{port}", daemon=True)
        self._server: grpc.aio.Server | None = None

    def start(self) -> KvEventSource:
        self._thread.start()
        self._server = self._on_loop(self._serve())
        return self

    def stop(self) -> None:
        """Like a dead process: every stream ends, new connections are refused."""
        if self._server is not None:
            self._on_loop(self._stop(self._server))
            self._server = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CALL_TIMEOUT_S)
            self._loop.close()

    def store(self, hashes: list[bytes]) -> None:
        self._on_loop(self._publish(KvEventKind.STORED, hashes))

    def remove(self, hashes: list[bytes]) -> None:
        self._on_loop(self._publish(KvEventKind.REMOVED, hashes))

    def skip_a_sequence_number(self) -> None:
        """The next delta a subscriber gets jumps one number, as if a batch had been dropped."""
        self._skip_next_sequence = True

    def _on_loop(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(CALL_TIMEOUT_S)

    async def _serve(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        rank_worker_pb2_grpc.add_RankWorkerServicer_to_server(self, server)
        kvstore_pb2_grpc.add_KvStoreServicer_to_server(self, server)
        server.add_insecure_port(self.address)
        await server.start()
        return server

    async def _stop(self, server: grpc.aio.Server) -> None:
        self._feed.close()
        await server.stop(grace=0)

    async def _publish(self, kind: KvEventKind, hashes: list[bytes]) -> None:
        if kind is KvEventKind.STORED:
            self._blocks.update(hashes)
        else:
            self._blocks.difference_update(hashes)
        self._feed.publish([KvEvent(kind, tuple(hashes))])

    async def KvEvents(
        self, request: events_pb.KvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb.KvEventBatch]:
        subscription = self._feed.subscribe()
        self.subscriptions += 1
        skipped = 0
        try:
            while True:
                try:
                    batch = await subscription.get()
                except KvEventsEndedError:
                    return
                message = batch_message(batch)
                if self._skip_next_sequence and batch.sequence > 1:  # the snapshot is always 1
                    self._skip_next_sequence = False
                    skipped += 1
                message.sequence += skipped
                yield message
        finally:
            subscription.close()
