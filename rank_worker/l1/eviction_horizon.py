"""The eviction horizon: which of L0's cache entries to offer L1 again before L0 evicts them, and when.

Write-through alone makes L1 a copy of what L0 holds, in the order the blocks were written: an arena smaller
than the pool then holds only blocks L0 also has, and a session's oldest blocks, written first, leave L1
first, so a session L0 evicts is missing its head there and nothing restores (0 tokens from L1 at 80 agents
on the H200). Offering L1 the entries L0 evicts next, in that order, makes the arena's LRU follow
L0's evictions: it refreshes those it holds and takes those it lost, so what L0 lets go is what L1 keeps
longest, and the two tiers add up instead of overlapping.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from rank_worker.engine.block_pool import BlockPool

MIN_HORIZON_BLOCKS = 1024


def horizon_blocks_for(setting: int | None, step_tokens: int, block_size: int) -> int:
    """The horizon: the setting (l1_eviction_horizon_blocks) or, unset, twice the blocks one step of step_tokens
    can allocate (at least MIN_HORIZON_BLOCKS), so that a pass, every quarter horizon of allocations, comes
    before a step's allocation reaches what was not offered yet."""
    if setting is not None:
        return setting
    return max(MIN_HORIZON_BLOCKS, 2 * -(-step_tokens // block_size))


class EvictionHorizon:
    """Every horizon_blocks // 4 blocks allocated, the cache entries among the next horizon_blocks of the
    pool's free queue not offered yet (or offered and since lost by L1). A quarter: an entry is offered while
    at least three quarters of the horizon still stand between it and eviction."""

    def __init__(self, pool: BlockPool, horizon_blocks: int) -> None:
        self.pool = pool
        self.horizon_blocks = horizon_blocks  # 0: never
        self._mark = pool.allocated_total
        self._offered: set[bytes] = set()  # offered and still in the horizon

    def due(self, in_l1: Callable[[bytes], bool], busy: Container[bytes] = ()) -> list[tuple[int, bytes]]:
        """(block, hash) to offer now, next to be evicted first; none between passes. in_l1: what L1 is known
        to hold; busy: hashes already on their way there."""
        horizon = self.horizon_blocks
        if horizon <= 0 or self.pool.allocated_total - self._mark < max(1, horizon // 4):
            return []
        self._mark = self.pool.allocated_total
        front = self.pool.idle_front(horizon)
        self._offered.intersection_update(h for _, h in front)
        due = [(b, h) for b, h in front if h not in busy and not (h in self._offered and in_l1(h))]
        self._offered.update(h for _, h in due)
        return due

    def offered(self, block_hash: bytes) -> bool:
        """A pass offered this entry and it was still in the horizon at the last pass."""
        return block_hash in self._offered

    def clear(self) -> None:
        """L1 was detached: what was offered to it is forgotten."""
        self._offered.clear()
