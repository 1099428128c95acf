"""A session whose context is in L1 but does not fit the free pool yet waits for room rather than being restored in
part: the part left out would be computed again. Past the pool, 16 DeepSeek agents at the traces' real size lost
6 points of the traces' reuse that way in the simulator (bench/results/2026-12-06-cpu-simulate-restore-room).

The host tier is the simulator's (simulator/host_cache.py): the real tier's bookkeeping, restoring at once."""

from __future__ import annotations

from engine_fixtures import greedy, random_prompt
from scheduler_fixtures import advance, chunk_of, queue_request

from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.scheduler import Scheduler
from rank_worker.engine.sequence import Sequence
from simulator.host_cache import NodeHostCache, RankHostTier

VOCAB = 128
BLOCK = 16
HISTORY = random_prompt(250 * BLOCK, VOCAB, seed=900)  # 250 full blocks, all in L1, none in L0


def _scheduler(num_blocks: int) -> tuple[Scheduler, RankHostTier]:
    pool = BlockPool(num_blocks, caching=True)
    tier = RankHostTier(NodeHostCache(capacity_blocks=10_000), pool)
    kv = KvCacheManager(pool, BLOCK, b"restore-room", tier)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1024, clock=lambda: 0.0)
    return sched, tier


def _in_l1(sched: Scheduler, tier: RankHostTier, tokens: list[int]) -> list[bytes]:
    """The session's blocks as a finished turn wrote them through to L1, and nowhere in L0."""
    probe = Sequence("probe", list(tokens), len(tokens), greedy(1), arrival_time=0.0)
    hashes = sched.kv.lookup_hashes(probe)
    tier.offload([], hashes)
    return hashes


def _run_to_decode(sched: Scheduler, seq: Sequence) -> None:
    for _ in range(100):
        if seq.num_output_tokens:  # its prompt is computed: it decodes from now on
            return
        advance(sched, sched.schedule())
    raise AssertionError("the runner never reached its decode")


def test_a_session_in_l1_waits_for_room_and_is_then_restored_whole() -> None:
    sched, tier = _scheduler(num_blocks=600)
    hashes = _in_l1(sched, tier, [*HISTORY, 1])
    assert len(hashes) == 250
    runner = queue_request(sched, "runner", random_prompt(400 * BLOCK, VOCAB, seed=901))
    _run_to_decode(sched, runner)  # it holds 401 of the 600 blocks: the session's 250 do not fit beside it

    turn = queue_request(sched, "turn", [*HISTORY, 1, 2, 3])
    batch = sched.schedule()
    assert chunk_of(batch, runner) == 1, "the runner decodes on"
    assert chunk_of(batch, turn) == 0 and turn in sched.waiting
    assert tier.restored_blocks == 0, "nothing restored in part: the rest would have been computed again"
    assert sched.room_waits == 1

    sched.remove(runner)  # it finishes: its blocks are cache entries now, free to take
    batch = sched.schedule()
    assert tier.restored_blocks == 250, "restored whole"
    assert chunk_of(batch, turn) == 3, "only the new tokens are computed"
    assert (turn.num_l1_cached_tokens, turn.num_l0_cached_tokens) == (250 * BLOCK, 0)


