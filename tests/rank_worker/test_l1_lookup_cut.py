"""A host-tier lookup answered when others' admissions had taken the free pool meanwhile (no room for any of its
blocks): the sequence looks its blocks up again rather than compute what L1 holds, a bounded number of times. In
the CPU probe's bursts such sequences were admitted at once and computed whole sessions L1 still held."""

from __future__ import annotations

from collections.abc import Callable

from engine_fixtures import greedy, random_prompt
from scheduler_fixtures import advance, chunk_of, queue_request

from contracts.config import SchedulingConfig
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.kv_cache_manager import MAX_LOOKUPS_CUT, KvCacheManager
from rank_worker.engine.scheduler import Scheduler
from rank_worker.engine.sequence import Sequence, SequenceStatus
from rank_worker.l1.host_fetch import HostFetch

BLOCK = 16


class AnsweredLater:
    """A host tier that holds every block (or none) and answers each lookup when the test says, with no room."""

    def __init__(self, *, holds: bool = True) -> None:
        self.holds = holds
        self.fetches: list[HostFetch] = []
        self.abandoned: list[HostFetch] = []
        self.offloads: list[bool] = []  # each offload's `finished`

    def fetch(self, prefix: list[bytes], block_hashes: list[bytes], room: Callable[[int], int]) -> HostFetch:
        fetch = HostFetch(list(prefix), list(block_hashes), room, deadline=0.0, expected=self.known_run(block_hashes))
        self.fetches.append(fetch)
        return fetch

    def answer_with_no_room(self) -> None:
        fetch = self.fetches[-1]
        fetch.cut, fetch.done = len(fetch.hashes), True

    def abandon(self, fetch: HostFetch) -> None:
        self.abandoned.append(fetch)

    def offload(self, block_ids: list[int], block_hashes: list[bytes], *, finished: bool = False) -> None:
        self.offloads.append(finished)

    def known_run(self, block_hashes: list[bytes]) -> int:
        return len(block_hashes) if self.holds else 0


def test_a_lookup_cut_to_nothing_is_made_again_a_bounded_number_of_times() -> None:
    tier = AnsweredLater()
    kv = KvCacheManager(BlockPool(100, caching=True), BLOCK, b"lookup-cut", tier)
    seq = Sequence("a", random_prompt(20 * BLOCK + 3, 128, seed=5), 20 * BLOCK + 3, greedy(4), arrival_time=0.0)
    for lookup in range(1, MAX_LOOKUPS_CUT + 2):
        assert kv.waits_for_host(seq, 256), "a lookup starts: the sequence waits for it"
        assert len(tier.fetches) == lookup and seq.status is SequenceStatus.WAITING_FOR_L1
        tier.answer_with_no_room()
        if lookup <= MAX_LOOKUPS_CUT:
            assert kv.waits_for_host(seq, 256), "cut to nothing: it waits, to look its blocks up again"
            assert seq.host_fetch is None and seq.l1_lookups_cut == lookup
    assert not kv.waits_for_host(seq, 256), "the last cut: admitted, it computes what L1 could not restore"
    assert seq.l1_lookups_cut == MAX_LOOKUPS_CUT and len(tier.fetches) == MAX_LOOKUPS_CUT + 1
    assert tier.abandoned == [], "every fetch was answered: none given up"


def test_a_held_restore_lets_go_when_blocks_run_short_so_nobody_waits_on_it_forever() -> None:
    """A restore answered and held for its admission (A), behind B in arrival order, whose prompt does not fit
    beside A's held blocks. Held on, B would close admission every step and A never be reached (the component
    soak hung so in CI). When blocks run short the holds go: A's blocks are idle L0 entries again, and both run."""
    pool = BlockPool(40, caching=True)
    kv = KvCacheManager(pool, BLOCK, b"held-restore", AnsweredLater(holds=False))
    sched = Scheduler(kv, 8, 1024, policy=SchedulingConfig(scheduling_policy="fifo"), clock=lambda: 0.0)
    queue_request(sched, "b", random_prompt(20 * BLOCK, 128, seed=7))
    a = queue_request(sched, "a", random_prompt(30 * BLOCK + 3, 128, seed=8))
    held = pool.allocate(30)  # A's restore: 30 blocks registered in L0, held by its answered fetch
    for block_id, block_hash in zip(held, kv.lookup_hashes(a), strict=False):
        pool.register(block_id, block_hash)
    a.host_fetch = HostFetch([], kv.lookup_hashes(a)[:30], lambda n: n, deadline=0.0, held=list(held), done=True)
    a.host_fetch.restored.update(held)
    batch = sched.schedule()
    assert batch.entries == [] and a.host_fetch is not None and a.host_fetch.held == [], "B ran short: A let go"
    assert pool.num_free == 40
    batch = sched.schedule()
    assert [seq.request_id for seq, _ in batch.entries] == ["b"], "B is admitted now, no longer held up"
    advance(sched, batch)


