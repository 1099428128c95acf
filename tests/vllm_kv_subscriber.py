"""A subscriber of KV events in vLLM's wire format, written from vLLM's documented format (its
examples/online_serving/kv_events_subscriber.py and vllm/distributed/kv_events.py, vLLM 0.24 on: each event a
msgpack map tagged by "type", the batch a positional array), not from our publisher's code: what llm-d's
indexer or any other vLLM subscriber would decode.

Frames: SUB gets (topic, sequence as 8 bytes big-endian, payload); replay: send (b"", start as 8 bytes) to the
ROUTER (REQ framing, from a DEALER, since a REQ socket takes only the first of several replies) and read
(b"", sequence, payload) until the sequence is -1 with an empty payload.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events: tagged by class name (the "type" key)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM before 0.24: every event a positional array whose first element is the tag.
class LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the legacy (array) events."""


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(EventBatch):
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
LEGACY_DECODER = msgspec.msgpack.Decoder(type=LegacyKVEventBatch)


@dataclass
class Received:
    sequence: int
    batch: KVEventBatch


class Subscriber:
    """SUB on `endpoint` (topic prefix `topic`), DEALER on `replay_endpoint`."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: str = "") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.topic = topic
        self.replay = None
        if replay_endpoint:
            self.replay = self.context.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(replay_endpoint)

    def receive(self, timeout_s: float) -> Received | None:
        """The next live batch, None if none came within timeout_s."""
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        topic, sequence, payload = self.sub.recv_multipart()
        assert topic.decode().startswith(self.topic)
        return Received(int.from_bytes(sequence, "big"), DECODER.decode(payload))

    def replay_from(self, start: int, timeout_s: float = 10.0) -> list[Received]:
        """Every buffered batch from `start` on, as the replay socket answers them (up to its end marker)."""
        assert self.replay is not None
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        batches: list[Received] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.replay.poll(int(left * 1000)), "no end of replay marker in time"
            empty, sequence, payload = self.replay.recv_multipart()
            assert empty == b""
            number = int.from_bytes(sequence, "big", signed=True)
            if number == -1:
                assert payload == b""
                return batches
            batches.append(Received(number, DECODER.decode(payload)))

    def close(self) -> None:
        self.sub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.context.term()


def events_of(received: list[Received]) -> list[Any]:
    return [event for item in received for event in item.batch.events]
