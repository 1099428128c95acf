"""Random sequences of every slot index operation, checked against a model of who holds which pins.

Invariants after every step: each slot in exactly one state and the counts add up to num_slots; the
hash index and the slots agree (a reserved slot has no hash until its commit names one); a pinned slot keeps
its block (never evicted, never reused); pin counts match the model and are never negative; exactly the
stored, unpinned slots are evictable."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from contracts.block_hash import BLOCK_HASH_BYTES
from contracts.kv_events import KvEventKind
from kvstore.slot_index import SlotIndex, SlotRequestError, SlotState

NUM_SLOTS = 5
TTL = 10.0
RANKS = ("r0", "r1", "r2")

ranks = st.sampled_from(RANKS)
hash_ids = st.integers(0, 11)


def h(n: int) -> bytes:
    return n.to_bytes(BLOCK_HASH_BYTES, "big")


class SlotIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.index = SlotIndex(NUM_SLOTS, TTL, clock=lambda: self.now)
        self.incarnation = dict.fromkeys(RANKS, 0)
        for rank in RANKS:
            self.index.attach(rank, "0")
        # The model: who holds what, since when, on which block.
        self.writes: dict[int, tuple[str, float, bytes | None]] = {}  # slot -> (rank, since, hash; None: reserved)
        self.reads: dict[tuple[str, int], list[float]] = {}  # (rank, slot) -> pin times, oldest first
        self.read_hash: dict[int, bytes] = {}  # slot -> hash it held when first pinned for reading

    # ---- operations ----

    @rule(rank=ranks, ids=st.lists(hash_ids, max_size=4))
    def allocate(self, rank: str, ids: list[int]) -> None:
        hashes = [h(i) for i in ids]
        present_before = {block_hash for block_hash in hashes if self.index.slot_of(block_hash) is not None}
        pinned_before = set(self.writes) | {slot for _, slot in self.reads}
        self.drain_events()
        slots = self.index.allocate(rank, hashes)
        assert len(slots) == len(hashes)
        # Making room may evict a stored block the request itself names (last, on a tiny arena): it is
        # then written again.
        evicted = {block_hash for event in self.index.drain_events() for block_hash in event.block_hashes}
        seen: set[bytes] = set()
        for block_hash, slot in zip(hashes, slots, strict=True):
            if block_hash in seen or (block_hash in present_before and block_hash not in evicted):
                assert slot == -1, "a stored or in-flight hash must not be allocated twice"
            if slot != -1:
                assert slot not in pinned_before, "a pinned slot was handed out again"
                self.writes[slot] = (rank, self.now, block_hash)
            seen.add(block_hash)

    @rule(rank=ranks, count=st.integers(0, NUM_SLOTS + 1))
    def reserve(self, rank: str, count: int) -> None:
        pinned_before = set(self.writes) | {slot for _, slot in self.reads}
        free_before = self.index.stats().free_slots
        self.drain_events()
        slots = self.index.reserve(rank, count)
        assert len(slots) <= count and len(set(slots)) == len(slots)
        if len(slots) < count:
            assert self.index.stats().free_slots == 0 and self.index.evictable_slots() == []
        assert not set(slots) & pinned_before, "a pinned slot was handed out again"
        events = self.index.drain_events()
        evicted = max(0, len(slots) - free_before)  # free slots first, then the least recently used blocks
        assert all(event.kind is KvEventKind.REMOVED for event in events)
        assert sum(len(event.block_hashes) for event in events) == evicted
        # the caller's earlier reservations are renewed with the new ones; its allocated slots are not
        for slot, (owner, _, block_hash) in list(self.writes.items()):
            if owner == rank and block_hash is None:
                self.writes[slot] = (owner, self.now, None)
        for slot in slots:
            self.writes[slot] = (rank, self.now, None)

    @rule(rank=ranks, data=st.data())
    def commit_reserved_with_hashes(self, rank: str, data: st.DataObject) -> None:
        mine = sorted(
            slot for slot, (owner, _, block_hash) in self.writes.items() if owner == rank and block_hash is None
        )
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True) if mine else st.just([]))
        hashes = [h(data.draw(hash_ids)) for _ in chosen]
        known = {block_hash for block_hash in hashes if self.index.slot_of(block_hash) is not None}
        expected_stored: list[bytes] = []
        for block_hash in hashes:
            if block_hash not in known:  # else another write or an earlier slot of this commit got there first
                expected_stored.append(block_hash)
                known.add(block_hash)
        self.drain_events()
        self.index.commit(rank, chosen, first_to_evict=data.draw(st.booleans()), block_hashes=hashes)
        stored_events = [event for event in self.index.drain_events() if event.kind is KvEventKind.STORED]
        assert [block_hash for event in stored_events for block_hash in event.block_hashes] == expected_stored
        for slot, block_hash in zip(chosen, hashes, strict=True):
            view = self.index.slot(slot)
            if view.state is SlotState.STORED:
                assert view.block_hash == block_hash and self.index.slot_of(block_hash) == slot
            else:
                assert view.state is SlotState.FREE and self.index.slot_of(block_hash) != slot
            del self.writes[slot]

    @rule(rank=ranks, data=st.data())
    def commit_a_write_of_the_wrong_kind(self, rank: str, data: st.DataObject) -> None:
        """A reserved slot without hashes, an allocated one with a hash, or hashes that do not match the slots."""
        mine = sorted(slot for slot, (owner, _, _) in self.writes.items() if owner == rank)
        if not mine:
            return
        slot = data.draw(st.sampled_from(mine))
        before = self.index.stats()
        with pytest.raises(SlotRequestError):
            if data.draw(st.booleans()):
                self.index.commit(rank, [slot], block_hashes=[h(0), h(1)])
            elif self.writes[slot][2] is None:
                self.index.commit(rank, [slot])
            else:
                self.index.commit(rank, [slot], block_hashes=[h(0)])
        assert self.index.stats() == before

    @rule(rank=ranks, data=st.data())
    def commit_own_writes(self, rank: str, data: st.DataObject) -> None:
        mine = sorted(
            slot for slot, (owner, _, block_hash) in self.writes.items() if owner == rank and block_hash is not None
        )
        chosen = data.draw(st.lists(st.sampled_from(mine), unique=True) if mine else st.just([]))
        # where a commit puts its slots (first_to_evict: a copy the writer's GPU holds) changes no state
        self.index.commit(rank, chosen, first_to_evict=data.draw(st.booleans()))
        for slot in chosen:
            del self.writes[slot]

    @rule(rank=ranks, slot=st.integers(-1, NUM_SLOTS))
    def commit_something_not_written_by_me(self, rank: str, slot: int) -> None:
        if slot in self.writes and self.writes[slot][0] == rank:
            return
        before = self.index.stats()
        with pytest.raises(SlotRequestError):
            self.index.commit(rank, [slot])
        assert self.index.stats() == before

    @rule(rank=ranks, ids=st.lists(hash_ids, max_size=5))
    def lookup(self, rank: str, ids: list[int]) -> None:
        hashes = [h(i) for i in ids]
        slots = self.index.lookup(rank, hashes)
        assert len(slots) <= len(hashes)
        for block_hash, slot in zip(hashes, slots, strict=False):
            assert self.index.slot(slot).block_hash == block_hash
            self.reads.setdefault((rank, slot), []).append(self.now)
            self.read_hash[slot] = block_hash
        if len(slots) < len(hashes):  # the run stopped at a hash that is not stored
            stopped = self.index.slot_of(hashes[len(slots)])
            assert stopped is None or self.index.slot(stopped).state is SlotState.WRITING

    @rule(rank=ranks, data=st.data())
    def release_own_pins(self, rank: str, data: st.DataObject) -> None:
        held = [slot for slot, (owner, _, _) in self.writes.items() if owner == rank]
        held += [slot for (owner, slot), times in self.reads.items() if owner == rank for _ in times]
        chosen = data.draw(st.lists(st.sampled_from(sorted(held)), max_size=len(held)) if held else st.just([]))
        # Cap each slot at the pins held on it.
        capped = Counter(chosen) & Counter(held)
        slots = list(capped.elements())
        # restored (the reader copied them) only moves where an unread slot waits for eviction: no state changes
        self.index.release(rank, slots, restored=data.draw(st.booleans()))
        for slot, count in capped.items():
            if slot in self.writes and self.writes[slot][0] == rank:
                del self.writes[slot]
            else:
                self._drop_reads(rank, slot, count)

    @rule(rank=ranks, slot=st.integers(-1, NUM_SLOTS))
    def release_something_not_held(self, rank: str, slot: int) -> None:
        if (slot in self.writes and self.writes[slot][0] == rank) or (rank, slot) in self.reads:
            return
        before = self.index.stats()
        with pytest.raises(SlotRequestError):
            self.index.release(rank, [slot])
        assert self.index.stats() == before

    @rule(rank=ranks)
    def restart(self, rank: str) -> None:
        self.incarnation[rank] += 1
        expected = sum(1 for owner, _, _ in self.writes.values() if owner == rank)
        expected += sum(len(times) for (owner, _), times in self.reads.items() if owner == rank)
        assert self.index.attach(rank, str(self.incarnation[rank])) == expected
        self.writes = {slot: pin for slot, pin in self.writes.items() if pin[0] != rank}
        for owner, slot in list(self.reads):
            if owner == rank:
                self._drop_reads(owner, slot, len(self.reads[(owner, slot)]))

    @rule(seconds=st.sampled_from([0.5, 3.0, 7.0, 11.0]))
    def time_passes_and_old_pins_expire(self, seconds: float) -> None:
        self.now += seconds
        cutoff = self.now - TTL
        expected = sum(1 for _, since, _ in self.writes.values() if since < cutoff)
        expected += sum(1 for times in self.reads.values() for since in times if since < cutoff)
        assert self.index.expire_pins() == expected
        self.writes = {slot: pin for slot, pin in self.writes.items() if pin[1] >= cutoff}
        for key in list(self.reads):
            self._drop_reads(*key, sum(1 for since in self.reads[key] if since < cutoff))

    @rule()
    def drain_events(self) -> None:
        for event in self.index.drain_events():
            assert event.block_hashes, "an event without hashes"

    def _drop_reads(self, rank: str, slot: int, count: int) -> None:
        times = self.reads[(rank, slot)]
        del times[:count]
        if not times:
            del self.reads[(rank, slot)]
        if not any(pinned == slot for _, pinned in self.reads):
            self.read_hash.pop(slot, None)

    # ---- invariants ----

    @invariant()
    def every_slot_in_exactly_one_state_and_counts_add_up(self) -> None:
        stats = self.index.stats()
        states = Counter(self.index.slot(slot).state for slot in range(NUM_SLOTS))
        assert states[SlotState.FREE] == stats.free_slots
        assert states[SlotState.STORED] == stats.stored_slots
        assert states[SlotState.WRITING] == stats.writing_slots
        assert stats.free_slots + stats.stored_slots + stats.writing_slots == NUM_SLOTS

    @invariant()
    def index_and_slots_agree(self) -> None:
        hashed = 0
        for slot in range(NUM_SLOTS):
            view = self.index.slot(slot)
            if view.state is SlotState.FREE:
                assert view.block_hash is None and view.writer is None and view.readers == 0
            elif view.block_hash is None:  # reserved: being written, its block not named yet
                assert view.state is SlotState.WRITING
            else:
                assert view.block_hash is not None and self.index.slot_of(view.block_hash) == slot
                hashed += 1
            if view.state is SlotState.WRITING:
                assert view.writer is not None and view.readers == 0
            if view.state is SlotState.STORED:
                assert view.writer is None
        stored = self.index.stored_hashes()
        assert len(stored) == len(set(stored)) == self.index.stats().stored_slots
        assert sum(1 for i in range(12) if self.index.slot_of(h(i)) is not None) == hashed

    @invariant()
    def pinned_slots_keep_their_blocks(self) -> None:
        for slot, (rank, _, block_hash) in self.writes.items():
            view = self.index.slot(slot)
            assert view.state is SlotState.WRITING and view.block_hash == block_hash
            assert view.writer is not None and view.writer.rank_id == rank
            assert view.writer.incarnation == str(self.incarnation[rank])
        for slot, block_hash in self.read_hash.items():
            view = self.index.slot(slot)
            assert view.state is SlotState.STORED and view.block_hash == block_hash

    @invariant()
    def pin_counts_match_and_are_never_negative(self) -> None:
        expected = Counter[int]()
        for (_, slot), times in self.reads.items():
            expected[slot] += len(times)
        for slot in range(NUM_SLOTS):
            readers = self.index.slot(slot).readers
            assert readers >= 0 and readers == expected[slot]
        pinned = set(self.writes) | {slot for _, slot in self.reads}
        assert self.index.stats().pinned_slots == len(pinned)

    @invariant()
    def exactly_stored_unpinned_slots_are_evictable(self) -> None:
        evictable = self.index.evictable_slots()
        assert len(evictable) == len(set(evictable))
        expected = {
            slot
            for slot in range(NUM_SLOTS)
            if self.index.slot(slot).state is SlotState.STORED and self.index.slot(slot).readers == 0
        }
        assert set(evictable) == expected


SlotIndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_slot_index_state_machine = SlotIndexMachine.TestCase
