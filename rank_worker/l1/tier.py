"""The engine's L1 tier: write-through of full, registered blocks to the kvstore arena, restore on admission.

No kvstore call runs on the engine thread. The tier's methods submit calls to its worker (l1_calls.py) and
return; answers come back through a Mailbox that poll() drains each step, never waiting:
- Offload: a registered block is immutable, so once a sequence's prefill completes (and again when it lets
  its blocks go) the blocks L1 does not hold yet are sent for slots. When the slots come back, each block
  that still holds its hash (L0 may have evicted it meanwhile) is referenced, copied (a side stream on CUDA,
  a memcpy on the CPU) and let go once copied; then the slots are committed. The copies are paced: pump(),
  called once a step has been launched, issues at most offload_bytes_per_step of them. A step's own
  tokens come back through the same copy engine, and behind a whole prompt's write-through (1.3 GB for 10K
  tokens of an 8B model, ~25 ms of PCIe) a step's read waited with the GPU idle: 1.7 s of a 9.3 s window of
  64 agents on the H200 (bench/probes/trace_gaps.py). Issued after the step's launch, a step's share of
  copies queues behind its tokens and is done within about a step.
- Eviction horizon (eviction_horizon.py): the cache entries L0 evicts next are offered again, so L1 keeps
  what L0 lets go; the kvstore refreshes those it holds and gives slots for those it lost, which are copied
  as write-through blocks are (ahead of them) and go back to the front of L0's free queue once copied. Those L1
  lacks are held from the offer on (L0 evicts them next; unheld, a step's allocations took them before the
  kvstore's answer: the CPU probe's in-flight losses).
- Exclusive tiers (l1_write_through on_evict): nothing is written through; when an allocation evicts a block L1
  lacks, its copy is queued on the compute stream at once (ahead of the kernels of the step that reuses it) into
  a slot the rank reserved ahead (slot_reserve.py), and committed with its hash once it has landed; the blocks L1
  holds are refreshed there instead. L0 and L1 then hold different blocks and their capacities add up.
- Restore: a sequence about to be admitted whose blocks past its L0 prefix L1 holds starts a HostFetch and
  waits; the lookup's slots are copied into fresh pool blocks (on the compute stream on CUDA, so the next
  step's kernels see them), registered in L0, held by the fetch until the admission takes them, and the slots
  released once the copy has landed.
- What L1 holds comes from the kvstore's KV events (kvstore_watch.py), so a rank schedules as warm the
  sessions another rank wrote (after a failover), not only the blocks it moved itself.

An L1 failure only ever costs cache hits: a failed call (an unreachable, hung or slow kvstore: the 1 s
deadline) detaches the tier, which serves from L0 and attaches again every retry_interval_s; a stale arena
(the kvstore restarted) or a kvstore that went away (its event stream ended) detaches it at once, unmapping
the dead arena even while the rank is idle, and it attaches to the new kvstore as soon as that answers.
Attaching runs on a thread of its own (pinning a large arena takes a while).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rank_worker.engine.block_pool import BlockPool
from rank_worker.l1.arena import ArenaMapping
from rank_worker.l1.block_copier import BlockCopier, CopyJob
from rank_worker.l1.eviction_horizon import MIN_HORIZON_BLOCKS, EvictionHorizon
from rank_worker.l1.host_fetch import HostFetch, hold_prefix, release_held
from rank_worker.l1.kvstore_client import KvStoreClient, L1StaleArenaError
from rank_worker.l1.kvstore_watch import KvStoreNews, KvStoreWatch
from rank_worker.l1.l1_calls import CallKind, L1Call, L1Calls, Mailbox
from rank_worker.l1.l1_view import L1View
from rank_worker.l1.slot_reserve import RENEW_INTERVAL_S, SlotReserve

log = logging.getLogger(__name__)

DEFAULT_RETRY_INTERVAL_S = 3.0
DEFAULT_FETCH_TIMEOUT_S = 1.0  # a waiting sequence computes its blocks rather than wait longer for L1
IDLE_WAIT_S = 0.01  # the longest the engine thread waits for an answer when it has nothing to run
# ~10 ms of PCIe Gen5 per step: 4096 tokens of an 8B model's KV, past the prefill a busy step carries.
DEFAULT_OFFLOAD_BYTES_PER_STEP = 512 << 20


@dataclass(frozen=True)
class _Attached:
    future: Future[ArenaMapping]


@dataclass(frozen=True)
class _RetryDue:
    """Posted when a detached tier's next attach is due: an idle engine steps (polls) only for mailbox items."""


