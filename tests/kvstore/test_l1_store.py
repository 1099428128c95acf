"""The kvstore's L1 store: the first Attach fixes the layout, later ones must match; arena ids, input checks, events."""

from __future__ import annotations

import asyncio

import pytest

from contracts.block_hash import BLOCK_HASH_BYTES
from contracts.kv_events import KvEvent, KvEventKind
from kvstore.arena_layout import (
    MAX_NAMESPACE_BYTES,
    InvalidAttachError,
    LayoutMismatchError,
    check_layout,
    plan_layout,
)
from kvstore.l1_store import ArenaInfo, InvalidRequestError, L1Store, StaleArenaError
from kvstore.slot_index import SlotRequestError, UnknownRankError

NS = b"n" * 16


def h(n: int) -> bytes:
    return n.to_bytes(BLOCK_HASH_BYTES, "big")


def make_store(arena_bytes: int = 10_000, max_slots: int = 1000, reserve_share: float = 1.0) -> L1Store:
    """A store on a few slots, whose reservations may take them all (production's share is a quarter)."""
    return L1Store(
        ArenaInfo("arena-1", "/dev/shm/kvserve-l1-arena-1", arena_bytes),
        pin_ttl_s=60.0,
        max_slots=max_slots,
        reserve_share=reserve_share,
    )


def test_plan_layout_divides_the_arena_and_caps_the_slot_count() -> None:
    layout, note = plan_layout(10_000, 3_000, NS)
    assert (layout.slot_bytes, layout.num_slots, note) == (3_000, 3, "")
    capped, note = plan_layout(10_000, 10, NS, max_slots=100)
    assert capped.num_slots == 100 and "using the first 100" in note
    with pytest.raises(LayoutMismatchError, match="does not fit"):
        plan_layout(1_000, 3_000, NS)
    with pytest.raises(InvalidAttachError, match="slot_bytes"):
        plan_layout(1_000, 0, NS)
    with pytest.raises(InvalidAttachError, match="hash_namespace"):
        plan_layout(1_000, 10, b"")
    with pytest.raises(InvalidAttachError, match="hash_namespace"):
        plan_layout(1_000, 10, b"x" * (MAX_NAMESPACE_BYTES + 1))


def test_check_layout_names_what_differs() -> None:
    layout, _ = plan_layout(10_000, 1_000, NS)
    check_layout(layout, 1_000, NS)
    with pytest.raises(LayoutMismatchError, match="slot_bytes 2000 differs"):
        check_layout(layout, 2_000, NS)
    with pytest.raises(LayoutMismatchError, match=r"hash_namespace .* differs"):
        check_layout(layout, 1_000, b"m" * 16)


def test_first_attach_fixes_the_layout_and_others_must_match() -> None:
    store = make_store()
    assert store.stats() is None
    layout = store.attach("r0", "a", 1_000, NS)
    assert layout.num_slots == 10 and store.stats() is not None
    assert store.attach("r1", "b", 1_000, NS) == layout
    with pytest.raises(LayoutMismatchError):
        store.attach("r2", "c", 500, NS)
    with pytest.raises(LayoutMismatchError):
        store.attach("r2", "c", 1_000, b"other-namespace!")
    with pytest.raises(InvalidRequestError, match="rank_id"):
        store.attach("", "c", 1_000, NS)
    with pytest.raises(InvalidRequestError, match="incarnation"):
        store.attach("r3", "", 1_000, NS)
    assert store.layout == layout


def test_requests_must_name_this_arena_and_an_attached_rank() -> None:
    store = make_store()
    with pytest.raises(UnknownRankError, match="Attach first"):
        store.allocate("r0", "arena-1", [h(1)])  # nobody attached yet
    store.attach("r0", "a", 1_000, NS)
    with pytest.raises(StaleArenaError, match="attach again"):
        store.allocate("r0", "arena-0", [h(1)])
    with pytest.raises(StaleArenaError):
        store.release("r0", "", [0])
    with pytest.raises(UnknownRankError):
        store.lookup("r9", "arena-1", [h(1)])


def test_hashes_must_be_16_bytes() -> None:
    store = make_store()
    store.attach("r0", "a", 1_000, NS)
    with pytest.raises(InvalidRequestError, match=r"block_hashes\[1\] has 3 bytes"):
        store.allocate("r0", "arena-1", [h(1), b"abc"])
    with pytest.raises(InvalidRequestError):
        store.lookup("r0", "arena-1", [b""])
    assert store.stats().writing_slots == 0  # type: ignore[union-attr]


def test_changes_reach_subscribers_as_batches() -> None:
    async def scenario() -> None:
        store = make_store(arena_bytes=2_000)
        subscription = store.feed.subscribe()  # before the first attach: an empty snapshot
        store.attach("r0", "a", 1_000, NS)
        store.commit("r0", "arena-1", store.allocate("r0", "arena-1", [h(1), h(2)]))
        store.commit("r0", "arena-1", store.allocate("r0", "arena-1", [h(3)]))  # evicts h1
        store.lookup("r0", "arena-1", [h(2)])  # no change, no batch
        batches = [await subscription.get() for _ in range(3)]
        assert [batch.sequence for batch in batches] == [1, 2, 3]
        assert batches[0].events == (KvEvent(KvEventKind.ALL_CLEARED), KvEvent(KvEventKind.STORED, ()))
        assert batches[1].events == (KvEvent(KvEventKind.STORED, (h(1), h(2))),)
        assert batches[2].events == (KvEvent(KvEventKind.REMOVED, (h(1),)),)
        commit_batch = await subscription.get()
        assert commit_batch.events == (KvEvent(KvEventKind.STORED, (h(3),)),)
        late = store.feed.subscribe()
        snapshot = await late.get()
        assert snapshot.events[1].kind is KvEventKind.STORED and set(snapshot.events[1].block_hashes) == {h(2), h(3)}

    asyncio.run(scenario())


