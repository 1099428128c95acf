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
