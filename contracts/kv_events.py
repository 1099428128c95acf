"""KV cache events as ranks (L0) and the kvstore (L1) publish them, and their wire form (kv_events.proto)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from protos import kv_events_pb2 as events_pb

log = logging.getLogger("kv_events")


class KvEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    ALL_CLEARED = "all_cleared"


@dataclass(frozen=True)
class KvEvent:
    kind: KvEventKind
    block_hashes: tuple[bytes, ...] = ()
    # A STORED event's chain, where the publisher records it (only for vLLM-format KV events, contracts/
    # vllm_kv_events.py; the gRPC wire carries neither): block_hashes then follow one another after
    # parent_block_hash (None: the first block of a prompt), and token_ids are their tokens, block after block.
    parent_block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KvEventBatch:
    sequence: int  # per subscriber, +1 per batch published while subscribed: a gap means dropped batches
    events: tuple[KvEvent, ...]


_WIRE_KINDS = {
    KvEventKind.STORED: events_pb.KV_EVENT_KIND_STORED,
    KvEventKind.REMOVED: events_pb.KV_EVENT_KIND_REMOVED,
    KvEventKind.ALL_CLEARED: events_pb.KV_EVENT_KIND_ALL_CLEARED,
}


_KINDS_OF_WIRE = {wire: kind for kind, wire in _WIRE_KINDS.items()}


def kind_of_wire(wire_kind: int) -> KvEventKind | None:
    """The event kind of a wire kind; None for one this version does not know."""
    return _KINDS_OF_WIRE.get(wire_kind)


def batch_message(batch: KvEventBatch) -> events_pb.KvEventBatch:
    """The wire message of one batch."""
    return events_pb.KvEventBatch(
        sequence=batch.sequence,
        events=[
            events_pb.KvEvent(kind=_WIRE_KINDS[event.kind], block_hashes=list(event.block_hashes))
            for event in batch.events
        ],
    )


def batch_of_message(message: events_pb.KvEventBatch) -> KvEventBatch:
    """The batch of a wire message, for a subscriber; an event of a kind this version does not know is skipped
    (and logged): it changes nothing the subscriber tracks."""
    events = []
    for event in message.events:
        kind = kind_of_wire(event.kind)
        if kind is None:
            log.warning("ignoring a KV event of unknown kind %d", event.kind)
            continue
        events.append(KvEvent(kind, tuple(event.block_hashes)))
    return KvEventBatch(message.sequence, tuple(events))
