"""The node's L1 host cache in the simulator: which block hashes the kvstore's arena holds (LRU, a fixed number
of slots), and each rank's view of it as the engine's host tier (the HostCacheTier protocol that
rank_worker/l1/tier.py implements for real).

Only bookkeeping: the time a restore takes is charged by the simulated rank (bytes / measured host
bandwidth); a write-through offload runs off the step's critical path on the GPU, so it costs nothing here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from rank_worker.engine.block_pool import BlockPool
from rank_worker.l1.eviction_horizon import EvictionHorizon
from rank_worker.l1.host_fetch import HostFetch, hold_prefix


class NodeHostCache:
    """The arena's slot index: hash -> present, least recently used first, evicted beyond capacity."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.stored: list[bytes] = []  # since the last drain (the router's L1 feed)
        self.removed: list[bytes] = []

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def leading_run(self, block_hashes: list[bytes]) -> int:
        run = 0
        for block_hash in block_hashes:
            if block_hash not in self._lru:
                break
            run += 1
        return run

    def store(self, block_hashes: list[bytes]) -> None:
        """Offered blocks (write-through or the horizon's): those held are refreshed, the others stored as the most
        recent, the least recent evicted past capacity: the kvstore's default order (l1_evict_written_through_first
        off)."""
        for block_hash in block_hashes:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
                continue
            self._lru[block_hash] = None
            self.stored.append(block_hash)
        while len(self._lru) > self.capacity_blocks:
            evicted, _ = self._lru.popitem(last=False)
            self.removed.append(evicted)

    def restored(self, block_hashes: list[bytes]) -> None:
        """Copied into a rank's pool: first to evict while it holds them (the kvstore's Release with restored),
        the run's tail first, as the kvstore does."""
        for block_hash in block_hashes:
            self._lru.move_to_end(block_hash, last=False)

    def drain(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) since the last drain."""
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed


class RankHostTier:
    """One rank's host tier over the node cache, as the engine's KvCacheManager uses it."""

    def __init__(
        self,
        node: NodeHostCache,
        pool: BlockPool,
        horizon_blocks: int = 0,
        write_through_while_room: bool = False,
        refresh_finished: bool = False,
    ) -> None:
        self.node = node
        self.pool = pool
        self.horizon = EvictionHorizon(pool, horizon_blocks)
        self.write_through_while_room = write_through_while_room  # l1_write_through while_room, as the real tier
        self.refresh_finished = refresh_finished  # l1_refresh_finished, as the real tier
        self.restored_blocks = 0

    def fetch(self, prefix: list[bytes], block_hashes: list[bytes], room: Callable[[int], int]) -> HostFetch:
        """Restored at once (the real tier answers a step or so later; the rank charges the copy's time)."""
        fetch = HostFetch(list(prefix), list(block_hashes), room, deadline=0.0, done=True)
        found = self.node.leading_run(block_hashes)
        run = min(found, max(room(found), 0), self.pool.num_free)
        held = hold_prefix(self.pool, prefix) if run else None
        if held is None:
            fetch.cut = found if not run else 0
            return fetch
        run = min(run, self.pool.num_free)
        fetch.cut = found - run
        blocks = self.pool.allocate(run)
        for block_id, block_hash in zip(blocks, block_hashes, strict=False):
            self.pool.register(block_id, block_hash)
        self.node.restored(block_hashes[:run])
        self.restored_blocks += run
        fetch.restored.update(blocks)
        fetch.held = held + blocks  # held until the admission takes them, as the rank's tier does
        return fetch

    def abandon(self, fetch: HostFetch) -> None:
        fetch.abandoned = True  # nothing in flight: fetches here are done when they start

    def offload(self, block_ids: list[int], block_hashes: list[bytes], *, finished: bool = False) -> None:
        if self.write_through_while_room and len(self.node) >= self.node.capacity_blocks:
            return  # a full arena keeps what the pools let go (the horizon's offers), as the real tier
        # what the node lacks, as the real tier's view of the kvstore says (a copy lands at once here)
        lost = [h for h in block_hashes if h not in self.node]
        if finished and self.refresh_finished:
            # as the real tier: the blocks the node holds refreshed in an offer of their own first, tail first (the
            # head ends the most recent); refreshing adds nothing, so it evicts nothing before the lost ones go in
            self.node.store([h for h in reversed(block_hashes) if h in self.node])
        self.node.store(lost)

    def offer_horizon(self) -> None:
        """The real tier's eviction-horizon pass: the node cache refreshes what it holds and takes the rest (a
        copy that lands at once here)."""
        due = self.horizon.due(self.node.__contains__)
        if due:
            self.node.store([h for _, h in due])

    def known_run(self, block_hashes: list[bytes]) -> int:
        """The real tier's peek for warm-first scheduling: the leading blocks its view says the node holds."""
        return self.node.leading_run(block_hashes)
