"""The L1 slot index: which block hash lives in which arena slot, who holds it, and what to evict.

Every slot is in exactly one state: free (no block), writing (allocated to one rank, which is copying a
block in, or reserved by one rank for a block it names at commit; not visible to lookups) or stored (a
committed block, visible to lookups). Pins stop a slot from changing under a copy in flight: a writer pin
from Allocate or Reserve until Commit or Release, reader pins (counted per owner) from Lookup until
Release. Stored slots without pins are evictable, least recently used first. A pin belongs to a rank
incarnation; a new incarnation of the rank, or a pin older than the TTL (a copier that died without
releasing), drops it; each Reserve renews its caller's reservations. Not thread-safe: one caller (the
servicer's event loop) at a time.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from contracts.kv_events import KvEvent, KvEventKind


class SlotState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    STORED = "stored"


@dataclass(frozen=True)
class PinOwner:
    rank_id: str
    incarnation: str


class UnknownRankError(LookupError):
    """The rank has not attached (to this arena): it must Attach first."""


class SlotRequestError(ValueError):
    """Slots the caller may not commit or release: out of range, not held by it, or not being written."""


@dataclass(frozen=True)
class SlotView:
    state: SlotState
    block_hash: bytes | None
    writer: PinOwner | None
    readers: int  # reader pins, all owners together


@dataclass(frozen=True)
class SlotIndexStats:
    num_slots: int
    free_slots: int
    stored_slots: int
    writing_slots: int
    pinned_slots: int
    lookup_blocks: int
    hit_blocks: int
    stored_total: int
    evicted_total: int
    expired_pins_total: int
    reserved_total: int  # slots handed out by reserve
    duplicate_commits_total: int  # reserved slots committed with a hash already stored or being written: freed


class _Slot:
    __slots__ = ("block_hash", "readers", "state", "writer", "writer_since")

    def __init__(self) -> None:
        self.state = SlotState.FREE
        self.block_hash: bytes | None = None  # None while free, or writing a reserved slot
        self.writer: PinOwner | None = None
        self.writer_since = 0.0
        self.readers: dict[PinOwner, list[float]] | None = None  # owner -> the time of each of its pins


class SlotIndex:
    """Block hash -> slot for one arena of num_slots slots."""

    def __init__(
        self,
        num_slots: int,
        pin_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        reserve_limit: int | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        # the most slots every rank's reservations may hold together (None: no limit): a reserved slot is one L1
        # emptied ahead of use, and the ranks of a node share the arena
        self.reserve_limit = reserve_limit
        self.pin_ttl_s = pin_ttl_s
        self._clock = clock
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is handed out first
        self._by_hash: dict[bytes, int] = {}  # stored slots and allocated (not reserved) writing ones
        self._lru: OrderedDict[int, None] = OrderedDict()  # stored, unpinned slots; least recent first
        self._pinned: set[int] = set()
        self._incarnations: dict[str, str] = {}
        self._events: list[tuple[KvEventKind, list[bytes]]] = []
        self._writing = 0
        self._stored = 0
        self._lookup_blocks = 0
        self._hit_blocks = 0
        self._stored_total = 0
        self._evicted_total = 0
        self._expired_pins_total = 0
        self._reserved_total = 0
        self._duplicate_commits_total = 0

    # ---- ranks ----

    def attach(self, rank_id: str, incarnation: str) -> int:
        """Record the rank's current incarnation; a new one drops every pin of the previous one (its
        uncommitted writes go back to free). Returns the number of pins dropped."""
        previous = self._incarnations.get(rank_id)
        self._incarnations[rank_id] = incarnation
        if previous is None or previous == incarnation:
            return 0
        old = PinOwner(rank_id, previous)
        return self._drop_pins(lambda owner, since: owner == old)

    def owner(self, rank_id: str) -> PinOwner:
        """The current incarnation of an attached rank; UnknownRankError if it never attached."""
        incarnation = self._incarnations.get(rank_id)
        if incarnation is None:
            raise UnknownRankError(f"rank {rank_id!r} has not attached to this arena: call Attach first")
        return PinOwner(rank_id, incarnation)

    # ---- the slot operations ----

    def allocate(self, rank_id: str, block_hashes: Sequence[bytes]) -> list[int]:
        """A slot to write for each hash, pinned for writing, or -1 when the hash is already stored
        (its LRU position refreshed) or being written, or when nothing is left to evict."""
        owner = self.owner(rank_id)
        now = self._clock()
        # Touch the request's stored blocks first, so making room for its new blocks evicts them last.
        for block_hash in block_hashes:
            existing = self._by_hash.get(block_hash)
            if existing is not None and existing in self._lru:
                self._lru.move_to_end(existing)
        slots: list[int] = []
        for block_hash in block_hashes:
            if block_hash in self._by_hash:
                slots.append(-1)
                continue
            slot = self._take_slot()
            if slot is None:
                slots.append(-1)
                continue
            entry = self._slots[slot]
            entry.state, entry.block_hash = SlotState.WRITING, block_hash
            entry.writer, entry.writer_since = owner, now
            self._by_hash[block_hash] = slot
            self._writing += 1
            self._pinned.add(slot)
            slots.append(slot)
        return slots

    def reserve(self, rank_id: str, count: int) -> list[int]:
        """Up to count slots pinned for writing with no block yet (fewer when nothing is left to evict, or when
        the ranks' reservations together would pass reserve_limit); the caller names their blocks at commit. Also
        renews the pins of every slot the caller holds reserved."""
        owner = self.owner(rank_id)
        now = self._clock()
        reserved = 0  # every rank's, not committed yet
        for slot in self._pinned:
            entry = self._slots[slot]
            if entry.writer is not None and entry.block_hash is None:
                reserved += 1
                if entry.writer == owner:
                    entry.writer_since = now
        if self.reserve_limit is not None:
            count = min(count, max(0, self.reserve_limit - reserved))
        slots: list[int] = []
        while len(slots) < count:
            slot = self._take_slot()
            if slot is None:
                break
            entry = self._slots[slot]
            entry.state, entry.writer, entry.writer_since = SlotState.WRITING, owner, now
            self._writing += 1
            self._pinned.add(slot)
            slots.append(slot)
        self._reserved_total += len(slots)
        return slots

    def commit(
        self,
        rank_id: str,
        slots: Sequence[int],
        *,
        first_to_evict: bool = False,
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        """The caller's written slots become stored blocks (all or none: a bad slot changes nothing), at the most
        recently used end, or with first_to_evict at the least recently used end (a copy its GPU still holds).
        Slots from allocate take no block_hashes (or an empty list); slots from reserve take one hash each, and
        one whose hash is already stored or being written goes back to free instead."""
        owner = self.owner(rank_id)
        bound = bool(block_hashes)
        self._check_range(slots)
        if block_hashes and len(block_hashes) != len(slots):
            raise SlotRequestError(f"{len(block_hashes)} block_hashes for {len(slots)} slots: give one per slot")
        for slot, count in Counter(slots).items():
            entry = self._slots[slot]
            if entry.state is not SlotState.WRITING or entry.writer != owner:
                raise SlotRequestError(
                    f"slot {slot} is not being written by {rank_id!r} (it is {entry.state.value}); "
                    f"commit only slots your Allocate or Reserve returned, before Release and within "
                    f"l1_pin_ttl_secs ({self.pin_ttl_s:g} s)"
                )
            if count > 1:
                raise SlotRequestError(f"slot {slot} appears {count} times in one commit")
            if bound and entry.block_hash is not None:
                raise SlotRequestError(
                    f"slot {slot} came from Allocate, its block already named: commit it without block_hashes, "
                    "apart from reserved slots"
                )
            if not bound and entry.block_hash is None:
                raise SlotRequestError(f"slot {slot} came from Reserve: commit it with the hash of its block")
        for position, slot in enumerate(slots):
            entry = self._slots[slot]
            if block_hashes:
                block_hash = block_hashes[position]
                if block_hash in self._by_hash:  # someone got there first: this copy is a spare
                    self._duplicate_commits_total += 1
                    self._abandon_write(slot)
                    continue
                entry.block_hash = block_hash
                self._by_hash[block_hash] = slot
            entry.state, entry.writer = SlotState.STORED, None
            self._writing -= 1
            self._stored += 1
            self._stored_total += 1
            self._pinned.discard(slot)
            self._lru[slot] = None
            if first_to_evict:
                self._lru.move_to_end(slot, last=False)
            assert entry.block_hash is not None
            self._emit(KvEventKind.STORED, entry.block_hash)

    def lookup(self, rank_id: str, block_hashes: Sequence[bytes]) -> list[int]:
        """Slots of the longest run of stored hashes from the first, each pinned once for reading."""
        owner = self.owner(rank_id)
        now = self._clock()
        slots: list[int] = []
        for block_hash in block_hashes:
            slot = self._by_hash.get(block_hash)
            if slot is None or self._slots[slot].state is not SlotState.STORED:
                break
            entry = self._slots[slot]
            if entry.readers is None:
                entry.readers = {}
            entry.readers.setdefault(owner, []).append(now)
            self._pinned.add(slot)
            self._lru.pop(slot, None)  # back at the most recent end when its last reader releases
            slots.append(slot)
        self._lookup_blocks += len(block_hashes)
        self._hit_blocks += len(slots)
        return slots

    def release(self, rank_id: str, slots: Sequence[int], *, restored: bool = False) -> None:
        """Drop one of the caller's pins per listed slot: a reader pin, or a writer pin (the write is
        abandoned or a reservation given up, and the slot is free again). All or none: a slot the caller does not
        hold changes nothing. restored: the reader copied the blocks into its GPU cache, so a slot it leaves unread
        goes to the least recently used end, first to evict: while a GPU holds the block this copy is the spare one,
        and the rank offers it again (the eviction horizon) before it lets it go. Otherwise the most recent end."""
        owner = self.owner(rank_id)
        self._check_range(slots)
        wanted = Counter(slots)
        for slot, count in wanted.items():
            entry = self._slots[slot]
            held = 1 if entry.writer == owner else len(entry.readers.get(owner, ())) if entry.readers else 0
            if held == 0:
                raise SlotRequestError(
                    f"slot {slot} is not pinned by {rank_id!r}: never returned to it by Allocate, Reserve or Lookup, "
                    f"already released, or its pin expired after l1_pin_ttl_secs ({self.pin_ttl_s:g} s)"
                )
            if count > held:
                raise SlotRequestError(
                    f"slot {slot} is released {count} times but {rank_id!r} holds {held} pin(s) on it"
                )
        for slot, count in wanted.items():
            entry = self._slots[slot]
            if entry.writer == owner:
                self._abandon_write(slot)
                continue
            assert entry.readers is not None
            pins = entry.readers[owner]
            del pins[:count]  # the oldest first: the pins left are the ones furthest from their TTL
            if not pins:
                del entry.readers[owner]
            self._unpin_if_unread(slot, first_to_evict=restored)

    # ---- pins that nobody will release ----

    def expire_pins(self, now: float | None = None) -> int:
        """Drop pins older than pin_ttl_s (their copier died or lost its way); returns how many."""
        cutoff = (self._clock() if now is None else now) - self.pin_ttl_s
        dropped = self._drop_pins(lambda owner, since: since < cutoff)
        self._expired_pins_total += dropped
        return dropped

    def _drop_pins(self, doomed: Callable[[PinOwner, float], bool]) -> int:
        dropped = 0
        for slot in list(self._pinned):
            entry = self._slots[slot]
            if entry.writer is not None:
                if doomed(entry.writer, entry.writer_since):
                    self._abandon_write(slot)
                    dropped += 1
                continue
            assert entry.readers is not None
            for owner in list(entry.readers):
                pins = entry.readers[owner]
                kept = [since for since in pins if not doomed(owner, since)]
                dropped += len(pins) - len(kept)
                if kept:
                    entry.readers[owner] = kept
                else:
                    del entry.readers[owner]
            self._unpin_if_unread(slot)
        return dropped

    # ---- state for Stats, KvEvents and tests ----

    def stats(self) -> SlotIndexStats:
        return SlotIndexStats(
            num_slots=self.num_slots,
            free_slots=len(self._free),
            stored_slots=self._stored,
            writing_slots=self._writing,
            pinned_slots=len(self._pinned),
            lookup_blocks=self._lookup_blocks,
            hit_blocks=self._hit_blocks,
            stored_total=self._stored_total,
            evicted_total=self._evicted_total,
            expired_pins_total=self._expired_pins_total,
            reserved_total=self._reserved_total,
            duplicate_commits_total=self._duplicate_commits_total,
        )

    def slot(self, slot: int) -> SlotView:
        entry = self._slots[slot]
        readers = sum(len(pins) for pins in entry.readers.values()) if entry.readers else 0
        return SlotView(entry.state, entry.block_hash, entry.writer, readers)

    def slot_of(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def stored_hashes(self) -> list[bytes]:
        """Every stored block's hash: the snapshot a late KvEvents subscriber starts from."""
        return [block_hash for block_hash, slot in self._by_hash.items() if self._slots[slot].state is SlotState.STORED]

    def evictable_slots(self) -> list[int]:
        """Stored, unpinned slots, least recently used first."""
        return list(self._lru)

    def drain_events(self) -> list[KvEvent]:
        """STORED / REMOVED events since the last drain, consecutive ones of a kind merged into one."""
        events = [KvEvent(kind, tuple(hashes)) for kind, hashes in self._events]
        self._events.clear()
        return events

    # ---- internals ----

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        entry = self._slots[slot]
        assert entry.block_hash is not None
        self._emit(KvEventKind.REMOVED, entry.block_hash)
        del self._by_hash[entry.block_hash]
        entry.state, entry.block_hash = SlotState.FREE, None
        self._stored -= 1
        self._evicted_total += 1
        return slot

    def _abandon_write(self, slot: int) -> None:
        entry = self._slots[slot]
        assert entry.state is SlotState.WRITING
        if entry.block_hash is not None:  # None: a reserved slot, never named
            del self._by_hash[entry.block_hash]
        entry.state, entry.block_hash, entry.writer = SlotState.FREE, None, None
        self._writing -= 1
        self._pinned.discard(slot)
        self._free.append(slot)

    def _unpin_if_unread(self, slot: int, *, first_to_evict: bool = False) -> None:
        entry = self._slots[slot]
        if not entry.readers:
            entry.readers = None
            self._pinned.discard(slot)
            self._lru[slot] = None  # just read: the most recently used end
            if first_to_evict:
                self._lru.move_to_end(slot, last=False)

    def _check_range(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise SlotRequestError(f"slot {slot} is out of range: this arena has slots 0..{self.num_slots - 1}")

    def _emit(self, kind: KvEventKind, block_hash: bytes) -> None:
        if self._events and self._events[-1][0] is kind:
            self._events[-1][1].append(block_hash)
        else:
            self._events.append((kind, [block_hash]))
