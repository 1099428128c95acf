"""KV events in vLLM's wire format, beside our gRPC streams, for routers built for vLLM (llm-d's precise
prefix-cache scorer, Dynamo, ...): a rank publishes its L0 events with medium "GPU", the kvstore its L1 events
with medium "CPU" (docs/architecture.md, "KV events for other routers").

The wire, as vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py) sends it:
- a ZMQ PUB socket; every batch is one multipart message (topic, sequence as 8 bytes big-endian, payload),
  sequences counting from 0 per publisher;
- the payload is a msgpack `KVEventBatch`, an array [ts, events, data_parallel_rank]; each event is a msgspec
  tagged struct, the class name its tag: since vLLM 0.24 (vllm-project/vllm#42892) a map with the tag under
  "type" ("map", our default), before it an array with the tag first ("array", for older subscribers);
- a ROUTER replay socket: a client sends the first sequence it wants as 8 bytes big-endian (REQ framing: an
  empty delimiter frame before it) and gets (b"", sequence, payload) for every buffered batch from there, then
  (b"", -1 as 8 signed bytes, b""). A REQ socket takes only the first of those replies: use a DEALER that sends
  (b"", start) itself.

Block hashes are our 16-byte xxh3-128 chain hashes (contracts/block_hash.py), sent as msgpack bin: vLLM's
ExternalBlockHash is bytes | int, and vLLM itself sends ints (the last 8 bytes of its hash) by default.

The publisher's socket work, encoding included, runs on a thread of its own: publish() only appends to a
bounded queue and wakes that thread, so an engine thread never waits on ZMQ.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import zmq

from contracts.kv_events import KvEvent, KvEventKind

if TYPE_CHECKING:
    from contracts.config import KvServeConfig

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default)
DEFAULT_MAX_QUEUED = 100_000  # batches waiting for the publisher thread; beyond: the oldest are dropped
Encoding = Literal["map", "array"]


# ---- the wire structs (vLLM's field names and order; ours, written from its documented format) ----


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM >= 0.24: an event is a map, its class name under "type"."""


class BlockStored(_MapEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_MapEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(_MapEvent):
    pass


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM < 0.24: an event is an array, its class name first (the tags are the same names)."""


class ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(_EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ArrayKVEventBatch(_EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


_STRUCTS = {
    "map": (BlockStored, BlockRemoved, AllBlocksCleared),
    "array": (ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared),
}


def wire_events(events: Sequence[KvEvent], medium: str, block_size: int, encoding: Encoding = "map") -> list[Any]:
    """Our events as vLLM's: STORED -> BlockStored (the parent and token ids where the publisher knows them:
    a STORED event carrying token ids is one chain after its parent; else none and []), REMOVED ->
    BlockRemoved, ALL_CLEARED -> AllBlocksCleared."""
    stored, removed, cleared = _STRUCTS[encoding]
    out: list[Any] = []
    for event in events:
        if event.kind is KvEventKind.STORED:
            if event.block_hashes:
                out.append(
                    stored(
                        block_hashes=list(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=list(event.token_ids),
                        block_size=block_size,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                    )
                )
        elif event.kind is KvEventKind.REMOVED:
            if event.block_hashes:
                out.append(removed(block_hashes=list(event.block_hashes), medium=medium))
        else:
            out.append(cleared())
    return out


def encode_batch(
    events: Sequence[KvEvent],
    *,
    medium: str,
    block_size: int,
    ts: float,
    data_parallel_rank: int | None = 0,
    encoding: Encoding = "map",
    encoder: msgspec.msgpack.Encoder | None = None,
) -> bytes:
    """One batch's msgpack payload."""
    batch = _EventBatch(ts, wire_events(events, medium, block_size, encoding), data_parallel_rank)
    return (encoder or msgspec.msgpack.Encoder()).encode(batch)


_DECODERS = {
    "map": msgspec.msgpack.Decoder(KVEventBatch),
    "array": msgspec.msgpack.Decoder(ArrayKVEventBatch),
}
WireEvent = BlockStored | BlockRemoved | AllBlocksCleared | ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared


def decode_batch(payload: bytes) -> tuple[float, list[WireEvent]]:
    """A batch's (ts, events) from its msgpack payload, in either encoding (a subscriber need not know which one
    a publisher was set to); msgspec.DecodeError when it is neither."""
    try:
        batch = _DECODERS["map"].decode(payload)
    except msgspec.DecodeError:
        batch = _DECODERS["array"].decode(payload)
    return batch.ts, list(batch.events)


