"""The simulator's host tier follows the real one's eviction horizon (rank_worker/l1/eviction_horizon.py)."""

from __future__ import annotations

from rank_worker.engine.block_pool import BlockPool
from simulator.host_cache import NodeHostCache, RankHostTier


def test_the_simulators_host_tier_offers_the_front_in_eviction_order() -> None:
    pool = BlockPool(8, caching=True)
    node = NodeHostCache(capacity_blocks=3)
    tier = RankHostTier(node, pool, horizon_blocks=8)
    blocks = pool.allocate(4)
    hashes = [bytes([i]) * 16 for i in range(4)]
    for block_id, block_hash in zip(blocks, hashes, strict=True):
        pool.register(block_id, block_hash)
    tier.offload(blocks, hashes)  # write-through: the node keeps the last 3 written, the head is gone
    assert hashes[0] not in node
    pool.release(list(reversed(blocks)))
    pool.allocate(4)  # the unused half: the cached blocks are next
    tier.offer_horizon()
    # Offered tail first: the head, evicted from L0 last, is what the node keeps longest.
    assert [h in node for h in hashes] == [True, True, True, False]


def test_a_finished_sequence_refreshes_what_its_restore_demoted_with_refresh_finished() -> None:
    """As the real tier (tests/rank_worker/test_l1_horizon.py): a restore puts the node's copies first to evict;
    with refresh_finished the sequence's end makes them the most recent again, its head last to go."""
    for refresh in (True, False):
        pool = BlockPool(8, caching=True)
        node = NodeHostCache(capacity_blocks=3)
        tier = RankHostTier(node, pool, refresh_finished=refresh)
        session, other = [b"\x01" * 16, b"\x02" * 16], b"\x03" * 16
        tier.offload([0, 1], session)  # written through, then another block
        tier.offload([2], [other])
        node.restored(session)  # a restore's release: first to evict while the pool holds them
        tier.offload([0, 1], session, finished=True)
        node.store([b"\x04" * 16])  # one more: the least recent goes
        assert [h in node for h in [*session, other]] == ([True, True, False] if refresh else [True, False, True])


def test_a_refresh_stores_the_held_blocks_tail_first_then_the_lost_ones_in_order() -> None:
    """As the real tier's offload: the refresh's own offer (held, tail first) goes before the write-through of
    what the node lost since, in the sequence's order; "lost" is read from the node, not the rank's memory."""
    pool = BlockPool(8, caching=True)
    node = NodeHostCache(capacity_blocks=8)
    tier = RankHostTier(node, pool, refresh_finished=True)
    hashes = [bytes([i]) * 16 for i in range(1, 6)]
    tier.offload([0, 1, 2, 3, 4], hashes)
    node.store([bytes([0x10 + i]) * 16 for i in range(6)])  # pushes hashes[0..2] out
    lost = [h for h in hashes if h not in node]
    assert lost == hashes[:3]
    node.drain()
    tier.offload([0, 1, 2, 3, 4], hashes, finished=True)
    stored, _ = node.drain()
    assert stored == lost  # only the lost ones are new copies, in the sequence's order
    # the held ones were refreshed first, so the lost ones, stored after, are the most recent of the five
    order = [h for h in node._lru if h in hashes]
    assert order == [hashes[4], hashes[3], *lost]


def test_write_through_sends_again_what_the_node_lost_as_the_real_tiers_view_says() -> None:
    """The real tier offers what its view of the kvstore lacks, its own earlier copies and restores included; the
    simulator had skipped whatever this rank sent or restored before (what it remembered, not what the node held)."""
    pool = BlockPool(8, caching=True)
    node = NodeHostCache(capacity_blocks=2)
    tier = RankHostTier(node, pool)
    session = [b"\x01" * 16, b"\x02" * 16]
    tier.offload([0, 1], session)
    node.store([b"\x03" * 16, b"\x04" * 16])  # another rank's copies push the session out
    assert tier.known_run(session) == 0
    node.drain()
    tier.offload([0, 1], session)
    assert node.drain()[0] == session
    assert tier.known_run(session) == 2


def _registered(pool: BlockPool, count: int) -> tuple[list[int], list[bytes]]:
    blocks = pool.allocate(count)
    hashes = [bytes([0x20 + i]) * 16 for i in range(count)]
    for block_id, block_hash in zip(blocks, hashes, strict=True):
        pool.register(block_id, block_hash)
    return blocks, hashes


def test_paced_copies_hold_their_blocks_in_the_pool_until_they_land_at_the_pace() -> None:
    """As the real tier (l1_offload_mb_per_step): an offer queues, at most the pace is issued a step, and an issued
    copy's blocks stay pinned (not evictable, still prefix-cache entries) until it lands; an offer already on its
    way is not sent twice."""
    pool = BlockPool(8, caching=True)
    node = NodeHostCache(capacity_blocks=8)
    tier = RankHostTier(node, pool, offload_blocks_per_step=2)
    blocks, hashes = _registered(pool, 5)
    tier.offload(blocks, hashes)
    tier.offload(blocks, hashes)  # on its way: nothing more queued
    assert tier.copies_in_flight == 5 and tier.has_pending
    pool.release(list(reversed(blocks)))  # the sequence ends; the copies still hold every block
    assert pool.num_free == 3
    assert tier.pump() == 2 and tier.pump() == 2  # two steps, two blocks each
    assert len(node) == 0  # issued, none landed yet
    tier.poll()
    assert [h in node for h in hashes] == [True, True, True, True, False]
    assert pool.num_free == 7 and pool.num_cached == 5  # let go, still cached in L0
    assert tier.pump() == 1
    tier.poll()
    assert hashes[4] in node and not tier.has_pending and tier.peak_pinned_blocks == 5
    assert tier.offloaded_blocks == 5


