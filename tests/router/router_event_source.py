"""A test double of a KV event publisher: a real gRPC server implementing only RankWorker.KvEvents and
KvStore.KvEvents with the contract's semantics (a snapshot first: ALL_CLEARED + STORED, then deltas with
per-subscriber sequence numbers from 1). The whole-stack tests use real rank workers and kvstores."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from protos import kv_events_pb2 as events_pb
from protos import kvstore_pb2_grpc, rank_worker_pb2_grpc


class KvEventSource(rank_worker_pb2_grpc.RankWorkerServicer, kvstore_pb2_grpc.KvStoreServicer):
    """Holds a set of blocks; store()/remove() publish deltas to every subscriber."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.subscriptions = 0
        self._blocks: set[bytes] = set()
        self._subscribers: list[queue.Queue[list[events_pb.KvEvent] | None]] = []
        self._skip_next_sequence = False
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def start(self) -> KvEventSource:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        rank_worker_pb2_grpc.add_RankWorkerServicer_to_server(self, server)
        kvstore_pb2_grpc.add_KvStoreServicer_to_server(self, server)
        server.add_insecure_port(self.address)
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """Like a dead process: every stream ends, new connections are refused."""
        with self._lock:
            for subscriber in self._subscribers:
                subscriber.put(None)
            self._subscribers.clear()
        if self._server is not None:
            self._server.stop(grace=0).wait(5)
            self._server = None

    def store(self, hashes: list[bytes]) -> None:
        self._publish(events_pb.KV_EVENT_KIND_STORED, hashes)

    def remove(self, hashes: list[bytes]) -> None:
        self._publish(events_pb.KV_EVENT_KIND_REMOVED, hashes)

    def skip_a_sequence_number(self) -> None:
        """The next batch each subscriber gets jumps one number, as if a batch had been dropped."""
        self._skip_next_sequence = True

    def _publish(self, kind: events_pb.KvEventKind, hashes: list[bytes]) -> None:
        with self._lock:
            if kind == events_pb.KV_EVENT_KIND_STORED:
                self._blocks.update(hashes)
            else:
                self._blocks.difference_update(hashes)
            for subscriber in self._subscribers:
                subscriber.put([events_pb.KvEvent(kind=kind, block_hashes=hashes)])

    def KvEvents(
        self, request: events_pb.KvEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[events_pb.KvEventBatch]:
        subscriber: queue.Queue[list[events_pb.KvEvent] | None] = queue.Queue()
        with self._lock:
            snapshot = sorted(self._blocks)
            self._subscribers.append(subscriber)
            self.subscriptions += 1
        sequence = 1
        yield events_pb.KvEventBatch(
            sequence=sequence,
            events=[
                events_pb.KvEvent(kind=events_pb.KV_EVENT_KIND_ALL_CLEARED),
                events_pb.KvEvent(kind=events_pb.KV_EVENT_KIND_STORED, block_hashes=snapshot),
            ],
        )
        try:
            while context.is_active():
                try:
                    events = subscriber.get(timeout=0.05)
                except queue.Empty:
                    continue
                if events is None:
                    return
                sequence += 2 if self._skip_next_sequence else 1
                self._skip_next_sequence = False
                yield events_pb.KvEventBatch(sequence=sequence, events=events)
        finally:
            with self._lock:
                if subscriber in self._subscribers:
                    self._subscribers.remove(subscriber)
