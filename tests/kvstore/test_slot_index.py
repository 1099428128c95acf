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
