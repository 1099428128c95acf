"""The engine's L1 tier: write-through of full, registered blocks to the kvstore arena, restore on admission.

Offload: a registered block is immutable, so once a sequence's prefill completes (and again when it lets its
blocks go) the blocks this rank has not sent yet are allocated slots, held by a pool reference while the
copy runs (L0 cannot evict and reuse them mid-copy), copied, committed and let go. We write through eagerly
rather than copying at L0 eviction time: eviction happens inside allocation on the step's critical path,
and a write-through copy is off it (a side stream on CUDA), at the price of copying blocks L0 may keep.

Restore: right after the L0 prefix attach, the hashes that follow are looked up; the leading run L1 holds
is copied into fresh pool blocks, which are registered as ordinary L0 cache entries.

An L1 failure only ever costs cache hits: unreachable kvstore -> serve from L0 and attach again every
retry_interval_s; stale arena (kvstore restarted) -> attach again at once. Attaching again runs on a
background thread (the Attach call may wait out its deadline on a hung kvstore, and pinning a large arena
takes a while): the engine thread serves from L0 until the new mapping is ready.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rank_worker.engine.block_pool import BlockPool
from rank_worker.l1.arena import ArenaMapping
from rank_worker.l1.block_copier import BlockCopier, CopyJob
from rank_worker.l1.kvstore_client import KvStoreClient, L1StaleArenaError

log = logging.getLogger(__name__)

DEFAULT_RETRY_INTERVAL_S = 3.0


class L1Tier:
    """Owns the arena mapping, the copier and the bookkeeping of copies in flight; engine thread only."""

    def __init__(
        self,
        client: KvStoreClient,
        kv_cache: torch.Tensor,
        pool: BlockPool,
        hash_namespace: bytes,
        *,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.kv_cache = kv_cache
        self.pool = pool
        self.namespace = hash_namespace
        self.slot_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._arena: ArenaMapping | None = None
        self._copier: BlockCopier | None = None
        self._attacher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l1-attach")
        self._attaching: Future[ArenaMapping] | None = None
        self._next_attach = 0.0
        self._down_reported = False
        # Hashes L1 holds as far as we know (sent by us, restored, or refused as already there), oldest
        # first, capped at the arena's slot count: older ones have likely been evicted since.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._offloads: deque[CopyJob] = deque()  # copied or copying, not yet committed (CUDA)
        self._restores: deque[CopyJob] = deque()  # copying, slots still pinned for reading (CUDA)
        self.restored_blocks = 0
        self.offloaded_blocks = 0
        self.last_error = ""
        # The first attach is waited for (by the worker's load thread), so the worker can log how it went.
        self._attaching = self._attacher.submit(self._open_arena)
        self._attaching.exception()
        self._ready()

    # --- state ---

    @property
    def attached(self) -> bool:
        return self._arena is not None

    @property
    def arena(self) -> ArenaMapping | None:
        return self._arena

    @property
    def copies_in_flight(self) -> int:
        """Blocks held by offloads not yet committed."""
        return sum(len(job.block_ids) for job in self._offloads)

    @property
    def has_pending(self) -> bool:
        return bool(self._offloads or self._restores)

    # --- restore ---

    def restore(self, block_hashes: list[bytes], max_blocks: int) -> list[int]:
        """Pool blocks (one reference each, registered in L0) holding the leading run of block_hashes that L1
        has, at most max_blocks of them; [] when L1 has none or is down."""
        wanted = block_hashes[: min(max_blocks, self.pool.num_free)]
        if not wanted or not self._ready():
            return []
        try:
            arena_id = self._arena_id()
            slots = self.client.lookup(arena_id, wanted)
        except Exception as exc:
            self._go_down(exc)
            return []
        if not slots:
            return []
        assert self._copier is not None
        blocks = self.pool.allocate(len(slots))
        try:
            job = self._copier.restore(slots, blocks)
        except Exception as exc:
            self.pool.release(blocks)
            self._go_down(exc)  # our read pins go when we attach again (a new incarnation)
            return []
        for block_id, block_hash in zip(blocks, wanted, strict=False):
            self.pool.register(block_id, block_hash)
            self._remember(block_hash)
        self.restored_blocks += len(blocks)
        if job.done:
            self._release(arena_id, job.slots)
        else:
            self._restores.append(job)
        return blocks

    def known_run(self, block_hashes: list[bytes]) -> int:
        """How many leading block_hashes L1 holds as far as this rank knows (sent, restored or found there),
        without a call: a hint for scheduling, never a promise (the kvstore may have evicted them since)."""
        if self._arena is None:
            return 0
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._known:
                break
            count += 1
        return count

    def _release(self, arena_id: str, slots: list[int]) -> None:
        if self._arena is None or self._arena.layout.arena_id != arena_id:
            return  # that arena is gone, and its pins with it
        try:
            self.client.release(arena_id, slots)
        except Exception as exc:
            self._go_down(exc)

    # --- offload ---

    def offload(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Send registered blocks L1 does not have yet (block_ids[i] holds block_hashes[i])."""
        fresh = [(b, h) for b, h in zip(block_ids, block_hashes, strict=False) if h not in self._known]
        if not fresh or not self._ready():
            return
        hashes = [h for _, h in fresh]
        try:
            slots = self.client.allocate(self._arena_id(), hashes)
        except Exception as exc:
            self._go_down(exc)
            return
        for block_hash in hashes:
            self._remember(block_hash)  # -1 (already there, or no room) is not worth asking again
        chosen = [(b, h, s) for (b, h), s in zip(fresh, slots, strict=True) if s >= 0]
        if not chosen:
            return
        assert self._copier is not None
        blocks = [b for b, _, _ in chosen]
        for block_id in blocks:
            self.pool.acquire_cached(block_id)  # L0 must not evict and reuse it while the copy reads it
        try:
            job = self._copier.offload(blocks, [s for _, _, s in chosen])
        except Exception as exc:
            self.pool.release(blocks)
            self._go_down(exc)
            return
        job.block_hashes = [h for _, h, _ in chosen]
        if job.done:
            self._commit(job)
        else:
            self._offloads.append(job)

    def _commit(self, job: CopyJob) -> None:
        """Make a finished offload copy visible in L1 and let go of its pool blocks."""
        try:
            if self._arena is not None:
                self.client.commit(self._arena.layout.arena_id, job.slots)
                self.offloaded_blocks += len(job.slots)
        except Exception as exc:  # a stale arena too: the blocks go again after the next attach
            self._go_down(exc)
        finally:
            self.pool.release(job.block_ids)

    # --- copies in flight (CUDA) ---

    def poll(self) -> None:
        """Finish the copies whose bytes have landed: commit offloads, unpin restored slots; adopt a finished
        background attach. Never waits."""
        if self._attaching is not None and self._attaching.done():
            self._ready()
        while self._offloads and self._offloads[0].done:
            self._commit(self._offloads.popleft())
        while self._restores and self._restores[0].done:
            job = self._restores.popleft()
            if self._arena is not None:
                self._release(self._arena.layout.arena_id, job.slots)

    def wait_pending(self) -> None:
        """Block until the oldest copy in flight is done, then finish it (used when the engine is idle)."""
        if self._offloads:
            self._offloads[0].wait()
        elif self._restores:
            self._restores[0].wait()
        self.poll()

    # --- attach, detach ---

    def try_attach(self) -> bool:
        """True when attached. Otherwise adopt a background attach that has finished, or start one when due."""
        return self._ready()

    def _ready(self) -> bool:
        if self._arena is not None:
            return True
        if self._attaching is not None:
            if not self._attaching.done():
                return False
            return self._adopt(self._attaching)
        if self._clock() >= self._next_attach:
            self._attaching = self._attacher.submit(self._open_arena)
        return False

    def _open_arena(self) -> ArenaMapping:
        """Attach thread: ask the kvstore for the arena and map it (pinned, on CUDA)."""
        layout = self.client.attach(self.slot_bytes, self.namespace)
        return ArenaMapping(
            layout, tuple(self.kv_cache.shape[1:]), self.kv_cache.dtype, pin_for_cuda=self.kv_cache.is_cuda
        )

    def _adopt(self, attaching: Future[ArenaMapping]) -> bool:
        self._attaching = None
        try:
            arena = attaching.result()
            self._copier = BlockCopier(self.kv_cache, arena.slots)
        except Exception as exc:
            self._report_down(exc)
            return False
        self._arena = arena
        self._down_reported = False
        self.last_error = ""
        layout = arena.layout
        log.info(
            "L1 attached to the kvstore at %s: arena %s, %.2f GB, %d slots of %d bytes%s",
            self.client.address,
            layout.arena_id,
            layout.arena_bytes / 1e9,
            layout.num_slots,
            layout.slot_bytes,
            " (pinned for CUDA)" if arena.pinned else "",
        )
        return True

    def _arena_id(self) -> str:
        assert self._arena is not None
        return self._arena.layout.arena_id

    def _detach(self) -> None:
        """Forget the arena: wait for copies touching it, let go of their pool blocks, unmap it."""
        if self._copier is not None:
            self._copier.synchronize()
        for job in self._offloads:
            self.pool.release(job.block_ids)  # never committed; the kvstore drops the write pins
        self._offloads.clear()
        self._restores.clear()
        self._known.clear()
        self._copier = None  # first: it views the arena, which can only be unmapped once nothing does
        if self._arena is not None:
            self._arena.close()
        self._arena = None

    def _go_down(self, exc: BaseException) -> None:
        stale = self._arena.layout.arena_id if self._arena is not None else ""
        self._detach()
        if isinstance(exc, L1StaleArenaError):
            # The kvstore restarted (its new arena starts empty): attach to it again now, not after a delay.
            log.info("L1 arena %s is gone (the kvstore restarted): attaching again", stale)
            self._next_attach = 0.0
            self._ready()
        else:
            self._report_down(exc)

    def _report_down(self, exc: BaseException) -> None:
        self._next_attach = self._clock() + self.retry_interval_s
        self.last_error = str(exc) or type(exc).__name__
        if not self._down_reported:
            log.warning(
                "L1 unavailable (%s): serving from L0 only, attaching again every %.0f s",
                self.last_error,
                self.retry_interval_s,
            )
            self._down_reported = True
        else:
            log.debug("L1 still unavailable: %s", self.last_error)

    def _remember(self, block_hash: bytes) -> None:
        self._known[block_hash] = None
        self._known.move_to_end(block_hash)
        limit = self._arena.layout.num_slots if self._arena is not None else 0
        while len(self._known) > limit:
            self._known.popitem(last=False)

    def close(self) -> None:
        """Wait for copies in flight (and an attach under way), unmap the arena, close the connection."""
        self._detach()
        self._attacher.shutdown(wait=True)
        if self._attaching is not None and self._attaching.exception() is None:
            self._attaching.result().close()
        self._attaching = None
        self.client.close()
