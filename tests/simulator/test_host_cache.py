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