@dataclass(frozen=True)
class _RenewDue:
    """Posted every RENEW_INTERVAL_S with on_evict: an idle rank's reserved slots are renewed before their pins'
    TTL (an idle engine polls only for mailbox items)."""


@dataclass(frozen=True, eq=False)
class _Offload:
    block_ids: list[int]
    block_hashes: list[bytes]
    to_front: bool = False  # blocks about to be evicted from L0 (the horizon): back to the front once copied
    # the blocks L1 did not hold when offered: referenced from the offer until the kvstore's answer, else L0 may
    # evict them meanwhile (the horizon's, next in line; write-through's, once their sequence ends) and neither
    # tier keeps them
    pinned: frozenset[int] = frozenset()


@dataclass
class _QueuedCopy:
    """Pool blocks (referenced) bound for arena slots, not issued yet: pump() issues them, a few each step."""

    block_ids: list[int]
    slots: list[int]
    block_hashes: list[bytes]
    to_front: bool = False


class L1Tier:
    """This rank's side of the node's L1 tier (the kvstore's is kvstore.l1_store.L1Store): owns the arena
    mapping, the copier and the bookkeeping of calls and copies in flight; its methods are for the engine
    thread (its own threads only post to the mailbox)."""

    def __init__(
        self,
        client: KvStoreClient,
        kv_cache: torch.Tensor,
        pool: BlockPool,
        hash_namespace: bytes,
        *,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
        offload_bytes_per_step: int = DEFAULT_OFFLOAD_BYTES_PER_STEP,
        eviction_horizon_blocks: int = MIN_HORIZON_BLOCKS,
        write_through_while_room: bool = False,
        refresh_finished: bool = False,
        save_evicted: bool = False,
        reserved_slots: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.kv_cache = kv_cache
        self.pool = pool
        self.namespace = hash_namespace
        self.slot_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self.retry_interval_s = retry_interval_s
        self.fetch_timeout_s = fetch_timeout_s
        # Whole blocks per pump(), at least one so the queue always drains.
        self.offload_blocks_per_step = max(1, offload_bytes_per_step // max(1, self.slot_bytes))
        self.horizon = EvictionHorizon(pool, eviction_horizon_blocks)  # 0 blocks: write-through only
        # l1_write_through while_room: no write-through into a full L1, whose slots then hold what pools let go
        self.write_through_while_room = write_through_while_room
        # l1_refresh_finished: a sequence's end offers L1 its blocks L1 holds too, which refreshes them there
        self.refresh_finished = refresh_finished
        # l1_write_through on_evict: no write-through; what L0 evicts and L1 lacks is copied into reserved slots
        self.save_evicted = save_evicted
        self._clock = clock
        self._reserved_slots = reserved_slots if save_evicted else 0
        self.reserve = SlotReserve(0, clock())  # sized at attach (a share of the arena)
        self._saves: deque[CopyJob] = deque()  # evicted blocks copying into reserved slots, not committed yet
        # evicted blocks L1 holds, to refresh there: one offer a step (an allocation evicts, and there are dozens a
        # step: a call each would queue the restores' lookups behind them on the calls thread)
        self._refresh_due: list[tuple[int, bytes]] = []
        self._arena: ArenaMapping | None = None
        self._copier: BlockCopier | None = None
        self._epoch = 0  # +1 per adopted arena: answers of an older one are void
        self._mailbox = Mailbox()
        self._calls = L1Calls(client, self._mailbox)
        self.view = L1View()
        self._watch = KvStoreWatch(client, self.view, self._mailbox.post)
        self._attacher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l1-attach")
        self._attaching: Future[ArenaMapping] | None = None
        self._next_attach = 0.0
        self._attach_again = False
        self._down_reported = False
        self._retry_timer: threading.Timer | None = None
        self._renew_timer: threading.Timer | None = None
        self._outstanding = 0  # calls of this epoch not answered yet
        self._fetching: list[HostFetch] = []  # waiting for their lookup's answer
        self._sending: set[bytes] = set()  # hashes offered to L1 and not committed or refused yet
        self._pinned_offers: list[_Offload] = []  # offers holding blocks until answered
        self._committing: set[bytes] = set()  # copied into the arena, their commit not answered yet: saved
        self._queued: deque[_QueuedCopy] = deque()  # offloads waiting for pump(), their slots write-pinned
        self._offloads: deque[CopyJob] = deque()  # copying to the arena, not yet committed (CUDA)
        self._restores: deque[CopyJob] = deque()  # copying from the arena, slots still pinned (CUDA)
        self.restored_blocks = 0
        self.offloaded_blocks = 0
        # For the rank's metrics (read at scrape time): bytes copied, and seconds from each copy's issue until
        # this thread saw it complete (on CUDA an upper bound: it includes the wait for the next poll).
        self.restored_bytes = 0
        self.restore_seconds = 0.0
        self.offloaded_bytes = 0
        self.offload_seconds = 0.0
        self.issued_blocks = 0  # offload copies issued (pump), committed or not
        # By their EngineStats names: L0's evictions of cached blocks, and those of them L1 did not hold (as far as
        # the view knew): what the two tiers lost together, by the horizon falling behind or L1 evicting them first;
        # of those, why (the rest L1 took and let go, or refused): still on their way to L1 (offered, not copied
        # yet), or never offered by the horizon (evicted past its passes' reach), and of those, the ones evicted while
        # blocks it offered were held out of the free queue. A block copied and committing counts as saved.
        # Then why a restore brought back less than L1 was known to hold: lookups given up at their deadline, blocks
        # the view promised that the answer lacked, blocks found that the free pool had no room for by then.
        # And offers the kvstore refused a slot for while neither the view nor a commit of ours had the block (no
        # slot to take: every one pinned; or another rank writing it): of the unsaved evictions neither in flight
        # nor unoffered, the part L1 refused rather than took and let go. With on_evict: the evictions L1 lacked that
        # found no reserved slot in hand (an allocation burst past the reservation).
        self._counts = dict.fromkeys(
            (
                "l0_evicted_blocks",
                "l0_evicted_unsaved_blocks",
                "l0_evicted_unsaved_in_flight_blocks",
                "l0_evicted_unsaved_unoffered_blocks",
                "l0_evicted_unsaved_past_held_blocks",
                "l1_fetch_timeouts",
                "l1_restore_missing_blocks",
                "l1_restore_room_cut_blocks",
                "l1_offer_refused_blocks",
                "l0_evicted_unsaved_no_slot_blocks",
            ),
            0,
        )
        pool.on_evict = self._on_l0_evictions
        self.last_error = ""
        # The first attach is waited for (by the worker's load thread), so the worker can log how it went.
        self._start_attach()
        assert self._attaching is not None
        self._attaching.exception()
        self._adopt(self._attaching)
        self._watch.start()
        self._schedule_renew()

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Call wake() (from the tier's threads) whenever the engine thread has something to poll."""
        self._mailbox.wake = wake

    # --- state ---

    @property
    def attached(self) -> bool:
        return self._arena is not None

    @property
    def arena(self) -> ArenaMapping | None:
        return self._arena

    @property
    def copies_in_flight(self) -> int:
        """Blocks held by offloads not yet committed (issued or queued)."""
        return sum(len(job.block_ids) for job in self._offloads) + sum(len(q.block_ids) for q in self._queued)

    @property
    def has_pending(self) -> bool:
        """Calls, copies or news the engine must still step for (its blocks and the kvstore's pins)."""
        return bool(
            self._outstanding
            or self._fetching
            or self._queued
            or self._offloads
            or self._restores
            or self._saves
            or self._mailbox
        )

    def known_run(self, block_hashes: list[bytes]) -> int:
        """How many leading block_hashes L1 holds as far as its event stream says, asking no one: a hint for
        scheduling, never a promise (the kvstore may evict them before the lookup)."""
        return self.view.leading_run(block_hashes) if self._arena is not None else 0

    # --- restore ---

    def fetch(self, prefix: list[bytes], block_hashes: list[bytes], room: Callable[[int], int]) -> HostFetch | None:
        """Start looking up block_hashes (those after a sequence's L0 prefix, `prefix`); None when L1 is not
        attached. The fetch is done once answered, failed or timed out."""
        if not block_hashes or not self._ready():
            return None
        held = hold_prefix(self.pool, prefix)
        if held is None:  # (the caller found it in L0 just now)
            return None
        fetch = HostFetch(list(prefix), list(block_hashes), room, self._clock() + self.fetch_timeout_s, held=held)
        fetch.expected = self.view.leading_run(block_hashes)
        self._submit(CallKind.LOOKUP, hashes=fetch.hashes, purpose=fetch)
        self._fetching.append(fetch)
        return fetch

    def abandon(self, fetch: HostFetch) -> None:
        """The sequence is gone: its lookup's slots are released when the answer comes."""
        fetch.abandoned = True
        self._fail_fetch(fetch)

    def _on_lookup(self, call: L1Call, fetch: HostFetch) -> None:
        slots = call.answer
        if not fetch.done:
            self._counts["l1_restore_missing_blocks"] += max(fetch.expected - len(slots), 0)
        if fetch.done or not slots:  # given up (timed out, abandoned) or nothing there
            self._fail_fetch(fetch)  # its prefix let go, if it was not already
            self._release(slots)
            return
        held, fetch.held = fetch.held, []  # the prefix, referenced since the lookup began
        self._fail_fetch(fetch)  # done, whatever comes of it now
        wanted = min(len(slots), max(fetch.room(len(slots)), 0))
        copy_slots: list[int] = []
        new_hashes: list[bytes] = []
        in_pool: list[int] = []  # slots of blocks the pool holds already: released as restored too
        for block_hash, slot in zip(fetch.hashes[:wanted], slots[:wanted], strict=True):
            existing = self.pool.lookup(block_hash)
            if existing is not None:  # computed here meanwhile: no copy, but kept while blocks are taken
                self.pool.acquire_cached(existing)
                held.append(existing)
                in_pool.append(slot)
            else:
                copy_slots.append(slot)
                new_hashes.append(block_hash)
        self._release(in_pool, restored=True)
        spare = slots[wanted:]  # every slot before it is copied or in the pool already
        if copy_slots and len(copy_slots) <= self.pool.num_free:
            assert self._copier is not None
            blocks = self.pool.allocate(len(copy_slots))
            try:
                job = self._copier.restore(copy_slots, blocks)
            except Exception as exc:
                self.pool.release(blocks + held)
                self._go_down(exc)  # our read pins go when we attach again (a new incarnation)
                return
            for block_id, block_hash in zip(blocks, new_hashes, strict=True):
                self.pool.register(block_id, block_hash)
            held.extend(blocks)
            fetch.restored.update(blocks)
            self.restored_blocks += len(blocks)
            if job.done:
                self._restored(job)
                self._release(copy_slots, restored=True)
            else:  # on the compute stream: whoever reuses these blocks queues behind the copy
                self._restores.append(job)
        else:
            spare.extend(copy_slots)
        fetch.cut = len(spare)
        self._counts["l1_restore_room_cut_blocks"] += len(spare)  # found, not restored: the pool had no room
        fetch.held = held  # until the admission takes them (host_fetch.py): idle, the same burst evicted them
        self._release(spare)

    def _release(self, slots: list[int], *, restored: bool = False) -> None:
        """restored: the slots' blocks are in the pool now (the kvstore evicts its copies first meanwhile)."""
        if slots and self._arena is not None:
            self._submit(CallKind.RELEASE, slots=slots, restored=restored)

    # --- offload ---

    def _on_l0_evictions(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """L0 evicted these cached blocks (the pool's on_evict): with on_evict saved first (their blocks are not
        written yet), then counted, and those L1 does not hold apart."""
        if self._arena is None:
            return
        if self.save_evicted:
            self._save_evicted(block_ids, block_hashes)
        counts = self._counts
        counts["l0_evicted_blocks"] += len(block_hashes)
        held: bool | None = None  # asked once, at the first unoffered block
        for block_hash in block_hashes:
            if block_hash in self.view or block_hash in self._committing:
                continue
            counts["l0_evicted_unsaved_blocks"] += 1
            if block_hash in self._sending:
                counts["l0_evicted_unsaved_in_flight_blocks"] += 1
            elif not self.horizon.offered(block_hash):
                counts["l0_evicted_unsaved_unoffered_blocks"] += 1
                if held is None:
                    held = self._holding_horizon_blocks()
                counts["l0_evicted_unsaved_past_held_blocks"] += held

    def _save_evicted(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Exclusive tiers: copy the evicted blocks L1 lacks into reserved slots, on the compute stream before the
        caller gets the blocks (so before any kernel that writes them), and refresh those L1 holds, which L0 has
        just let go: the most recent there, as a block L1 took at this moment would be."""
        lacking: list[tuple[int, bytes]] = []
        held: list[tuple[int, bytes]] = []
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if block_hash in self._committing or block_hash in self._sending:
                continue  # on its way to L1 already (a refresh in flight, or a copy landing)
            (held if block_hash in self.view else lacking).append((block_id, block_hash))
        self._refresh_due.extend(held)  # offered by the next pump()
        slots = self.reserve.take(len(lacking))
        self._counts["l0_evicted_unsaved_no_slot_blocks"] += len(lacking) - len(slots)
        if not slots:
            return
        assert self._copier is not None
        saved = lacking[: len(slots)]
        try:
            job = self._copier.save([b for b, _ in saved], slots)
        except Exception as exc:
            self._go_down(exc)
            return
        job.block_hashes = [h for _, h in saved]
        self._committing.update(job.block_hashes)  # from here on it counts as saved
        self.issued_blocks += len(slots)
        self._saves.append(job)  # committed by the next poll() that finds it landed (on the CPU: the next)

    def _commit_saves(self) -> None:
        """The landed saves, in one Commit: the kvstore binds each slot to its hash (a slot whose hash another copy
        stored first goes back to free there). Their pool blocks were never the tier's to let go."""
        landed: list[CopyJob] = []
        while self._saves and self._saves[0].done:
            landed.append(self._saves.popleft())
        if not landed:
            return
        now = time.perf_counter()
        merged = CopyJob([], [])
        for job in landed:
            merged.block_ids += job.block_ids
            merged.slots += job.slots
            merged.block_hashes += job.block_hashes
            self.offload_seconds += now - job.issued_at
        self.offloaded_bytes += len(merged.slots) * self.slot_bytes
        self._submit(CallKind.COMMIT, slots=merged.slots, hashes=merged.block_hashes, purpose=merged)

    def _offer_refreshes(self) -> None:
        """Offer L1 the evicted blocks it holds (on_evict), gathered since the last pump(): the most recent there
        now, as a block it took at their eviction would be. Only those L1 still holds as far as the view knows: the
        pool blocks are reused, so none may be pinned (an answer with a slot, L1 having let one go since the view
        heard, finds its block reused and releases the slot)."""
        due, self._refresh_due = self._refresh_due, []
        due = [(b, h) for b, h in due if h in self.view and h not in self._sending]
        if due and self._arena is not None:
            self._offer(due, to_front=True)

    def _ask_reserve(self) -> None:
        """Top the reservation up (or renew it) when due; the answer comes through the mailbox."""
        if self._arena is None:
            return
        now = self._clock()
        count = self.reserve.wanted(now)
        if count is None:
            return
        self.reserve.asked(now, count)
        self._submit(CallKind.RESERVE, count=count, purpose=self.reserve)

    def _holding_horizon_blocks(self) -> bool:
        """Blocks the eviction horizon offered are out of the free queue: held for the kvstore's answer, queued for
        their copy or being copied. An allocation then takes the blocks behind them, which no pass offered yet. On
        the H100 with l1_write_through while_room L0 evicted 16-24K never-offered blocks at 40 agents; this tells
        whether they went past held offers or past the last pass's reach."""
        return (
            any(offer.to_front for offer in self._pinned_offers)
            or any(queued.to_front for queued in self._queued)
            or any(job.to_front for job in self._offloads)
        )

    def counts(self) -> dict[str, int]:
        """The L0 eviction and restore counters, by their EngineStats names."""
        return dict(self._counts)

    def offload(self, block_ids: list[int], block_hashes: list[bytes], *, finished: bool = False) -> None:
        """Send registered blocks L1 does not have yet (block_ids[i] holds block_hashes[i]); finished (their
        sequence ended) with refresh_finished: those L1 holds as well, which its Allocate moves to the most
        recently used end (no copy: the answer is -1) and, where L1 let one go since the view heard, copies.
        Nothing with on_evict: L1 takes blocks as L0 evicts them."""
        # first: once L1 is full that is every call, and a prompt has 6K blocks
        if self.save_evicted or self._full_for_write_through():
            return
        refresh = finished and self.refresh_finished
        fresh: list[tuple[int, bytes]] = []
        held: list[tuple[int, bytes]] = []  # the refresh: a call of its own, nothing in it pinned (L1 holds it all)
        for block_id, block_hash in zip(block_ids, block_hashes, strict=False):
            if block_hash in self._sending:
                continue
            if block_hash not in self.view:
                fresh.append((block_id, block_hash))
            elif refresh:
                held.append((block_id, block_hash))
        held.reverse()  # tail first: Allocate touches in order, so the head ends the most recent (L1 keeps a prefix)
        if not (fresh or held) or not self._ready():
            return
        for offer in (held, fresh):
            if offer:
                self._offer(offer, to_front=False)

    def _full_for_write_through(self) -> bool:
        """l1_write_through while_room and L1 full as far as this rank knows: the blocks its event stream says are
        stored (every rank's) and this rank's own on their way fill every slot, so a write-through copy would evict
        a block no pool may hold for one a pool does."""
        if not self.write_through_while_room or self._arena is None:
            return False
        return len(self.view) + len(self._sending) >= self._arena.layout.num_slots

    def _offer(self, blocks: list[tuple[int, bytes]], *, to_front: bool) -> None:
        hashes = [h for _, h in blocks]
        self._sending.update(hashes)
        pinned = frozenset(b for b, h in blocks if h not in self.view)
        for block_id in pinned:
            self.pool.acquire_cached(block_id)
        offload = _Offload([b for b, _ in blocks], hashes, to_front, pinned)
        if pinned:
            self._pinned_offers.append(offload)
        self._submit(CallKind.ALLOCATE, hashes=hashes, purpose=offload)

    def _unpin(self, offload: _Offload, keep: Collection[int] = ()) -> None:
        """An offer answered (or void): let go of its pinned blocks but those now bound for a copy (`keep`)."""
        if not offload.pinned:
            return
        self._pinned_offers.remove(offload)
        # tail first, as a sequence lets go of its blocks: a write-through offer's head stays in L0 longest
        let_go = [b for b in reversed(offload.block_ids) if b in offload.pinned and b not in keep]
        self.pool.release(let_go, to_front=offload.to_front)

    def _offer_horizon(self) -> None:
        """Offer L1 the cache entries L0 evicts next (eviction_horizon.py), when a pass is due."""
        if self._arena is None:
            return
        due = self.horizon.due(self.view.__contains__, self._sending)
        if due:
            self._offer(due, to_front=True)

    def _on_allocate(self, call: L1Call, offload: _Offload) -> None:
        blocks: list[int] = []
        slots: list[int] = []
        hashes: list[bytes] = []
        abandoned: list[int] = []
        for block_id, block_hash, slot in zip(offload.block_ids, offload.block_hashes, call.answer, strict=True):
            if slot < 0:  # already there (or being written), or no room: not ours to send
                self._sending.discard(block_hash)
                if block_hash not in self.view and block_hash not in self._committing:
                    self._counts["l1_offer_refused_blocks"] += 1
            elif self.pool.blocks[block_id].block_hash != block_hash:  # evicted from L0 while we asked
                self._sending.discard(block_hash)
                abandoned.append(slot)
            else:
                blocks.append(block_id)
                slots.append(slot)
                hashes.append(block_hash)
        self._release(abandoned)  # a released write pin abandons the write
        kept = set(blocks) & offload.pinned  # referenced since the offer: that reference is the copy's now
        self._unpin(offload, kept)
        if not blocks:
            return
        assert self._copier is not None
        for block_id in blocks:
            if block_id not in kept:
                self.pool.acquire_cached(block_id)  # L0 must not evict and reuse it while the copy reads it
        queued = _QueuedCopy(blocks, slots, hashes, offload.to_front)
        if offload.to_front:
            self._queued.appendleft(queued)  # about to be evicted from L0: copied before write-through's backlog
        else:
            self._queued.append(queued)  # the engine's next step pumps it

    def pump(self) -> None:
        """Issue queued offload copies, at most offload_blocks_per_step blocks of them; call it after the step's
        launch, so on CUDA its tokens' copy goes first. Never waits for a CUDA copy (a CPU copy is done when it
        returns, and is paced all the same: a CPU step never stalls behind a whole prompt's memcpy either).
        First, when due, the eviction horizon's offer and the reservation's top-up."""
        self._offer_horizon()
        self._offer_refreshes()
        self._ask_reserve()
        budget = self.offload_blocks_per_step
        while self._queued and self._copier is not None and budget > 0:
            queued = self._queued[0]
            n = min(budget, len(queued.block_ids))
            blocks, slots, hashes = queued.block_ids[:n], queued.slots[:n], queued.block_hashes[:n]
            try:
                job = self._copier.offload(blocks, slots)
            except Exception as exc:
                self._go_down(exc)  # lets go of every queued block, these too
                return
            del queued.block_ids[:n], queued.slots[:n], queued.block_hashes[:n]
            if not queued.block_ids:
                self._queued.popleft()
            budget -= n
            self.issued_blocks += n
            job.block_hashes = hashes
            job.to_front = queued.to_front
            if job.done:
                self._commit(job)
            else:
                self._offloads.append(job)

    def _restored(self, job: CopyJob) -> None:
        self.restored_bytes += len(job.slots) * self.slot_bytes
        self.restore_seconds += time.perf_counter() - job.issued_at

    def _commit(self, job: CopyJob) -> None:
        """A finished offload copy: let go of its pool blocks and make it visible in L1."""
        self.offloaded_bytes += len(job.slots) * self.slot_bytes
        self.offload_seconds += time.perf_counter() - job.issued_at
        # tail first, as _unpin: idle now, a write-through copy's head stays in L0 longest, a horizon copy keeps its
        # order at the front
        self.pool.release(job.block_ids[::-1], to_front=job.to_front)
        self._committing.update(job.block_hashes)
        # write-through (not the horizon's copies, which L0 evicts next): the pool keeps these blocks cached
        self._submit(CallKind.COMMIT, slots=job.slots, purpose=job, gpu_holds=not job.to_front)

    def _on_commit(self, job: CopyJob) -> None:
        self.offloaded_blocks += len(job.slots)
        self.view.add(job.block_hashes)
        self._sending.difference_update(job.block_hashes)
        self._committing.difference_update(job.block_hashes)

    # --- the engine thread's turn ---

    def poll(self) -> None:
        """Take what the tier's threads posted (answers, kvstore news, a finished attach), finish the copies
        whose bytes have landed, give up fetches past their deadline. Never waits."""
        for item in self._mailbox.take():
            if isinstance(item, L1Call):
                self._on_answer(item)
            elif isinstance(item, KvStoreNews):
                self._on_news(item)
            elif isinstance(item, _Attached) and item.future is self._attaching:
                self._adopt(item.future)
            elif isinstance(item, _RetryDue):
                self._next_attach = 0.0  # due by its timer (whatever self._clock says): _ready below attaches
            elif isinstance(item, _RenewDue):
                self._ask_reserve()
                self._schedule_renew()
        while self._offloads and self._offloads[0].done:
            self._commit(self._offloads.popleft())
        self._commit_saves()
        while self._restores and self._restores[0].done:
            job = self._restores.popleft()
            self._restored(job)
            self._release(job.slots, restored=True)
        if self._arena is None:
            self._ready()  # a busy rank attaches again once due, without waiting for its next L1 call
        now = self._clock()
        for fetch in [f for f in self._fetching if now >= f.deadline]:
            log.debug("L1 lookup of %d blocks unanswered after %.1f s: computing them", len(fetch.hashes), now)
            self._counts["l1_fetch_timeouts"] += 1
            self._fail_fetch(fetch)  # its answer, if it comes, is released

    def wait_pending(self) -> None:
        """The engine has nothing to run: wait a little for an answer or the oldest copy, then poll."""
        self.pump()
        if self._outstanding or self._fetching or not (self._offloads or self._restores or self._saves):
            self._mailbox.wait(IDLE_WAIT_S)
        elif self._offloads:
            self._offloads[0].wait()
        elif self._saves:
            self._saves[0].wait()
        else:
            self._restores[0].wait()
        self.poll()

    def _submit(
        self,
        kind: CallKind,
        *,
        hashes: list[bytes] | None = None,
        slots: list[int] | None = None,
        purpose: object = None,
        restored: bool = False,
        gpu_holds: bool = False,
        count: int = 0,
    ) -> None:
        assert self._arena is not None
        arena_id = self._arena.layout.arena_id
        call = L1Call(
            kind,
            self._epoch,
            arena_id,
            hashes=hashes or [],
            slots=slots or [],
            purpose=purpose,
            restored=restored,
            gpu_holds=gpu_holds,
            count=count,
        )
        self._outstanding += 1
        self._calls.submit(call)

    def _on_answer(self, call: L1Call) -> None:
        current = call.epoch == self._epoch and self._arena is not None
        if current:
            self._outstanding -= 1
        if call.error is not None or not current:
            if isinstance(call.purpose, HostFetch):
                self._fail_fetch(call.purpose)
            elif isinstance(call.purpose, _Offload):
                self._sending.difference_update(call.purpose.block_hashes)
                if current:  # (an older arena's offers were let go when it was detached)
                    self._unpin(call.purpose)
            elif call.purpose is self.reserve and current:
                self.reserve.failed()
            if current and call.error is not None:
                self._go_down(call.error)
            return  # an older arena's answer: its pins went with it (or go when we attach again)
        if call.kind is CallKind.LOOKUP:
            assert isinstance(call.purpose, HostFetch)
            self._on_lookup(call, call.purpose)
        elif call.kind is CallKind.ALLOCATE:
            assert isinstance(call.purpose, _Offload)
            self._on_allocate(call, call.purpose)
        elif call.kind is CallKind.COMMIT:
            assert isinstance(call.purpose, CopyJob)
            self._on_commit(call.purpose)
        elif call.kind is CallKind.RESERVE:
            self.reserve.answered(call.answer)

    def _fail_fetch(self, fetch: HostFetch) -> None:
        """Done without a restore (or its sequence gone): what it holds is let go, as idle L0 entries again."""
        fetch.done = True
        if fetch in self._fetching:
            self._fetching.remove(fetch)
        release_held(self.pool, fetch)

    def _on_news(self, news: KvStoreNews) -> None:
        if news is KvStoreNews.LOST and self._arena is not None:
            log.info("the kvstore went away (its event stream ended): unmapping L1 arena %s", self._arena_id())
            self._detach()
            self._next_attach = 0.0  # attach as soon as a kvstore answers again
        elif news is KvStoreNews.UP and self._arena is None:
            self._next_attach = 0.0
            if self._attaching is None:
                self._ready()
            else:
                self._attach_again = True  # that attach may have asked before the kvstore was up

    # --- attach, detach ---

    def try_attach(self) -> bool:
        """True when attached. Otherwise take what the tier's threads posted, or start an attach when due."""
        self.poll()
        return self._ready()

    def _ready(self) -> bool:
        if self._arena is not None:
            return True
        if self._attaching is None and self._clock() >= self._next_attach:
            self._start_attach()
        return False

    def _start_attach(self) -> None:
        future = self._attacher.submit(self._open_arena)
        self._attaching = future
        future.add_done_callback(lambda done: self._mailbox.post(_Attached(done)))

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
            if self._attach_again:
                self._attach_again = False
                self._next_attach = 0.0
                self._start_attach()
            return False
        self._attach_again = False
        self._arena = arena
        self._epoch += 1
        # a reservation is evicted from L1 ahead of use: never more than a quarter of the arena
        self.reserve.target = min(self._reserved_slots, arena.layout.num_slots // 4)
        self._watch.mapped_arena_id = arena.layout.arena_id
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
        """Forget the arena: wait for copies touching it, let go of their pool blocks, unmap it. Calls still
        on their way belong to its epoch: their answers are dropped."""
        if self._copier is not None:
            self._copier.synchronize()
        for job in [*self._offloads, *self._queued]:
            self.pool.release(job.block_ids[::-1], to_front=job.to_front)  # never committed; the kvstore drops the pins
        self._offloads.clear()
        self._queued.clear()
        self._saves.clear()  # (their pool blocks were never held; their slots' pins are the kvstore's to drop)
        self._refresh_due.clear()
        self.reserve.clear()
        for offload in list(self._pinned_offers):
            self._unpin(offload)  # its answer, if it comes, is dropped with the epoch
        self._restores.clear()
        for fetch in list(self._fetching):
            self._fail_fetch(fetch)  # nothing restored: the sequence computes its blocks
        self._sending.clear()
        self._committing.clear()
        self.horizon.clear()
        self._outstanding = 0
        self._epoch += 1
        self._watch.mapped_arena_id = ""
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
        self._schedule_retry()
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

    def _schedule_retry(self) -> None:
        """Wake the engine when the retry is due: with nothing to run it polls only when its mailbox has news,
        and a kvstore that hung (rather than restarted) sends none when it answers again."""
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        timer = threading.Timer(self.retry_interval_s, self._mailbox.post, args=(_RetryDue(),))
        timer.daemon = True
        timer.start()
        self._retry_timer = timer

    def _schedule_renew(self) -> None:
        """Wake the engine when the reservation's renewal is due (on_evict only)."""
        if not self.save_evicted:
            return
        timer = threading.Timer(RENEW_INTERVAL_S, self._mailbox.post, args=(_RenewDue(),))
        timer.daemon = True
        timer.start()
        self._renew_timer = timer

    def close(self) -> None:
        """Wait for copies in flight (and an attach under way), unmap the arena, stop the tier's threads."""
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        if self._renew_timer is not None:
            self._renew_timer.cancel()
        self._watch.stop()
        self._detach()
        self._attacher.shutdown(wait=True)
        if self._attaching is not None and self._attaching.exception() is None:
            self._attaching.result().close()
        self._attaching = None
        self._calls.close()
        self.client.close()
