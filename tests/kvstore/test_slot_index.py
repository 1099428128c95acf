"""The slot index alone: states, dedup, LRU eviction, pins (owners, incarnations, TTL), errors, events."""

from __future__ import annotations

import pytest

from contracts.block_hash import BLOCK_HASH_BYTES
from contracts.kv_events import KvEvent, KvEventKind
from kvstore.slot_index import (
    PinOwner,
    SlotIndex,
    SlotRequestError,
    SlotState,
    SlotView,
    UnknownRankError,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def h(n: int) -> bytes:
    return n.to_bytes(BLOCK_HASH_BYTES, "big")


def make_index(num_slots: int = 4, ttl: float = 60.0) -> tuple[SlotIndex, FakeClock]:
    clock = FakeClock()
    index = SlotIndex(num_slots, ttl, clock)
    index.attach("r0", "inc-a")
    index.attach("r1", "inc-b")
    return index, clock


def store(index: SlotIndex, rank: str, *hashes: bytes) -> list[int]:
    slots = index.allocate(rank, list(hashes))
    assert -1 not in slots
    index.commit(rank, slots)
    return slots


def test_allocate_commit_lookup_release_round_trip() -> None:
    index, _ = make_index()
    slots = index.allocate("r0", [h(1), h(2)])
    assert slots == [0, 1]
    assert index.slot(0) == index.slot(0)
    assert index.slot(0).state is SlotState.WRITING and index.slot(0).writer == PinOwner("r0", "inc-a")
    assert index.lookup("r1", [h(1)]) == []  # being written: not visible yet
    index.commit("r0", slots)
    assert index.slot(0).state is SlotState.STORED and index.slot(0).writer is None
    assert index.lookup("r1", [h(1), h(2), h(3)]) == [0, 1]
    assert index.slot(1).readers == 1
    index.release("r1", [0, 1])
    stats = index.stats()
    assert (stats.free_slots, stats.stored_slots, stats.writing_slots, stats.pinned_slots) == (2, 2, 0, 0)
    assert (stats.lookup_blocks, stats.hit_blocks, stats.stored_total) == (4, 2, 2)


def test_allocate_dedups_stored_and_in_flight_hashes_across_ranks() -> None:
    index, _ = make_index()
    store(index, "r0", h(1))
    writing = index.allocate("r0", [h(2)])
    assert index.allocate("r1", [h(1), h(2), h(3)]) == [-1, -1, writing[0] + 1]
    assert index.allocate("r1", [h(4), h(4)]) == [3, -1]  # a repeat within one request too


def test_lookup_returns_the_leading_run_only() -> None:
    index, _ = make_index(num_slots=8)
    store(index, "r0", h(1), h(2), h(4))
    assert index.lookup("r0", [h(1), h(2), h(3), h(4)]) == [0, 1]
    assert index.lookup("r0", [h(9), h(1)]) == []
    assert index.lookup("r0", []) == []


def test_eviction_takes_the_least_recently_used_unpinned_block() -> None:
    index, _ = make_index(num_slots=3)
    store(index, "r0", h(1), h(2), h(3))
    index.drain_events()
    index.release("r0", index.lookup("r0", [h(1)]))  # h1 is now the most recently used
    assert index.allocate("r0", [h(4)]) == [1]  # h2 was least recent
    assert index.slot_of(h(2)) is None and index.slot_of(h(1)) == 0
    assert index.drain_events() == [KvEvent(KvEventKind.REMOVED, (h(2),))]
    assert index.stats().evicted_total == 1


def test_a_block_released_as_restored_is_evicted_first_while_another_reader_pins_it_not() -> None:
    """A reader that copied the blocks into its GPU pool releases them as restored: L1's copy is then the spare
    one and goes to the least recently used end, so L1 keeps the blocks no GPU holds (the rank offers them
    again before its pool evicts them). Released plain (not copied), a block is just read: the recent end."""
    index, _ = make_index(num_slots=4)
    store(index, "r0", h(1), h(2), h(3), h(4))
    index.release("r1", index.lookup("r1", [h(3), h(4)]), restored=True)  # h3, h4 now in r1's pool
    index.release("r0", index.lookup("r0", [h(1)]))  # looked up, not copied: h1 the most recent
    # h4 and h3 go first, the run's tail first (its head stays a prefix longest); h2 (older than h1) next
    assert store(index, "r0", h(5), h(6)) == [3, 2]
    assert index.slot_of(h(3)) is None and index.slot_of(h(4)) is None
    assert store(index, "r0", h(7)) == [1]
    assert index.slot_of(h(1)) == 0
    # a slot another reader still pins is left where its last reader puts it
    slot = index.lookup("r0", [h(1)])
    assert index.lookup("r1", [h(1)]) == slot
    index.release("r1", slot, restored=True)
    index.release("r0", slot)  # the last reader did not copy it: the recent end
    assert store(index, "r0", h(8)) == [3]  # h5, not h1
    assert index.slot_of(h(1)) == 0


def test_a_block_committed_as_held_by_a_gpu_is_evicted_first_until_it_is_offered_again() -> None:
    """Written through while the writer's GPU pool holds the blocks, L1's copy is a spare: committed at the least
    recently used end. The rank offers a block again (Allocate of a stored hash) before its pool evicts it, which
    makes it the most recent: L1 then keeps it over the spares committed since."""
    index, _ = make_index(num_slots=4)
    store(index, "r0", h(1), h(2))  # plain: the most recent end
    index.commit("r0", index.allocate("r0", [h(3), h(4)]), first_to_evict=True)
    assert store(index, "r0", h(5)) == [3]  # h4 (the last spare committed) goes before the older plain h1, h2
    assert index.allocate("r0", [h(3)]) == [-1]  # offered again: now the most recent
    assert store(index, "r0", h(6)) == [0]  # h1, the least recent plain block, not h3
    assert index.slot_of(h(3)) == 2 and index.slot_of(h(1)) is None


def test_allocate_of_a_stored_hash_refreshes_its_lru_position() -> None:
    index, _ = make_index(num_slots=2)
    store(index, "r0", h(1), h(2))
    assert index.allocate("r1", [h(1)]) == [-1]  # touches h1
    assert index.allocate("r1", [h(3)]) == [1]  # so h2 goes
    assert index.slot_of(h(1)) == 0


def test_pinned_blocks_are_never_evicted_and_a_full_arena_answers_minus_one() -> None:
    index, _ = make_index(num_slots=2)
    store(index, "r0", h(1), h(2))
    assert index.lookup("r1", [h(1), h(2)]) == [0, 1]
    assert index.allocate("r0", [h(3)]) == [-1]
    assert index.slot_of(h(1)) == 0 and index.slot_of(h(2)) == 1
    index.release("r1", [1])
    assert index.allocate("r0", [h(3)]) == [1]


def test_writing_slots_are_never_evicted() -> None:
    index, _ = make_index(num_slots=2)
    assert index.allocate("r0", [h(1), h(2)]) == [0, 1]
    assert index.allocate("r1", [h(3)]) == [-1]
    assert index.stats().evicted_total == 0


def test_releasing_a_write_abandons_it() -> None:
    index, _ = make_index()
    slot = index.allocate("r0", [h(1)])[0]
    index.release("r0", [slot])
    assert index.slot(slot).state is SlotState.FREE and index.slot_of(h(1)) is None
    assert index.allocate("r1", [h(1)]) != [-1]  # another rank may write it now
    assert index.drain_events() == []  # never stored, never announced


def test_reader_pins_are_counted_per_owner() -> None:
    index, _ = make_index()
    store(index, "r0", h(1))
    index.lookup("r0", [h(1)])
    index.lookup("r0", [h(1)])
    index.lookup("r1", [h(1)])
    assert index.slot(0).readers == 3
    index.release("r0", [0, 0])
    with pytest.raises(SlotRequestError, match="not pinned by 'r0'"):
        index.release("r0", [0])
    index.release("r1", [0])
    assert index.slot(0).readers == 0 and index.stats().pinned_slots == 0
    assert index.evictable_slots() == [0]


def test_release_of_slots_not_held_is_an_error_and_changes_nothing() -> None:
    index, _ = make_index()
    store(index, "r0", h(1), h(2))
    index.lookup("r1", [h(1)])
    before = index.stats()
    with pytest.raises(SlotRequestError, match="slot 1 is not pinned"):
        index.release("r1", [0, 1])  # 0 is held, 1 is not: neither is released
    with pytest.raises(SlotRequestError, match="released 2 times"):
        index.release("r1", [0, 0])
    with pytest.raises(SlotRequestError, match="out of range"):
        index.release("r1", [4])
    with pytest.raises(SlotRequestError, match="out of range"):
        index.release("r1", [-1])
    assert index.stats() == before and index.slot(0).readers == 1
    with pytest.raises(SlotRequestError, match="not pinned by 'r0'"):
        index.release("r0", [0])  # another rank's pin is not ours to drop


def test_commit_only_own_writing_slots_all_or_nothing() -> None:
    index, _ = make_index()
    mine = index.allocate("r0", [h(1), h(2)])
    theirs = index.allocate("r1", [h(3)])
    with pytest.raises(SlotRequestError, match="not being written by 'r0'"):
        index.commit("r0", [*mine, *theirs])
    with pytest.raises(SlotRequestError, match="appears 2 times"):
        index.commit("r0", [mine[0], mine[0]])
    with pytest.raises(SlotRequestError, match="out of range"):
        index.commit("r0", [99])
    assert index.stats().writing_slots == 3 and index.stats().stored_slots == 0
    index.commit("r0", mine)
    with pytest.raises(SlotRequestError, match="it is stored"):
        index.commit("r0", mine)  # twice


def test_unknown_ranks_must_attach_first() -> None:
    index, _ = make_index()
    for call in (
        lambda: index.allocate("stranger", [h(1)]),
        lambda: index.lookup("stranger", [h(1)]),
        lambda: index.commit("stranger", [0]),
        lambda: index.release("stranger", [0]),
    ):
        with pytest.raises(UnknownRankError, match="call Attach first"):
            call()


def test_a_new_incarnation_drops_the_old_ones_pins() -> None:
    index, _ = make_index()
    store(index, "r0", h(1))
    index.lookup("r0", [h(1)])
    index.lookup("r1", [h(1)])
    writing = index.allocate("r0", [h(2)])
    assert index.attach("r0", "inc-a") == 0  # the same incarnation again: nothing dropped
    assert index.attach("r0", "inc-c") == 2  # one reader pin, one writer pin
    assert index.slot(writing[0]).state is SlotState.FREE and index.slot_of(h(2)) is None
    assert index.slot(0).readers == 1  # r1's pin stays
    with pytest.raises(SlotRequestError):
        index.release("r0", [0])  # the new incarnation holds nothing
    index.release("r1", [0])
    assert index.stats().pinned_slots == 0


def test_pins_older_than_the_ttl_expire() -> None:
    index, clock = make_index(ttl=10.0)
    store(index, "r0", h(1))
    index.lookup("r1", [h(1)])
    writing = index.allocate("r0", [h(2)])[0]
    clock.now += 5
    index.lookup("r1", [h(1)])  # a younger pin on the same slot
    assert index.expire_pins() == 0
    clock.now += 6  # the first two pins are 11 s old, the last one 6 s
    assert index.expire_pins() == 2
    assert index.slot(writing).state is SlotState.FREE
    assert index.slot(0).readers == 1
    clock.now += 5
    assert index.expire_pins() == 1
    assert index.stats().pinned_slots == 0 and index.stats().expired_pins_total == 3
    assert index.evictable_slots() == [0]
    with pytest.raises(SlotRequestError, match="within l1_pin_ttl_secs"):
        index.commit("r0", [writing])


def test_release_drops_the_oldest_reader_pin_first() -> None:
    index, clock = make_index(ttl=10.0)
    store(index, "r0", h(1))
    index.lookup("r1", [h(1)])
    clock.now += 8
    index.lookup("r1", [h(1)])
    index.release("r1", [0])
    clock.now += 5  # the remaining pin is 5 s old: not expired
    assert index.expire_pins() == 0 and index.slot(0).readers == 1


def test_events_are_batched_by_kind_in_order() -> None:
    index, _ = make_index(num_slots=2)
    store(index, "r0", h(1), h(2))
    assert index.drain_events() == [KvEvent(KvEventKind.STORED, (h(1), h(2)))]
    assert index.drain_events() == []
    slots = index.allocate("r0", [h(3), h(4)])  # evicts both
    index.commit("r0", slots)
    assert index.drain_events() == [
        KvEvent(KvEventKind.REMOVED, (h(1), h(2))),
        KvEvent(KvEventKind.STORED, (h(3), h(4))),
    ]
    assert sorted(index.stored_hashes()) == [h(3), h(4)]


def test_stored_hashes_excludes_blocks_being_written() -> None:
    index, _ = make_index()
    store(index, "r0", h(1))
    index.allocate("r0", [h(2)])
    assert index.stored_hashes() == [h(1)]


def test_zero_slots_is_refused() -> None:
    with pytest.raises(ValueError):
        SlotIndex(0, 1.0)


def test_making_room_evicts_blocks_the_request_itself_names_last() -> None:
    index, _ = make_index(num_slots=3)
    store(index, "r0", h(1), h(2), h(3))  # h1 is the least recently used
    assert index.allocate("r0", [h(1), h(4)]) == [-1, 1]  # h2 goes, not h1 (named in the request)
    assert index.slot_of(h(1)) == 0 and index.slot_of(h(2)) is None


# ---- reserved slots: pinned for writing before the caller knows which block goes in ----


def test_reserve_takes_free_slots_then_evicts_the_least_recently_used_block() -> None:
    index, _ = make_index(num_slots=4)
    store(index, "r0", h(1), h(2))
    index.drain_events()
    assert index.reserve("r1", 2) == [2, 3]  # free slots first
    assert index.slot(2) == SlotView(SlotState.WRITING, None, PinOwner("r1", "inc-b"), 0)
    assert index.drain_events() == []
    index.release("r0", index.lookup("r0", [h(1)]))  # h1 is now the most recently used
    assert index.reserve("r1", 3) == [1, 0]  # h2 then h1 go; nothing is left for a third
    assert index.drain_events() == [KvEvent(KvEventKind.REMOVED, (h(2), h(1)))]
    stats = index.stats()
    assert (stats.free_slots, stats.stored_slots, stats.writing_slots, stats.pinned_slots) == (0, 0, 4, 4)
    assert (stats.evicted_total, stats.reserved_total) == (2, 4)
    assert index.reserve("r0", 1) == []  # every slot pinned: reserved slots are never evicted
    assert index.allocate("r0", [h(3)]) == [-1]


def test_a_reserve_renews_the_callers_reserved_pins_and_only_those() -> None:
    index, clock = make_index(num_slots=8, ttl=10.0)
    kept = index.reserve("r0", 2)
    allocated = index.allocate("r0", [h(1)])
    theirs = index.reserve("r1", 1)
    clock.now += 8
    assert index.reserve("r0", 0) == []  # renews alone
    clock.now += 8  # 16 s since the first reserve, 8 since the renewal
    assert index.expire_pins() == 2  # r0's allocated slot and r1's reservation
    assert [index.slot(slot).state for slot in kept] == [SlotState.WRITING] * 2
    assert index.slot(allocated[0]).state is SlotState.FREE and index.slot(theirs[0]).state is SlotState.FREE
    clock.now += 11
    assert index.expire_pins() == 2  # not renewed since: they go too
    assert index.stats().writing_slots == 0 and index.stats().free_slots == 8


def test_a_bound_commit_stores_each_reserved_slot_under_its_hash() -> None:
    index, _ = make_index()
    slots = index.reserve("r0", 2)
    index.commit("r0", slots, block_hashes=[h(7), h(8)])
    assert index.drain_events() == [KvEvent(KvEventKind.STORED, (h(7), h(8)))]
    assert index.slot(slots[0]) == SlotView(SlotState.STORED, h(7), None, 0)
    assert index.lookup("r1", [h(7), h(8)]) == slots
    stats = index.stats()
    assert (stats.stored_slots, stats.writing_slots, stats.pinned_slots, stats.stored_total) == (2, 0, 2, 2)
    assert index.allocate("r1", [h(7)]) == [-1]  # stored like any other block


def test_a_bound_commit_puts_gpu_held_copies_first_to_evict() -> None:
    index, _ = make_index(num_slots=3)
    store(index, "r0", h(1))
    index.commit("r0", index.reserve("r0", 2), first_to_evict=True, block_hashes=[h(2), h(3)])
    assert store(index, "r0", h(4)) == [2]  # h3, the last spare committed, goes before the plain h1
    assert index.slot_of(h(1)) == 0


def test_a_reserved_slot_committed_with_a_hash_l1_already_has_goes_back_to_free() -> None:
    index, _ = make_index(num_slots=6)
    store(index, "r1", h(1))
    writing = index.allocate("r1", [h(2)])  # another rank is writing h2
    index.drain_events()
    slots = index.reserve("r0", 4)
    # h1 stored, h2 being written, h3 new, h3 again: the earlier slot of this commit got there first
    index.commit("r0", slots, block_hashes=[h(1), h(2), h(3), h(3)])
    free, stored = SlotState.FREE, SlotState.STORED
    assert [index.slot(slot).state for slot in slots] == [free, free, stored, free]
    assert index.slot_of(h(1)) == 0 and index.slot_of(h(2)) == writing[0] and index.slot_of(h(3)) == slots[2]
    assert index.drain_events() == [KvEvent(KvEventKind.STORED, (h(3),))]
    stats = index.stats()
    assert (stats.free_slots, stats.stored_slots, stats.writing_slots, stats.pinned_slots) == (3, 2, 1, 1)
    assert (stats.stored_total, stats.duplicate_commits_total) == (2, 3)


def test_releasing_a_reserved_slot_frees_it() -> None:
    index, _ = make_index(num_slots=2)
    slots = index.reserve("r0", 2)
    index.release("r0", [slots[1]])
    assert index.slot(slots[1]) == SlotView(SlotState.FREE, None, None, 0)
    assert index.stats().free_slots == 1 and index.stats().pinned_slots == 1
    assert index.drain_events() == []  # never stored, never announced
    with pytest.raises(SlotRequestError, match="not pinned by 'r1'"):
        index.release("r1", [slots[0]])  # another rank's reservation
    assert index.allocate("r1", [h(1)]) == [slots[1]]


def test_a_new_incarnation_drops_the_old_ones_reservations() -> None:
    index, _ = make_index()
    mine = index.reserve("r0", 2)
    theirs = index.reserve("r1", 1)
    assert index.attach("r0", "inc-c") == 2
    assert [index.slot(slot).state for slot in mine] == [SlotState.FREE, SlotState.FREE]
    assert index.slot(theirs[0]).writer == PinOwner("r1", "inc-b")
    with pytest.raises(SlotRequestError, match="not being written by 'r0'"):
        index.commit("r0", mine, block_hashes=[h(1), h(2)])
    assert index.stats().writing_slots == 1 and index.stats().free_slots == 3


def test_a_bound_commit_checks_every_slot_first_and_changes_nothing_when_one_is_wrong() -> None:
    index, _ = make_index(num_slots=8)
    reserved = index.reserve("r0", 2)
    allocated = index.allocate("r0", [h(1)])
    theirs = index.reserve("r1", 1)
    before = index.stats()
    with pytest.raises(SlotRequestError, match="came from Allocate"):
        index.commit("r0", [*reserved, *allocated], block_hashes=[h(2), h(3), h(4)])  # mixed
    with pytest.raises(SlotRequestError, match="came from Reserve"):
        index.commit("r0", [*allocated, *reserved])  # mixed, without hashes
    with pytest.raises(SlotRequestError, match="came from Reserve"):
        index.commit("r0", reserved, block_hashes=[])  # empty names no block
    with pytest.raises(SlotRequestError, match="came from Allocate"):
        index.commit("r0", allocated, block_hashes=[h(2)])
    with pytest.raises(SlotRequestError, match="1 block_hashes for 2 slots"):
        index.commit("r0", reserved, block_hashes=[h(2)])
    with pytest.raises(SlotRequestError, match="appears 2 times"):
        index.commit("r0", [reserved[0], reserved[0]], block_hashes=[h(2), h(3)])
    with pytest.raises(SlotRequestError, match="not being written by 'r0'"):
        index.commit("r0", [reserved[0], theirs[0]], block_hashes=[h(2), h(3)])
    with pytest.raises(SlotRequestError, match="out of range"):
        index.commit("r0", [8], block_hashes=[h(2)])
    assert index.stats() == before and index.drain_events() == []
    assert index.slot_of(h(2)) is None and index.slot(reserved[0]).state is SlotState.WRITING
    index.commit("r0", reserved, block_hashes=[h(2), h(3)])
    index.commit("r0", allocated)
    assert index.stats().stored_slots == 3


def test_reserve_needs_an_attached_rank() -> None:
    index, _ = make_index()
    with pytest.raises(UnknownRankError, match="call Attach first"):
        index.reserve("stranger", 1)


def test_the_ranks_reservations_together_stay_within_the_limit() -> None:
    index = SlotIndex(16, pin_ttl_s=60.0, reserve_limit=4)
    index.attach("r0", "a")
    index.attach("r1", "b")
    assert len(index.reserve("r0", 3)) == 3
    assert len(index.reserve("r1", 3)) == 1  # 4 of 16 reserved: a quarter
    assert index.reserve("r1", 1) == []
    first = index.reserve("r0", 0)  # a renewal asks for nothing and gets nothing
    assert first == []
