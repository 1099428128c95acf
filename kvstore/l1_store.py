"""The L1 store of one kvstore process (the store side of the node's L1 tier; a rank's side is
rank_worker/l1/tier.py): its arena, the layout the first rank fixes, the slot index and the event feed,
with every request checked before it reaches the index. No gRPC here: the servicer maps these calls and
errors onto the wire.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contracts.block_hash import BLOCK_HASH_BYTES
from contracts.ids import MAX_ID_CHARS
from contracts.kv_event_feed import KvEventFeed
from contracts.kv_events import KvEvent
from kvstore.arena_layout import MAX_SLOTS, SlotLayout, check_layout, plan_layout
from kvstore.slot_index import SlotIndex, SlotIndexStats, UnknownRankError

log = logging.getLogger(__name__)


# The share of the arena the ranks' Reserves may hold together: slots emptied ahead of use, which L1 cannot hold
# blocks in. A rank holds a quarter at most in hand (l1_reserved_slots) and as much again being copied and committed;
# the ranks of a node share the arena.
RESERVE_SHARE = 0.5


class InvalidRequestError(ValueError):
    """A malformed request (wrong hash length, empty rank_id, ...)."""


class StaleArenaError(LookupError):
    """The request names another arena (one of a previous kvstore process): attach again."""


@dataclass(frozen=True)
class ArenaInfo:
    arena_id: str
    path: str
    size_bytes: int


class L1Store:
    def __init__(
        self,
        arena: ArenaInfo,
        pin_ttl_s: float,
        max_slots: int = MAX_SLOTS,
        clock: Callable[[], float] = time.monotonic,
        *,
        evict_restored_first: bool = True,
        evict_written_through_first: bool = False,
        reserve_share: float = RESERVE_SHARE,
    ) -> None:
        self.arena = arena
        self.layout: SlotLayout | None = None
        self.index: SlotIndex | None = None
        self.feed = KvEventFeed(self._stored_hashes)
        # Every batch also goes here (the vLLM-format publisher's publish(), which only queues); None: off.
        self.kv_event_sink: Callable[[list[KvEvent]], None] | None = None
        self._pin_ttl_s = pin_ttl_s
        self._max_slots = max_slots
        self._reserve_share = reserve_share
        self._clock = clock
        # l1_evict_restored_first: a Release marked restored puts its slots at the eviction end (off: just read)
        self._evict_restored_first = evict_restored_first
        # l1_evict_written_through_first: a Commit marked gpu_holds puts its slots at the eviction end (off: newest)
        self._evict_written_through_first = evict_written_through_first

    def attach(self, rank_id: str, incarnation: str, slot_bytes: int, hash_namespace: bytes) -> SlotLayout:
        """Admit a rank to the arena (the first one fixes the layout); a new incarnation drops the old
        one's pins. Raises InvalidRequestError / InvalidAttachError / LayoutMismatchError."""
        _check_name("rank_id", rank_id)
        _check_name("incarnation", incarnation)
        if self.layout is None:
            layout, note = plan_layout(self.arena.size_bytes, slot_bytes, hash_namespace, self._max_slots)
            if note:
                log.warning("arena layout: %s", note)
            self.layout = layout
            reserve_limit = int(layout.num_slots * self._reserve_share)
            self.index = SlotIndex(layout.num_slots, self._pin_ttl_s, self._clock, reserve_limit)
            log.info(
                "arena layout fixed by %s: %d slots of %d bytes, namespace %s",
                rank_id,
                layout.num_slots,
                layout.slot_bytes,
                layout.hash_namespace.hex(),
            )
        else:
            check_layout(self.layout, slot_bytes, hash_namespace)
        assert self.index is not None
        dropped = self.index.attach(rank_id, incarnation)
        if dropped:
            log.info("rank %s restarted (now %s): dropped %d pins of the old one", rank_id, incarnation, dropped)
        return self.layout

    def allocate(self, rank_id: str, arena_id: str, block_hashes: Sequence[bytes]) -> list[int]:
        _check_hashes(block_hashes)
        slots = self._index_for(rank_id, arena_id).allocate(rank_id, block_hashes)
        self._publish()
        return slots

    def reserve(self, rank_id: str, arena_id: str, count: int) -> list[int]:
        """Up to count slots to write blocks named at commit; renews the caller's reserved slots' pins."""
        index = self._index_for(rank_id, arena_id)
        if not 0 <= count <= index.num_slots:
            raise InvalidRequestError(f"count {count} must be 0 to {index.num_slots} (the arena's slots)")
        slots = index.reserve(rank_id, count)
        self._publish()
        return slots

    def commit(
        self,
        rank_id: str,
        arena_id: str,
        slots: Sequence[int],
        *,
        gpu_holds: bool = False,
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        """block_hashes: empty or None for allocated slots, one per slot for reserved ones."""
        if block_hashes:
            _check_hashes(block_hashes)
        first_to_evict = gpu_holds and self._evict_written_through_first
        index = self._index_for(rank_id, arena_id)
        index.commit(rank_id, slots, first_to_evict=first_to_evict, block_hashes=block_hashes)
        self._publish()

    def lookup(self, rank_id: str, arena_id: str, block_hashes: Sequence[bytes]) -> list[int]:
        _check_hashes(block_hashes)
        return self._index_for(rank_id, arena_id).lookup(rank_id, block_hashes)

    def release(self, rank_id: str, arena_id: str, slots: Sequence[int], *, restored: bool = False) -> None:
        restored = restored and self._evict_restored_first
        self._index_for(rank_id, arena_id).release(rank_id, slots, restored=restored)
        self._publish()

    def expire_pins(self) -> int:
        """Drop pins older than l1_pin_ttl_secs; returns how many."""
        if self.index is None:
            return 0
        dropped = self.index.expire_pins()
        self._publish()
        return dropped

    def stats(self) -> SlotIndexStats | None:
        """The index's counters; None until the first rank attaches."""
        return None if self.index is None else self.index.stats()

    def _index_for(self, rank_id: str, arena_id: str) -> SlotIndex:
        if arena_id != self.arena.arena_id:
            raise StaleArenaError(
                f"arena_id {arena_id!r} is not this kvstore's arena {self.arena.arena_id!r} "
                "(the kvstore restarted, its slots are void): attach again"
            )
        if self.index is None:
            raise UnknownRankError(f"rank {rank_id!r} has not attached to this arena: call Attach first")
        return self.index

    def _publish(self) -> None:
        if self.index is not None:
            events = self.index.drain_events()
            self.feed.publish(events)
            if events and self.kv_event_sink is not None:
                try:
                    self.kv_event_sink(events)
                except Exception:
                    log.exception("publishing KV events in vLLM's format failed")

    def _stored_hashes(self) -> list[bytes]:
        return [] if self.index is None else self.index.stored_hashes()


def _check_name(field: str, value: str) -> None:
    if not value or len(value) > MAX_ID_CHARS:
        raise InvalidRequestError(f"{field} must be 1 to {MAX_ID_CHARS} characters")


def _check_hashes(block_hashes: Sequence[bytes]) -> None:
    for position, block_hash in enumerate(block_hashes):
        if len(block_hash) != BLOCK_HASH_BYTES:
            raise InvalidRequestError(
                f"block_hashes[{position}] has {len(block_hash)} bytes; block hashes are {BLOCK_HASH_BYTES} bytes"
            )
