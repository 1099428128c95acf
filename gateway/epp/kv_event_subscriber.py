"""Follows one publisher of vLLM-format KV events (a node's rank or kvstore) into the fleet index.

The wire is contracts/vllm_kv_events.py's: multipart (topic, 8-byte big-endian sequence, msgpack batch) on a PUB
socket, and a ROUTER replay socket that sends the buffered batches from a given sequence on. On start the
subscriber asks for everything buffered (a node that was busy before the EPP came up is known at once); a
sequence that skips ahead is filled from the replay socket; one that goes back is a restarted publisher, whose
blocks are forgotten first; and when the node comes back after being unready (resync), the source is read again
from its replay buffer, since a restarted publisher that sent more batches than before shows no sequence going
back. A gap replay cannot fill is left: the index is a hint (fleet_index.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from contracts.vllm_kv_events import (
    END_OF_REPLAY,
    ArrayBlockRemoved,
    ArrayBlockStored,
    BlockRemoved,
    BlockStored,
    WireEvent,
    decode_batch,
)
from gateway.epp.fleet_config import KvEventSource
from gateway.epp.fleet_index import FleetIndex

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
RECENT_BATCHES = 4096  # sequences whose timestamps are kept to tell duplicates from a restart


@dataclass
class SubscriberCounts:
    batches: int = 0
    gaps: int = 0  # sequences skipped that replay did not fill
    restarts: int = 0  # the publisher's sequence went back
    bad_batches: int = 0


class KvEventSubscriber:
    def __init__(self, context: zmq.asyncio.Context, source: KvEventSource, node: str, index: FleetIndex) -> None:
        self._context = context
        self.source = source
        self.source_id = source.endpoint
        self.node = node
        self._index = index
        self._last: int | None = None  # the last sequence applied
        self._applied: dict[int, float] = {}  # recent sequences applied -> their batch's timestamp
        self.counts = SubscriberCounts()
        self._resyncs: set[asyncio.Task[None]] = set()
        index.add_source(self.source_id, node)

    async def run(self) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        socket.connect(self.source.endpoint)
        try:
            await self._replay_from(0)
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counts.bad_batches += 1
                    continue
                await self._on_batch(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            socket.close()

    def resync(self) -> None:
        """Forget what this source reported and read its replay buffer again: its node came back, and a publisher
        that restarted meanwhile and sent more batches than before shows no sequence going back."""
        self._index.cleared(self.source_id)
        self._last = None
        self._applied.clear()
        self._resyncs.add(task := asyncio.create_task(self._replay_from(0)))
        task.add_done_callback(self._resyncs.discard)

    def _decoded(self, payload: bytes) -> tuple[float, list[WireEvent]] | None:
        """The batch's (ts, events), or None for a payload that is none (counted)."""
        try:
            return decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counts.bad_batches += 1
            return None

    async def _on_batch(self, sequence: int, payload: bytes) -> None:
        decoded = self._decoded(payload)
        if decoded is None:
            return
        ts, events = decoded
        if self._last is not None and sequence <= self._last:
            if self._applied.get(sequence) == ts:  # a batch a replay already applied
                return
            log.info(
                "KV events of %s (%s) restarted at %d: its blocks are forgotten", self.node, self.source_id, sequence
            )
            self.counts.restarts += 1
            self._index.cleared(self.source_id)
            self._last = None
            self._applied.clear()
        expected = 0 if self._last is None else self._last + 1
        if sequence > expected:
            await self._replay_from(expected, until=sequence)
            if self._last is None or self._last < sequence - 1:
                self.counts.gaps += 1
        self._apply(sequence, ts, events)

    def _apply(self, sequence: int, ts: float, events: list[WireEvent]) -> None:
        self._last = sequence
        # what tells a duplicate (same sequence, same timestamp) from a restarted publisher's new batch
        self._applied[sequence] = ts
        if len(self._applied) > RECENT_BATCHES:
            del self._applied[next(iter(self._applied))]
        self.counts.batches += 1
        for event in events:
            if isinstance(event, BlockStored | ArrayBlockStored):
                self._index.stored(self.source_id, event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved | ArrayBlockRemoved):
                self._index.removed(self.source_id, event.block_hashes)
            else:
                self._index.cleared(self.source_id)

    async def _replay_from(self, start: int, until: int | None = None) -> None:
        """Apply the buffered batches from `start` (below `until`, when given) that come within the timeout."""
        if not self.source.replay:
            return
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.source.replay)
        try:
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(socket.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 3 or frames[1] == END_OF_REPLAY:
                    return
                sequence = int.from_bytes(frames[1], "big", signed=True)
                if until is not None and sequence >= until:
                    continue  # the live batch that asked for this replay comes next
                if self._last is not None and sequence <= self._last:
                    continue
                decoded = self._decoded(frames[2])
                if decoded is not None:
                    self._apply(sequence, *decoded)
        except TimeoutError:
            log.debug("replay from %s timed out", self.source.replay)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                socket.close()
