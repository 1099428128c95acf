"""The rank's gRPC client of the kvstore: blocking stubs with short deadlines, called from the L1 tier's own
threads (never the engine thread). Attach and the slot calls share one channel; each KvEvents subscription
and probe has its own, so a watch that hangs on a dead connection never holds up the calls.

gRPC status codes become the two errors the tier understands: FAILED_PRECONDITION on a call that names an
arena means that arena is stale (attach again); everything else means L1 is unavailable for now.

Every attach announces a new incarnation (the process incarnation plus a count): the tier attaches again
only after it has let go of everything it held, and a new incarnation makes the kvstore drop the pins of
the old one, including any a call that timed out on our side took after all.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from contracts import internal_auth
from contracts.kv_events import KvEventBatch, batch_of_message
from protos import kv_events_pb2 as events_pb
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc
from rank_worker.l1.arena import ArenaLayout
from rank_worker.l1.kvstore_client import KvEventStream, KvStoreClient, L1StaleArenaError, L1UnavailableError

log = logging.getLogger(__name__)

# Reconnect quickly after a kvstore restart (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def open_channel(address: str) -> grpc.Channel:
    """Every channel this rank opens to the kvstore (one place, for credentials)."""
    return internal_auth.channel(address, options=CHANNEL_OPTIONS)


class KvStoreLink(KvStoreClient):
    """One rank process's connection to the kvstore at `address` (host:port)."""

    def __init__(
        self,
        address: str,
        rank_id: str,
        incarnation: str,
        timeout_s: float = 1.0,
        attach_timeout_s: float = 2.0,
    ) -> None:
        self._address = address
        self.rank_id = rank_id
        self.incarnation = incarnation
        self.timeout_s = timeout_s
        self.attach_timeout_s = attach_timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.KvStoreStub | None = None
        self._channel_lock = threading.Lock()  # attach (its thread) swaps the channel the calls thread uses
        self._attaches = 0

    @property
    def address(self) -> str:
        return self._address

    def _connect(self) -> pb_grpc.KvStoreStub:
        with self._channel_lock:
            if self._stub is None:
                self._channel = open_channel(self._address)
                self._stub = pb_grpc.KvStoreStub(self._channel)
            return self._stub

    def attach(self, slot_bytes: int, hash_namespace: bytes) -> ArenaLayout:
        self.close()  # a fresh channel: a restarted kvstore is reached now, not after a reconnect backoff
        self._attaches += 1
        request = pb.AttachRequest(
            rank_id=self.rank_id,
            incarnation=f"{self.incarnation}.{self._attaches}",
            slot_bytes=slot_bytes,
            hash_namespace=hash_namespace,
        )
        try:
            reply = self._connect().Attach(request, timeout=self.attach_timeout_s)
        except grpc.RpcError as exc:
            raise L1UnavailableError(f"attach refused: {_describe(exc)}") from exc
        return ArenaLayout(
            arena_id=reply.arena_id,
            path=reply.arena_path,
            arena_bytes=reply.arena_bytes,
            slot_bytes=reply.slot_bytes,
            num_slots=reply.num_slots,
        )

    def allocate(self, arena_id: str, block_hashes: list[bytes]) -> list[int]:
        request = pb.AllocateRequest(rank_id=self.rank_id, arena_id=arena_id, block_hashes=block_hashes)
        reply = self._call("Allocate", request)
        slots = list(reply.slots)
        if len(slots) != len(block_hashes):
            raise L1UnavailableError(f"Allocate answered {len(slots)} slots for {len(block_hashes)} hashes")
        return slots

    def reserve(self, arena_id: str, count: int) -> list[int]:
        request = pb.ReserveRequest(rank_id=self.rank_id, arena_id=arena_id, count=count)
        slots = list(self._call("Reserve", request).slots)
        if len(slots) > count:
            raise L1UnavailableError(f"Reserve answered {len(slots)} slots for {count}")
        return slots

    def commit(
        self, arena_id: str, slots: list[int], *, gpu_holds: bool = False, block_hashes: list[bytes] | None = None
    ) -> None:
        request = pb.CommitRequest(
            rank_id=self.rank_id, arena_id=arena_id, slots=slots, gpu_holds=gpu_holds, block_hashes=block_hashes or []
        )
        self._call("Commit", request)

    def lookup(self, arena_id: str, block_hashes: list[bytes]) -> list[int]:
        request = pb.LookupRequest(rank_id=self.rank_id, arena_id=arena_id, block_hashes=block_hashes)
        slots = list(self._call("Lookup", request).slots)
        if len(slots) > len(block_hashes):
            raise L1UnavailableError(f"Lookup answered {len(slots)} slots for {len(block_hashes)} hashes")
        return slots

    def release(self, arena_id: str, slots: list[int], *, restored: bool = False) -> None:
        request = pb.ReleaseRequest(rank_id=self.rank_id, arena_id=arena_id, slots=slots, restored=restored)
        self._call("Release", request)

    def current_arena_id(self) -> str:
        try:
            with open_channel(self._address) as channel:
                reply = pb_grpc.KvStoreStub(channel).Stats(pb.StatsRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise L1UnavailableError(f"Stats: {_describe(exc)}") from exc
        return reply.arena_id

    def kv_events(self) -> KvEventStream:
        return _EventStream(open_channel(self._address))

    def _call(self, method: str, request: Any) -> Any:
        rpc = getattr(self._connect(), method)
        try:
            return rpc(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:  # type: ignore[attr-defined]
                raise L1StaleArenaError(f"{method}: {_describe(exc)}") from exc
            raise L1UnavailableError(f"{method}: {_describe(exc)}") from exc

    def close(self) -> None:
        with self._channel_lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None


class _EventStream(KvEventStream):
    """One KvEvents subscription on a channel of its own, closed when the stream ends or is cancelled."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._call = pb_grpc.KvStoreStub(channel).KvEvents(events_pb.KvEventsRequest())

    def __iter__(self) -> Iterator[KvEventBatch]:
        try:
            for message in self._call:
                yield batch_of_message(message)
        except grpc.RpcError as exc:
            raise L1UnavailableError(f"KvEvents: {_describe(exc)}") from exc
        finally:
            self._channel.close()

    def cancel(self) -> None:
        self._call.cancel()
        self._channel.close()  # also when iteration never started


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code()  # type: ignore[attr-defined]
    return f"{code.name if code else 'unknown'}: {exc.details()}"  # type: ignore[attr-defined]
