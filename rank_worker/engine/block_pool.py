"""The physical KV blocks: reference counts, the free queue (LRU order) and the hash -> block map.

A block whose reference count drops to zero keeps its hash and waits in the free queue: it is still a
prefix-cache entry until allocation takes it from the front of the queue, which evicts it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from contracts.kv_events import KvEvent, KvEventKind


@dataclass(eq=False)
class KvBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [KvBlock(i) for i in range(num_blocks)]
        self.caching = caching
        # front = next to be reused; cached blocks go to the back so they live longest
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._events: list[KvEvent] = []
        # STORED events carry each block's parent and tokens (vLLM-format KV events want them; off: not paid)
        self.record_stored_tokens = False
        self.allocated_total = 0  # blocks handed out since start: how far eviction has moved down the queue
        # Each allocation's evictions: (blocks, their hashes), heard before the caller gets the blocks, so the L1 tier
        # can queue a copy of what they held ahead of any kernel that writes them (l1_write_through on_evict)
        self.on_evict: Callable[[list[int], list[bytes]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        taken: list[int] = []
        evicted: list[bytes] = []
        evicted_ids: list[int] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                evicted_ids.append(block_id)
                del self._by_hash[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            taken.append(block_id)
        self.allocated_total += count
        if evicted:
            self._events.append(KvEvent(KvEventKind.REMOVED, tuple(evicted)))
            if self.on_evict is not None:
                self.on_evict(evicted_ids, evicted)
        return taken

    def acquire_cached(self, block_id: int) -> None:
        """Take a reference on a cached block (a prefix hit), pulling it out of the free queue if idle."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int], *, to_front: bool = False) -> None:
        """Drop one reference on each block; pass a sequence's blocks tail first so its head lives longest.
        to_front: a block left idle goes back to the front of the queue, next to be reused (the L1 tier's copy
        of a block about to be evicted must not give it a second life in L0)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if to_front or block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)  # no cache value (or kept elsewhere): reuse first

    def idle_front(self, limit: int) -> list[tuple[int, bytes]]:
        """(block, hash) of the cache entries among the first `limit` blocks of the free queue: the next ones
        allocation evicts."""
        front: list[tuple[int, bytes]] = []
        blocks = self.blocks
        for block_id in itertools.islice(self._free, limit):
            block_hash = blocks[block_id].block_hash
            if block_hash is not None:
                front.append((block_id, block_hash))
        return front

    def cached_hashes(self) -> list[bytes]:
        return list(self._by_hash)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash) if self.caching else None

    def cached_run(self, hashes: list[bytes], limit: int | None = None) -> list[int]:
        """The blocks holding the leading run of hashes (at most limit of them) that L0 has: one tight loop,
        since a 100K-token prompt asks for 6K blocks and a per-block call costs a warm request milliseconds."""
        if not self.caching:
            return []
        get = self._by_hash.get
        run: list[int] = []
        for block_hash in hashes if limit is None else hashes[:limit]:
            block_id = get(block_hash)
            if block_id is None:
                break
            run.append(block_id)
        return run

    def register(
        self, block_id: int, block_hash: bytes, parent: bytes | None = None, token_ids: tuple[int, ...] = ()
    ) -> bool:
        """Make a full, computed block a cache entry. False if another block already holds this hash.
        parent and token_ids (the block's chain predecessor, None for a prompt's first block, and its tokens)
        go into the STORED event when given (record_stored_tokens)."""
        if not self.caching or block_hash in self._by_hash:
            return False
        self.blocks[block_id].block_hash = block_hash
        self._by_hash[block_hash] = block_id
        if token_ids:
            self._events.append(KvEvent(KvEventKind.STORED, (block_hash,), parent, token_ids))
        else:
            self._events.append(KvEvent(KvEventKind.STORED, (block_hash,)))
        return True

    def clear_cache(self) -> None:
        """Forget every idle cache entry (blocks in use keep theirs)."""
        dropped = [h for h, b in self._by_hash.items() if self.blocks[b].ref_count == 0]
        for block_hash in dropped:
            self.blocks[self._by_hash.pop(block_hash)].block_hash = None
        if dropped:
            self._events.append(KvEvent(KvEventKind.REMOVED, tuple(dropped)))

    def drain_events(self) -> list[KvEvent]:
        """Events since the last drain, in order, runs of the same kind merged into one event; STORED events
        with tokens merge only along a chain (each block's parent the previous one's hash)."""
        if not self.record_stored_tokens:
            runs: list[tuple[KvEventKind, list[bytes]]] = []  # lists, not tuples: merging stays linear
            for event in self._events:
                if runs and runs[-1][0] is event.kind:
                    runs[-1][1].extend(event.block_hashes)
                else:
                    runs.append((event.kind, list(event.block_hashes)))
            self._events = []
            return [KvEvent(kind, tuple(hashes)) for kind, hashes in runs]
        chains: list[tuple[KvEventKind, list[bytes], bytes | None, list[int]]] = []
        for event in self._events:
            if chains:
                kind, hashes, _, tokens = chains[-1]
                if kind is event.kind and (
                    bool(event.token_ids) == bool(tokens)
                    and (not event.token_ids or hashes[-1] == event.parent_block_hash)
                ):
                    hashes.extend(event.block_hashes)
                    tokens.extend(event.token_ids)
                    continue
            chains.append((event.kind, list(event.block_hashes), event.parent_block_hash, list(event.token_ids)))
        self._events = []
        return [KvEvent(kind, tuple(hashes), parent, tuple(tokens)) for kind, hashes, parent, tokens in chains]