@pytest.mark.parametrize("evict_written_through_first", [True, False])
def test_l1_evict_written_through_first_decides_where_a_commit_held_by_a_gpu_puts_its_blocks(
    evict_written_through_first: bool,
) -> None:
    """On (the default), a Commit marked gpu_holds stores its blocks at the eviction end, so the next block evicts
    one of them before an older block no GPU holds; off, a written block is the most recent and the older goes."""
    store = L1Store(
        ArenaInfo("arena-1", "/dev/shm/kvserve-l1-arena-1", 3_000),
        pin_ttl_s=60.0,
        evict_written_through_first=evict_written_through_first,
    )
    store.attach("r0", "a", 1_000, NS)  # 3 slots
    store.commit("r0", "arena-1", store.allocate("r0", "arena-1", [h(1)]))
    store.commit("r0", "arena-1", store.allocate("r0", "arena-1", [h(2), h(3)]), gpu_holds=True)
    store.commit("r0", "arena-1", store.allocate("r0", "arena-1", [h(4)]))  # one block must go
    kept = store.lookup("r0", "arena-1", [h(1)])
    store.release("r0", "arena-1", kept)
    assert (kept != []) is evict_written_through_first, "h1, in no GPU, is kept only while the switch is on"


@pytest.mark.parametrize("evict_restored_first", [True, False])
def test_l1_evict_restored_first_decides_where_a_restored_release_puts_its_blocks(evict_restored_first: bool) -> None:
    """On (the default) a Release marked restored sends its blocks to the eviction end, so filling the arena evicts
    them before an older block nobody copied; off, restored counts as just read and the older block goes first."""
    store = L1Store(
        ArenaInfo("arena-1", "/dev/shm/kvserve-l1-arena-1", 3_000),
        pin_ttl_s=60.0,
        evict_restored_first=evict_restored_first,
    )
    store.attach("r0", "a", 1_000, NS)  # 3 slots
    store.commit("r0", "arena-1", store.allocate("r0", "arena-1", [h(1), h(2), h(3)]))
    store.release("r0", "arena-1", store.lookup("r0", "arena-1", [h(2), h(3)]), restored=True)
    store.commit("r0", "arena-1", store.allocate("r0", "arena-1", [h(4)]))  # one block must go
    kept = store.lookup("r0", "arena-1", [h(1)])
    store.release("r0", "arena-1", kept)
    assert (kept != []) is evict_restored_first, "h1, never copied to a GPU, is kept only while the switch is on"


def test_reserve_then_a_commit_naming_the_blocks_publishes_them() -> None:
    async def scenario() -> None:
        store = make_store(arena_bytes=3_000)
        store.attach("r0", "a", 1_000, NS)  # 3 slots
        store.commit("r0", "arena-1", store.allocate("r0", "arena-1", [h(1), h(2)]))
        subscription = store.feed.subscribe()
        await subscription.get()  # the snapshot
        reserved = store.reserve("r0", "arena-1", 2)  # the free slot, then h1's (the least recently used)
        assert reserved == [2, 0]
        assert (await subscription.get()).events == (KvEvent(KvEventKind.REMOVED, (h(1),)),)
        store.commit("r0", "arena-1", reserved, block_hashes=[h(2), h(3)])  # h2 is there already
        assert (await subscription.get()).events == (KvEvent(KvEventKind.STORED, (h(3),)),)
        assert store.lookup("r0", "arena-1", [h(3)]) == [0]
        stats = store.stats()
        assert stats is not None and (stats.free_slots, stats.stored_slots, stats.duplicate_commits_total) == (1, 2, 1)

    asyncio.run(scenario())


def test_reserve_and_a_bound_commit_are_checked() -> None:
    store = make_store()
    with pytest.raises(UnknownRankError, match="Attach first"):
        store.reserve("r0", "arena-1", 1)
    store.attach("r0", "a", 1_000, NS)  # 10 slots
    with pytest.raises(StaleArenaError):
        store.reserve("r0", "arena-0", 1)
    for count in (-1, 11):
        with pytest.raises(InvalidRequestError, match=r"count -?\d+ must be 0 to 10"):
            store.reserve("r0", "arena-1", count)
    assert store.reserve("r0", "arena-1", 10) == list(range(10))
    with pytest.raises(InvalidRequestError, match=r"block_hashes\[0\] has 3 bytes"):
        store.commit("r0", "arena-1", [0], block_hashes=[b"abc"])
    with pytest.raises(SlotRequestError, match="came from Reserve"):
        store.commit("r0", "arena-1", [0], block_hashes=[])  # the wire's empty list: allocated slots
    store.commit("r0", "arena-1", [0], block_hashes=[h(1)])
    store.release("r0", "arena-1", list(range(1, 10)))
    stats = store.stats()
    assert stats is not None and (stats.stored_slots, stats.free_slots, stats.writing_slots) == (1, 9, 0)


def test_the_ranks_reservations_share_half_the_arena_by_default() -> None:
    store = L1Store(ArenaInfo("arena-1", "/dev/shm/kvserve-l1-arena-1", 40_000), pin_ttl_s=60.0)
    store.attach("r0", "a", 1_000, NS)  # 40 slots
    store.attach("r1", "b", 1_000, NS)
    assert len(store.reserve("r0", "arena-1", 16)) == 16
    assert len(store.reserve("r1", "arena-1", 8)) == 4  # 20 of 40 together