def check_endpoint(endpoint: str) -> str:
    """A ZMQ endpoint we bind: tcp://host:port (port 0 is not allowed: subscribers must know it), ipc:// or
    inproc://; ValueError otherwise. The host of a tcp endpoint is what we bind (no '*' guessing as vLLM does:
    we always bind)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"a KV events endpoint is tcp://host:port, ipc:// or inproc://, not {endpoint!r}")
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a KV events endpoint needs a host and a port from 1 to 65535: {endpoint!r}")
    return endpoint


class VllmKvEventPublisher:
    """Publishes batches of our KV events in vLLM's format: a PUB socket bound at `endpoint`, optionally a
    ROUTER replay socket at `replay_endpoint`, the last `buffer_steps` batches kept for replay.

    publish() may be called from any thread and never blocks; the sockets live on the publisher's own thread.
    close() sends what is queued (within `close_timeout_s`) and closes the sockets."""

    def __init__(
        self,
        endpoint: str,
        *,
        medium: str,
        block_size: int,
        replay_endpoint: str = "",
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        encoding: Encoding = "map",
        data_parallel_rank: int | None = 0,
        max_queued: int = DEFAULT_MAX_QUEUED,
        hwm: int = 100_000,
    ) -> None:
        if encoding not in _STRUCTS:
            raise ValueError(f"encoding is 'map' or 'array', not {encoding!r}")
        self.medium = medium
        self.block_size = block_size
        self.encoding: Encoding = encoding
        self.data_parallel_rank = data_parallel_rank
        self.dropped_batches = 0  # batches the publisher thread had no time for (queue full)
        self._topic = topic.encode()
        self._queue: collections.deque[tuple[float, tuple[KvEvent, ...]]] = collections.deque()
        self._max_queued = max_queued
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=max(1, buffer_steps))
        self._lock = threading.Lock()  # the queue and the wake flag (publish may come from several threads)
        self._woken = False
        self._closing = False
        self._next_sequence = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        try:
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(check_endpoint(endpoint))
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = ""
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(check_endpoint(replay_endpoint))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(
                f"cannot bind the KV events sockets ({endpoint}, {replay_endpoint or 'no replay'}): {exc}"
            ) from exc
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    # ---- any thread ----

    def publish(self, events: Sequence[KvEvent]) -> None:
        """One batch (nothing when there are no events); returns at once."""
        if not events:
            return
        item = (time.time(), tuple(events))
        with self._lock:
            if self._closing:
                return
            if len(self._queue) >= self._max_queued:
                self._queue.popleft()
                self.dropped_batches += 1
            self._queue.append(item)
            wake, self._woken = not self._woken, True
        if wake:
            with contextlib.suppress(BlockingIOError, OSError):  # a full pipe: the thread is being woken anyway
                os.write(self._wake_w, b"\0")

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued, then stop the thread and close the sockets (idempotent)."""
        with self._lock:
            already, self._closing = self._closing, True
        if already:
            return
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the vLLM KV events thread did not stop within %.1fs", timeout_s)
            return  # it still owns the sockets; they go with the process
        self._close_sockets()

    @property
    def sequence(self) -> int:
        """The sequence the next batch sent will get."""
        return self._next_sequence

    # ---- the publisher's thread ----

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll(1000))
            except zmq.ZMQError:
                log.exception("polling the vLLM KV events sockets failed")
                break
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.read(self._wake_r, 4096)
            self._send_queued(encoder)
            if self._replay is not None and self._replay in ready:
                try:
                    self._serve_replay()
                except Exception:
                    log.exception("a vLLM KV events replay request failed")
            with self._lock:
                if self._closing and not self._queue:
                    break
        self._send_queued(encoder)

    def _send_queued(self, encoder: msgspec.msgpack.Encoder) -> None:
        while True:
            with self._lock:
                self._woken = False
                if not self._queue:
                    return
                ts, events = self._queue.popleft()
            try:
                payload = encode_batch(
                    events,
                    medium=self.medium,
                    block_size=self.block_size,
                    ts=ts,
                    data_parallel_rank=self.data_parallel_rank,
                    encoding=self.encoding,
                    encoder=encoder,
                )
                sequence = self._next_sequence
                self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
            except Exception:
                log.exception("publishing a vLLM KV event batch failed; it is dropped")
                continue
            self._buffer.append((sequence, payload))
            self._next_sequence = sequence + 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring a malformed vLLM KV events replay request (%d frames)", len(frames))
                continue
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for sequence, payload in list(self._buffer):
                if sequence >= start:
                    self._replay.send_multipart((identity, b"", sequence.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def publisher_from_config(
    config: KvServeConfig, medium: str, block_size: int, *, kvstore: bool = False
) -> VllmKvEventPublisher | None:
    """The vLLM-format KV events publisher of a rank (medium GPU) or of the kvstore (kvstore=True, medium CPU);
    None when its endpoint is not set. Raises ValueError (a malformed endpoint) or OSError (the port is taken).
    Its first batch is AllBlocksCleared: a fresh publisher holds nothing, so a subscriber that knew an earlier
    incarnation's blocks forgets them."""
    endpoint = config.kvstore_kv_events_endpoint if kvstore else config.kv_events_endpoint
    replay = config.kvstore_kv_events_replay_endpoint if kvstore else config.kv_events_replay_endpoint
    if not endpoint:
        return None
    publisher = VllmKvEventPublisher(
        endpoint,
        medium=medium,
        block_size=block_size,
        replay_endpoint=replay,
        topic=config.kv_events_topic,
        buffer_steps=config.kv_events_buffer_steps,
        encoding=config.kv_events_encoding,
    )
    publisher.publish([KvEvent(KvEventKind.ALL_CLEARED)])
    log.info(
        "publishing %s KV events in vLLM's format on %s%s",
        medium,
        publisher.endpoint,
        f" (replay: {publisher.replay_endpoint})" if publisher.replay_endpoint else "",
    )
    return publisher