class AnsweredThroughRoom(AnsweredLater):
    """AnsweredLater holding the given blocks only, whose answer is the real tier's: done first, then as many
    blocks as the lookup's room takes then; the rest is cut."""

    def __init__(self, held: set[bytes]) -> None:
        super().__init__()
        self.held = held

    def known_run(self, block_hashes: list[bytes]) -> int:
        run = 0
        while run < len(block_hashes) and block_hashes[run] in self.held:
            run += 1
        return run

    def answer(self) -> int:
        """How many of the found blocks the room took."""
        fetch = self.fetches[-1]
        fetch.done = True
        wanted = min(fetch.expected, max(fetch.room(fetch.expected), 0))
        fetch.cut = fetch.expected - wanted
        return wanted


A_PROMPT = random_prompt(40 * BLOCK + 3, 128, seed=21)  # A's next turn: its 40 full blocks in L1 only


def _b_in_prefill_beside_a_in_l1(
    policy: SchedulingConfig | None = None, clock: Callable[[], float] = lambda: 0.0
) -> tuple[Scheduler, AnsweredThroughRoom, Sequence]:
    """A 150-block pool; B, a cold 120-block prompt, has had its first chunk (64 blocks: 86 free). A is not queued."""
    pool = BlockPool(150, caching=True)
    tier = AnsweredThroughRoom(set())
    kv = KvCacheManager(pool, BLOCK, b"lookup-reserve", tier)
    probe = Sequence("probe", list(A_PROMPT), len(A_PROMPT), greedy(1), arrival_time=0.0)
    tier.held = set(kv.lookup_hashes(probe))
    sched = Scheduler(kv, 8, 1024, policy=policy, clock=clock)
    b = queue_request(sched, "b", random_prompt(120 * BLOCK, 128, seed=22))
    batch = sched.schedule()
    assert chunk_of(batch, b) == 1024
    advance(sched, batch)
    assert pool.num_free == 86
    return sched, tier, b


def test_a_running_prefill_leaves_the_blocks_a_lookup_under_way_will_take() -> None:
    """B, a cold 120-block prompt, is in prefill; A's next turn, 40 blocks in L1 only, starts its lookup. B's next
    chunk (56 blocks) would leave 30 of the 86 free, and A's answer a step later would find no room beside its chunk:
    its 40 blocks cut. B's chunk is cut to what leaves A's 42 (40, its chunk's block and the spare), and A's answer
    takes all 40. B gives way while A's turn runs (cold work last under warm_first) and then goes on."""
    sched, tier, b = _b_in_prefill_beside_a_in_l1()
    kv = sched.kv
    a = queue_request(sched, "a", A_PROMPT)
    batch = sched.schedule()
    assert a.status is SequenceStatus.WAITING_FOR_L1 and kv.reserved_blocks() == 42
    assert chunk_of(batch, b) == 44 * BLOCK, "B's chunk leaves A's 42 blocks free"
    advance(sched, batch)
    assert tier.answer() == 40, "A's answer finds room for all of its blocks: none cut"
    assert kv.reserved_blocks() == 0, "answered: nothing promised any more"
    batch = sched.schedule()
    assert chunk_of(batch, a) == a.num_tokens, "A admitted (this tier restores nothing into the pool: computed)"
    assert tier.offloads and not any(tier.offloads), "B gave its blocks back: not an end (l1_refresh_finished)"
    advance(sched, batch)
    sched.remove(a)  # its turn ends: B, a cold prefill, gave way to it (warm first) and goes on now
    assert tier.offloads[-1], "A's end is one"
    for _ in range(10):
        if b.num_output_tokens:
            break
        advance(sched, sched.schedule())
    assert b.num_output_tokens, "B's prefill went on once A's turn was done: it decodes"


def test_a_starved_prefill_is_not_cut_for_a_lookup_under_way() -> None:
    """The same B and A, but B has gone cold_max_wait_secs without a chunk (starved): it progresses every step,
    so its chunk is not cut for A's lookup, and A's answer finds the room gone (as every answer did before)."""
    now = [0.0]
    policy = SchedulingConfig(cold_max_wait_secs=5.0, min_prefill_chunk_tokens=512)  # half the step: A's turn too
    sched, tier, b = _b_in_prefill_beside_a_in_l1(policy, lambda: now[0])
    now[0] = 6.0  # B's last chunk was 6 s ago: starved
    a = queue_request(sched, "a", A_PROMPT)
    batch = sched.schedule()
    assert a.status is SequenceStatus.WAITING_FOR_L1
    assert b.starved and sched.kv.reserved_blocks() == 42
    assert chunk_of(batch, b) == 56 * BLOCK, "B's whole remainder, not cut for A's lookup"
    advance(sched, batch)
    assert tier.answer() == 0, "the 30 blocks B left do not take A's 41: cut (it looks them up again later)"
