"""The node's L1 host cache in the simulator: which block hashes the kvstore's arena holds (LRU, a fixed number
of slots), and each rank's view of it as the engine's host tier (the HostCacheTier protocol that
rank_worker/l1/tier.py implements for real).

Only bookkeeping: the time a restore takes is charged by the simulated rank (bytes / measured host
bandwidth); a write-through offload runs off the step's critical path on the GPU, so it costs no step time. With
a pace (offload_blocks_per_step, the engine's l1_offload_mb_per_step) its copies queue as the real tier's do: the
offered blocks pinned in the pool until their copy lands, at most the pace issued a step, landing by the next
step; without one a copy lands at once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

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
        self._trim()

    def reserve(self, count: int) -> None:
        """Slots taken for a rank's reservation (l1_write_through on_evict): out of what stores may use, the least
        recent blocks evicted to make them, as the kvstore's Reserve does."""
        self.capacity_blocks -= count
        self._trim()

    def store_reserved(self, block_hashes: list[bytes]) -> None:
        """Blocks written into reserved slots: the slots count again, holding them (one already held is refreshed
        and its slot goes back to free)."""
        self.capacity_blocks += len(block_hashes)
        self.store(block_hashes)

    def _trim(self) -> None:
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


@dataclass
class _Copy:
    """Blocks on their way to the node cache, pinned in the pool until they land."""

    block_ids: list[int]
    block_hashes: list[bytes]
    to_front: bool  # the horizon's: L0 evicts them next once they land (the real tier's release order)
    lands_at: float = 0.0  # issued: the simulated time its bytes have landed


