"""The block pool alone: reference counts, LRU reuse order, eviction of cache entries, events."""

from __future__ import annotations

import pytest

from contracts.kv_events import KvEventKind
from rank_worker.engine.block_pool import BlockPool


def test_released_cached_blocks_stay_findable_until_reused() -> None:
    pool = BlockPool(4, caching=True)
    a, b = pool.allocate(2)
    assert pool.register(a, b"A" * 16) and pool.register(b, b"B" * 16)
    pool.release([b, a])
    assert pool.num_free == 4 and pool.lookup(b"A" * 16) == a
    # Uncached blocks are reused first; cached ones only when nothing else is left, oldest first.
    first_two = pool.allocate(2)
    assert set(first_two).isdisjoint({a, b})
    assert pool.lookup(b"A" * 16) == a
    third = pool.allocate(1)
    assert third == [b]  # released before a, so it is the older entry and goes first
    assert pool.lookup(b"B" * 16) is None and pool.lookup(b"A" * 16) == a
    events = pool.drain_events()
    assert [e.kind for e in events] == [KvEventKind.STORED, KvEventKind.REMOVED]
    assert events[0].block_hashes == (b"A" * 16, b"B" * 16)
    assert events[1].block_hashes == (b"B" * 16,)


def test_acquire_cached_takes_block_out_of_free_queue() -> None:
    pool = BlockPool(2, caching=True)
    (a,) = pool.allocate(1)
    pool.register(a, b"H" * 16)
    pool.release([a])
    pool.acquire_cached(a)
    pool.acquire_cached(a)
    assert pool.num_free == 1 and pool.blocks[a].ref_count == 2
    pool.release([a])
    assert pool.num_free == 1
    pool.release([a])
    assert pool.num_free == 2


def test_duplicate_hash_is_not_registered_twice_and_over_release_is_an_error() -> None:
    pool = BlockPool(3, caching=True)
    a, b = pool.allocate(2)
    assert pool.register(a, b"X" * 16)
    assert not pool.register(b, b"X" * 16)
    assert pool.lookup(b"X" * 16) == a
    pool.release([a, b])
    with pytest.raises(RuntimeError):
        pool.release([a])
    with pytest.raises(RuntimeError):
        pool.allocate(4)


def test_caching_off_never_registers() -> None:
    pool = BlockPool(2, caching=False)
    (a,) = pool.allocate(1)
    assert not pool.register(a, b"Z" * 16)
    assert pool.lookup(b"Z" * 16) is None and pool.drain_events() == []


def test_on_evict_hears_the_hashes_each_allocation_evicts() -> None:
    pool = BlockPool(3, caching=True)
    heard: list[tuple[list[int], list[bytes]]] = []
    pool.on_evict = lambda blocks, hashes: heard.append((blocks, hashes))
    a, b = pool.allocate(2)
    pool.register(a, b"A" * 16)
    pool.register(b, b"B" * 16)
    pool.release([a, b])
    pool.allocate(1)  # the block never used: nothing evicted
    assert heard == []
    pool.allocate(2)  # both cached blocks, the first released first
    assert heard == [([a, b], [b"A" * 16, b"B" * 16])]