def test_the_idle_blocks_of_its_l0_prefix_are_not_room_for_the_restore() -> None:
    """The first 100 blocks of the session are idle L0 entries (counted as free), the other 150 in L1 only. Beside
    a runner holding 400 of 600 blocks the free pool is 200, but 100 of those are the prefix, taken with the
    session: the restore's 150 blocks and a chunk do not fit, so it waits, rather than have its restore cut to the
    99 that fit and the rest computed again."""
    sched, tier = _scheduler(num_blocks=600)
    head = queue_request(sched, "head", [*HISTORY[: 100 * BLOCK], 1])
    while not head.num_output_tokens:
        advance(sched, sched.schedule())
    sched.remove(head)  # its 100 full blocks are idle L0 entries now
    _in_l1(sched, tier, [*HISTORY, 1])
    runner = queue_request(sched, "runner", random_prompt(400 * BLOCK, VOCAB, seed=903))
    _run_to_decode(sched, runner)
    assert sched.kv.pool.num_free == 200

    turn = queue_request(sched, "turn", [*HISTORY, 1, 2, 3])
    batch = sched.schedule()
    assert chunk_of(batch, turn) == 0 and tier.restored_blocks == 0 and sched.room_waits == 1

    sched.remove(runner)
    batch = sched.schedule()
    assert tier.restored_blocks == 150, "restored whole"
    assert (turn.num_l0_cached_tokens, turn.num_l1_cached_tokens) == (100 * BLOCK, 150 * BLOCK)
    assert chunk_of(batch, turn) == 3


def test_a_context_larger_than_the_pool_is_still_restored_in_part_rather_than_never() -> None:
    sched, tier = _scheduler(num_blocks=200)  # the session's 250 blocks could never fit whole
    _in_l1(sched, tier, [*HISTORY, 1])
    runner = queue_request(sched, "runner", random_prompt(20 * BLOCK, VOCAB, seed=902))
    _run_to_decode(sched, runner)
    turn = queue_request(sched, "turn", [*HISTORY, 1, 2, 3])
    batch = sched.schedule()
    assert 0 < tier.restored_blocks < 250 and chunk_of(batch, turn) > 0
    assert sched.room_waits == 0


def test_a_prompt_admitted_with_no_room_to_restore_any_of_its_l1_blocks_is_counted() -> None:
    """The session could never fit the 200-block pool whole, so it does not wait for room; beside the runner the
    free pool takes its next chunk (64 blocks) but not one restored block besides: no lookup is started, all 250
    blocks are computed, and the scheduler counts them (kvserve:l1_restore_unstarted_blocks)."""
    sched, tier = _scheduler(num_blocks=200)
    _in_l1(sched, tier, [*HISTORY, 1])
    runner = queue_request(sched, "runner", random_prompt(134 * BLOCK, VOCAB, seed=902))
    _run_to_decode(sched, runner)
    assert sched.kv.pool.num_free == 66  # a chunk of 1024 tokens and the spare block
    turn = queue_request(sched, "turn", [*HISTORY, 1, 2, 3])
    batch = sched.schedule()
    assert chunk_of(batch, turn) > 0 and tier.restored_blocks == 0
    assert sched.restore_unstarted_blocks == 250
    advance(sched, batch)
    sched.schedule()
    assert sched.restore_unstarted_blocks == 250, "counted once, when admitted"


def test_a_restore_is_held_until_the_admission_takes_it() -> None:
    """Between a restore and its sequence's admission, other allocations of the same step (a running prefill's
    next chunk, another admission) take free blocks. Left idle there, the restored blocks went first when the free
    pool was short: the CPU probe's bursts restored whole sessions, L1 still holding every block, and computed
    them all the same. Held by the fetch, they are not free: the admission takes all of them."""
    sched, tier = _scheduler(num_blocks=600)
    _in_l1(sched, tier, [*HISTORY, 1])
    turn = queue_request(sched, "turn", [*HISTORY, 1, 2, 3])
    kv = sched.kv
    assert not kv.waits_for_host(turn, 1024)  # this tier answers at once: restored, not admitted yet
    assert tier.restored_blocks == 250
    free_before = kv.pool.num_free
    kv.pool.allocate(kv.pool.num_free)  # everything free is taken by others before the admission
    assert kv.pool.num_free == 0 and free_before == 600 - 250
    cached, restored = kv.attach_cached_prefix(turn)
    assert (cached, restored) == (0, 250 * BLOCK), "the restore survived: none of it computed again"
    kv.free(turn)
    assert kv.pool.num_free == 250, "the sequence let go of them once; the fetch holds nothing"