class RankHostTier:
    """One rank's host tier over the node cache, as the engine's KvCacheManager uses it."""

    def __init__(
        self,
        node: NodeHostCache,
        pool: BlockPool,
        horizon_blocks: int = 0,
        write_through_while_room: bool = False,
        refresh_finished: bool = False,
        offload_blocks_per_step: int | None = None,
        copy_latency_s: float = 0.0,
        exclusive_ideal: bool = False,
        save_evicted: bool = False,
        reserved_slots: int = 0,
    ) -> None:
        self.node = node
        self.pool = pool
        self.horizon = EvictionHorizon(pool, horizon_blocks)
        self.write_through_while_room = write_through_while_room  # l1_write_through while_room, as the real tier
        self.refresh_finished = refresh_finished  # l1_refresh_finished, as the real tier
        self.offload_blocks_per_step = offload_blocks_per_step  # None: a copy lands at once
        self.copy_latency_s = copy_latency_s  # paced: from a copy's issue to its landing (else by the next step)
        self.restored_blocks = 0
        # An upper bound, not a tier that exists: no write-through and no horizon; every block L0 evicts is in the
        # node cache before allocation reuses it, so the tiers hold different blocks (their capacities add up)
        self.exclusive_ideal = exclusive_ideal
        # l1_write_through on_evict, as the real tier: no write-through, the horizon as always, and what L0 evicts and
        # the node lacks copied into slots reserved ahead (reserved_slots, topped up at half by the next step's pump);
        # evictions past them are lost. The ideal is this without a horizon or a limit.
        self.save_evicted = save_evicted or exclusive_ideal
        self.reserved_target = reserved_slots
        self.reserved = 0  # slots in hand
        self.eviction_copies = 0  # exclusive: blocks L0 evicted that the node lacked (each a copy to the host)
        self.unsaved_no_slot = 0  # on_evict: of those, the ones no reserved slot was left for
        if self.save_evicted:
            pool.on_evict = self._on_evict
        self.offloaded_blocks = 0
        self.peak_pinned_blocks = 0  # the most blocks copies in flight held in the pool at once
        self._queued: deque[_Copy] = deque()  # offered, not issued yet (the real tier's _queued)
        self._issued: list[_Copy] = []  # issued this step: landed by the next (poll)
        self._sending: set[bytes] = set()  # hashes queued or issued, not landed

    @property
    def copies_in_flight(self) -> int:
        """Blocks queued or issued and not landed: what they hold of the pool (the rank's l1_copies_in_flight
        counts the issued ones only)."""
        return sum(len(c.block_ids) for c in self._queued) + sum(len(c.block_ids) for c in self._issued)

    @property
    def has_pending(self) -> bool:
        return bool(self._queued or self._issued)

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

    def _on_evict(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Exclusive tiers: what L0 evicts goes to the node cache (those it holds refreshed, the rest copies), in
        eviction order; with a reservation only as many copies as it has slots left."""
        if self.exclusive_ideal:
            self.eviction_copies += sum(1 for h in block_hashes if h not in self.node)
            self.node.store(block_hashes)
            return
        lacking = [h for h in block_hashes if h not in self.node and h not in self._sending]
        saved = set(lacking[: self.reserved])
        self.reserved -= len(saved)
        self.unsaved_no_slot += len(lacking) - len(saved)
        self.eviction_copies += len(saved)
        self.node.store([h for h in block_hashes if h in self.node])  # refreshed first: nothing evicted for them
        self.node.store_reserved([h for h in block_hashes if h in saved])

    def offload(self, block_ids: list[int], block_hashes: list[bytes], *, finished: bool = False) -> None:
        if self.save_evicted:
            return  # L1 takes blocks when L0 evicts them
        if self.write_through_while_room and len(self.node) + len(self._sending) >= self.node.capacity_blocks:
            return  # a full arena keeps what the pools let go (the horizon's offers), as the real tier
        # what the node lacks and is not on its way, as the real tier's view of the kvstore says
        lost = [i for i, h in enumerate(block_hashes) if h not in self.node and h not in self._sending]
        if finished and self.refresh_finished:
            # as the real tier: the blocks the node holds refreshed in an offer of their own first, tail first (the
            # head ends the most recent); refreshing adds nothing, so it evicts nothing before the lost ones go in
            self.node.store([h for h in reversed(block_hashes) if h in self.node])
        if self.offload_blocks_per_step is None:
            self.node.store([block_hashes[i] for i in lost])  # lands at once: no pool block to pin (tests pass none)
            return
        self._send([(block_ids[i], block_hashes[i]) for i in lost], to_front=False)

    def offer_horizon(self) -> None:
        """The real tier's eviction-horizon pass: the node cache refreshes what it holds and is sent the rest,
        ahead of write-through's backlog."""
        if self.exclusive_ideal:
            return
        due = self.horizon.due(self.node.__contains__, self._sending)
        if not due:
            return
        if self.offload_blocks_per_step is None:  # in one store, in the horizon's order: a copy lands at once
            self.node.store([h for _, h in due])
            return
        self.node.store([h for _, h in due if h in self.node])
        self._send([(b, h) for b, h in due if h not in self.node], to_front=True)

    def _send(self, blocks: list[tuple[int, bytes]], *, to_front: bool) -> None:
        """Paced copies only (unpaced, offload and the horizon's pass store at once)."""
        if not blocks:
            return
        copy = _Copy([b for b, _ in blocks], [h for _, h in blocks], to_front)
        for block_id in copy.block_ids:
            self.pool.acquire_cached(block_id)  # L0 must not evict and reuse it while the copy reads it
        self._sending.update(copy.block_hashes)
        if to_front:
            self._queued.appendleft(copy)
        else:
            self._queued.append(copy)
        self.peak_pinned_blocks = max(self.peak_pinned_blocks, self.copies_in_flight)

    def pump(self, now: float = 0.0) -> int:
        """After a step's launch at `now`: the horizon's pass, then issue at most the pace of queued blocks (the
        real tier's pump). Returns the blocks issued. With on_evict, first the reservation topped up once half
        spent (the real tier's Reserve is answered within a step or so)."""
        if self.save_evicted and not self.exclusive_ideal and self.reserved <= self.reserved_target // 2:
            self.node.reserve(self.reserved_target - self.reserved)
            self.reserved = self.reserved_target
        self.offer_horizon()
        budget = self.offload_blocks_per_step or 0
        issued = 0
        while self._queued and budget > 0:
            copy = self._queued[0]
            n = min(budget, len(copy.block_ids))
            lands_at = now + self.copy_latency_s
            self._issued.append(_Copy(copy.block_ids[:n], copy.block_hashes[:n], copy.to_front, lands_at))
            del copy.block_ids[:n], copy.block_hashes[:n]
            if not copy.block_ids:
                self._queued.popleft()
            budget -= n
            issued += n
        return issued

    def block_counts(self) -> dict[str, int]:
        """What the tier moved, in blocks: restored, written (write-through and the horizon's copies), copied at
        eviction (exclusive tiers) and, of those evictions, lost for want of a reserved slot."""
        return {
            "restored": self.restored_blocks,
            "offloaded": self.offloaded_blocks,
            "eviction_copies": self.eviction_copies,
            "unsaved_no_slot": self.unsaved_no_slot,
        }

    @property
    def next_landing(self) -> float | None:
        """When the oldest issued copy lands (None: none issued)."""
        return self._issued[0].lands_at if self._issued else None

    def poll(self, now: float = float("inf")) -> None:
        """The issued copies that have landed by `now`, in issue order (one stream): stored in the node, their
        pool blocks let go (tail first, as the real tier's commit)."""
        while self._issued and self._issued[0].lands_at <= now:
            copy = self._issued.pop(0)
            self.node.store(copy.block_hashes)
            self.pool.release(copy.block_ids[::-1], to_front=copy.to_front)
            self._sending.difference_update(copy.block_hashes)
            self.offloaded_blocks += len(copy.block_ids)

    def known_run(self, block_hashes: list[bytes]) -> int:
        """The real tier's peek for warm-first scheduling: the leading blocks its view says the node holds."""
        return self.node.leading_run(block_hashes)
