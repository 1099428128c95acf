"""The KvStore gRPC service: wire messages in and out of the L1 store, errors onto status codes.

INVALID_ARGUMENT: a malformed request or slots the caller may not commit/release as asked (fix the caller).
FAILED_PRECONDITION: a stale arena_id, a rank that has not attached, or blocks that do not fit the
arena's layout (attach again, or give up L1). UNAVAILABLE: the arena is still being created.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from contracts.kv_event_feed import KvEventsEndedError
from contracts.kv_events import batch_message
from kvstore.arena_layout import InvalidAttachError, LayoutMismatchError
from kvstore.l1_store import InvalidRequestError, L1Store, StaleArenaError
from kvstore.slot_index import SlotRequestError, UnknownRankError
from protos import kv_events_pb2 as events_pb
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

_STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidAttachError, grpc.StatusCode.INVALID_ARGUMENT),
    (SlotRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (StaleArenaError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownRankError, grpc.StatusCode.FAILED_PRECONDITION),
    (LayoutMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
)


class KvStoreServicer(pb_grpc.KvStoreServicer):
    def __init__(self) -> None:
        self._store: L1Store | None = None
        self._budget_requested_bytes = 0
        self._budget_reason = ""

    def open(self, store: L1Store, budget_requested_bytes: int, budget_reason: str) -> None:
        """Start serving `store` (its arena exists); the budget fields are reported by Stats."""
        self._store = store
        self._budget_requested_bytes = budget_requested_bytes
        self._budget_reason = budget_reason

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        store = await self._ready(context)
        layout = await _call(
            context,
            lambda: store.attach(request.rank_id, request.incarnation, request.slot_bytes, request.hash_namespace),
        )
        return pb.AttachResponse(
            arena_id=store.arena.arena_id,
            arena_path=store.arena.path,
            arena_bytes=store.arena.size_bytes,
            slot_bytes=layout.slot_bytes,
            num_slots=layout.num_slots,
        )

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        store = await self._ready(context)
        slots = await _call(context, lambda: store.allocate(request.rank_id, request.arena_id, request.block_hashes))
        return pb.AllocateResponse(slots=slots)

    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        store = await self._ready(context)
        slots = await _call(context, lambda: store.reserve(request.rank_id, request.arena_id, request.count))
        return pb.ReserveResponse(slots=slots)

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        store = await self._ready(context)
        await _call(
            context,
            lambda: store.commit(
                request.rank_id,
                request.arena_id,
                request.slots,
                gpu_holds=request.gpu_holds,
                block_hashes=list(request.block_hashes),
            ),
        )
        return pb.CommitResponse()

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        store = await self._ready(context)
        slots = await _call(context, lambda: store.lookup(request.rank_id, request.arena_id, request.block_hashes))
        return pb.LookupResponse(slots=slots)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        store = await self._ready(context)
        await _call(
            context, lambda: store.release(request.rank_id, request.arena_id, request.slots, restored=request.restored)
        )
        return pb.ReleaseResponse()

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        store = await self._ready(context)
        reply = pb.StatsResponse(
            arena_id=store.arena.arena_id,
            arena_bytes=store.arena.size_bytes,
            budget_requested_bytes=self._budget_requested_bytes,
            budget_reason=self._budget_reason,
        )
        stats = store.stats()
        if stats is not None and store.layout is not None:
            reply.slot_bytes = store.layout.slot_bytes
            reply.num_slots = stats.num_slots
            reply.free_slots = stats.free_slots
            reply.stored_slots = stats.stored_slots
            reply.writing_slots = stats.writing_slots
            reply.pinned_slots = stats.pinned_slots
            reply.lookup_blocks = stats.lookup_blocks
            reply.hit_blocks = stats.hit_blocks
            reply.stored_total = stats.stored_total
            reply.evicted_total = stats.evicted_total
        return reply

    async def KvEvents(
        self, request: events_pb.KvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb.KvEventBatch]:
        store = await self._ready(context)
        subscription = store.feed.subscribe()
        try:
            while True:
                try:
                    batch = await subscription.get()
                except KvEventsEndedError:
                    return
                yield batch_message(batch)
        finally:
            subscription.close()

    async def _ready(self, context: grpc.aio.ServicerContext) -> L1Store:
        if self._store is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the kvstore is still creating its arena")
        assert self._store is not None
        return self._store


async def _call(context: grpc.aio.ServicerContext, action: Callable[[], T]) -> T:
    """Run `action`; a refusal of the store becomes the matching status with the store's message."""
    try:
        return action()
    except Exception as exc:
        for error_type, code in _STATUS_OF:
            if isinstance(exc, error_type):
                log.warning("%s: %s", code.name, exc)
                await context.abort(code, str(exc))
        raise