def test_a_paced_copy_lands_after_its_latency() -> None:
    pool = BlockPool(4, caching=True)
    node = NodeHostCache(capacity_blocks=4)
    tier = RankHostTier(node, pool, offload_blocks_per_step=4, copy_latency_s=0.5)
    blocks, hashes = _registered(pool, 2)
    tier.offload(blocks, hashes)
    tier.pump(now=1.0)
    assert tier.next_landing == 1.5
    tier.poll(now=1.4)
    assert len(node) == 0 and tier.has_pending
    tier.poll(now=1.5)
    assert len(node) == 2 and not tier.has_pending


def test_unpaced_copies_land_at_once_and_pin_nothing() -> None:
    pool = BlockPool(4, caching=True)
    node = NodeHostCache(capacity_blocks=4)
    tier = RankHostTier(node, pool)
    blocks, hashes = _registered(pool, 3)
    tier.offload(blocks, hashes)
    assert len(node) == 3 and not tier.has_pending and tier.copies_in_flight == 0


def test_ideal_exclusive_tiers_take_what_l0_evicts_and_nothing_written_through() -> None:
    pool = BlockPool(4, caching=True)
    node = NodeHostCache(capacity_blocks=8)
    tier = RankHostTier(node, pool, horizon_blocks=4, exclusive_ideal=True)
    blocks, hashes = _registered(pool, 3)
    tier.offload(blocks, hashes)
    assert len(node) == 0  # no write-through
    pool.release(list(reversed(blocks)))
    pool.allocate(4)  # evicts the three cached blocks (the free one first)
    tier.offer_horizon()
    assert [h in node for h in hashes] == [True, True, True]


def test_exclusive_tiers_count_as_copies_only_the_evicted_blocks_the_node_lacked() -> None:
    pool = BlockPool(4, caching=True)
    node = NodeHostCache(capacity_blocks=8)
    tier = RankHostTier(node, pool, exclusive_ideal=True)
    blocks, hashes = _registered(pool, 3)
    node.store([hashes[0]])  # the node already has the first (a restore's spare copy)
    pool.release(list(reversed(blocks)))
    pool.allocate(4)
    assert tier.eviction_copies == 2 and all(h in node for h in hashes)


def test_an_unpaced_offload_needs_only_the_hashes() -> None:
    """tests/rank_worker/test_l1_restore_room.py puts a session in L1 with no pool blocks (offload([], hashes))."""
    node = NodeHostCache(capacity_blocks=4)
    tier = RankHostTier(node, BlockPool(4, caching=True))
    tier.offload([], [b"\x01" * 16, b"\x02" * 16])
    assert len(node) == 2


def test_on_evict_saves_into_its_reservation_and_loses_what_is_past_it() -> None:
    """l1_write_through on_evict as the real tier: no write-through; a reservation taken from the node ahead of use
    (its least recent blocks evicted for it), topped up by pump() once half spent; evictions the node lacks saved
    while slots last, the rest lost and counted; the evicted blocks the node holds refreshed, not copied."""
    pool = BlockPool(6, caching=True)
    node = NodeHostCache(capacity_blocks=6)
    node.store([b"old" + bytes(13)])  # the node's least recent block
    tier = RankHostTier(node, pool, save_evicted=True, reserved_slots=6)
    blocks, hashes = _registered(pool, 5)
    tier.offload(blocks, hashes)
    assert len(node) == 1  # nothing written through
    tier.pump()  # the reservation: 6 slots, the old block evicted to make them
    assert tier.reserved == 6 and len(node) == 0 and node.capacity_blocks == 0
    node.store_reserved([hashes[0]])  # as if another rank had saved the first block already
    tier.reserved -= 1
    pool.release(list(reversed(blocks)))
    pool.allocate(6)  # evicts all five: the first held (refreshed), four saved, one slot left
    assert tier.eviction_copies == 4 and tier.unsaved_no_slot == 0 and tier.reserved == 1
    assert all(h in node for h in hashes)
    pool.release(list(range(6)))  # nothing cached in them now
    blocks = pool.allocate(3)
    more = [bytes([0x40 + i]) * 16 for i in range(3)]
    for block_id, block_hash in zip(blocks, more, strict=True):
        pool.register(block_id, block_hash)
    pool.release(list(reversed(blocks)))  # tail first: the tail is evicted first
    pool.allocate(6)  # three evicted, one slot left: the tail saved, two lost
    assert tier.eviction_copies == 5 and tier.unsaved_no_slot == 2
    assert [h in node for h in more] == [False, False, True]
    tier.pump()  # under half: topped up
    assert tier.reserved == 6
