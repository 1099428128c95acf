"""Warm-first scheduling on the tiny random model: warm turns go ahead of queued cold ones, the cold-prefill cap
holds, a cold request is not starved by a stream of warm ones (a settable clock, no sleeping), FIFO keeps
arrival order, and the policy changes the order of work, never the tokens."""

from __future__ import annotations

from collections.abc import Callable

from engine_fixtures import greedy, make_engine, random_prompt, run_to_completion
from l1_fixtures import tiny_model
from scheduler_fixtures import advance, chunk_of, queue_request

from contracts.config import SchedulingConfig
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.interface import EngineRequest
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.paged_engine import PagedEngine
from rank_worker.engine.scheduler import LOAD_REFRESH_S, ScheduledBatch, Scheduler
from rank_worker.engine.sequence import Sequence

VOCAB = 128
HISTORY = random_prompt(160, VOCAB, seed=100)  # a session's context, cached by a first turn


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(policy: str, clock: Clock | None = None, **settings: object) -> PagedEngine:
    # Steps read when they return (not pipelined): these tests count the step at which things happen.
    values: dict[str, object] = {
        "num_blocks": 128,
        "max_model_len": 512,
        "max_num_batched_tokens": 64,
        "pipeline_steps": False,
    }
    values.update(settings)
    engine = make_engine(tiny_model(), scheduling_policy=policy, **values)
    if clock is not None:
        engine.scheduler.clock = clock
    return engine


def _cache_history(engine: PagedEngine) -> None:
    engine.add_request(EngineRequest("history", list(HISTORY), greedy(2)))
    run_to_completion(engine)


def _submit(engine: PagedEngine, request_id: str, prompt: list[int], max_tokens: int, at: float | None = None) -> None:
    engine.add_request(EngineRequest(request_id, prompt, greedy(max_tokens), arrival_time=at))


def _run_steps(engine: PagedEngine, max_steps: int = 1000) -> tuple[dict[str, int], dict[str, int]]:
    """Step until idle; the step at which each request was admitted, and the one of its first output."""
    admitted: dict[str, int] = {}
    first: dict[str, int] = {}
    for step in range(max_steps):
        if not engine.has_unfinished():
            return admitted, first
        outputs = engine.step()
        for seq in engine.scheduler.running:
            admitted.setdefault(seq.request_id, step)
        for out in outputs:
            admitted.setdefault(out.request_id, step)  # admitted and finished within this step
            first.setdefault(out.request_id, step)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def _cold(n: int) -> list[list[int]]:
    return [random_prompt(150, VOCAB, seed=200 + i) for i in range(n)]


def _is_cold_prefill(seq: Sequence) -> bool:
    """Judged from what the sequence got at admission, not from the scheduler's own bookkeeping."""
    return seq.first_token_time is None and (seq.num_l0_cached_tokens or 0) < 0.5 * seq.num_prompt_tokens


def test_a_warm_turn_goes_ahead_of_queued_cold_ones_under_warm_first_and_waits_under_fifo() -> None:
    runs = {}
    for policy in ("fifo", "warm_first"):
        engine = _engine(policy)
        _cache_history(engine)
        for i, prompt in enumerate(_cold(3)):
            _submit(engine, f"cold{i}", prompt, 4)
        _submit(engine, "warm", [*HISTORY, 5, 6, 7, 8], 4)
        runs[policy] = _run_steps(engine)
    (fifo, fifo_first), (warm_first, warm_first_first) = runs["fifo"], runs["warm_first"]
    assert fifo["cold0"] < fifo["cold1"] < fifo["cold2"] < fifo["warm"]  # 64-token budget: one prefill at a time
    assert fifo_first["warm"] >= fifo_first["cold2"]
    assert warm_first_first["warm"] == 0  # admitted and prefilled (4 new tokens) in the very first step
    assert warm_first_first["warm"] < min(warm_first_first[f"cold{i}"] for i in range(3))
    assert warm_first["cold0"] < warm_first["cold1"] < warm_first["cold2"]  # cold ones keep arrival order


def test_a_warm_turn_is_not_held_behind_a_running_cold_prefill() -> None:
    engine = _engine("warm_first", max_num_batched_tokens=32)
    _cache_history(engine)
    _submit(engine, "cold", random_prompt(300, VOCAB, seed=300), 2)
    engine.step()  # the cold prefill is running now, with 268 tokens to go
    _submit(engine, "warm", [*HISTORY, 9, 9, 9], 2)
    _, first = _run_steps(engine)
    assert first["warm"] == 0  # its 3 new tokens take the budget before the cold chunk
    assert first["cold"] > first["warm"]


def _counting(schedule: Callable[[], ScheduledBatch], cold_per_step: list[int]) -> Callable[[], ScheduledBatch]:
    """schedule(), recording how many cold prefills each step's batch holds."""

    def counting_schedule() -> ScheduledBatch:
        batch = schedule()
        cold_per_step.append(sum(_is_cold_prefill(seq) for seq, _ in batch.entries))
        return batch

    return counting_schedule


def test_the_cold_prefill_cap_holds_and_warm_work_still_flows() -> None:
    for cap in (1, 2):
        engine = _engine("warm_first", max_cold_prefills=cap, max_num_batched_tokens=512, max_num_seqs=16)
        _cache_history(engine)
        for i, prompt in enumerate(_cold(5)):
            _submit(engine, f"cold{i}", prompt, 3)
        _submit(engine, "warm", [*HISTORY, 1, 2, 3], 3)
        cold_per_step: list[int] = []
        engine.scheduler.schedule = _counting(engine.scheduler.schedule, cold_per_step)  # type: ignore[method-assign]
        produced = {out.request_id: len(out.new_token_ids) for out in engine.step()}
        running = {seq.request_id for seq in engine.scheduler.running}
        # The budget had room for all six; the cap let in `cap` cold ones, and the warm one went first anyway.
        assert running == {"warm"} | {f"cold{i}" for i in range(cap)}
        for rid, out in run_to_completion(engine).items():
            produced[rid] = produced.get(rid, 0) + len(out.new_token_ids)
        assert max(cold_per_step) == cap
        assert produced == {f"cold{i}": 3 for i in range(5)} | {"warm": 3}
        assert engine.scheduler.cold_admissions == 6  # the five and the history turn


def _starvation_run(cold_max_wait_secs: float, steps: int) -> tuple[float | None, list[str]]:
    """One slot of work (max_num_seqs 1), a steady stream of warm turns, one cold request queued at t=0 and one
    second per step. Returns the cold request's wait before admission (None: never) and the admission order."""
    clock = Clock()
    engine = _engine("warm_first", clock, max_num_seqs=1, cold_max_wait_secs=cold_max_wait_secs)
    _cache_history(engine)
    _submit(engine, "warm0", [*HISTORY, 0], 3, at=clock.now)
    _submit(engine, "cold", random_prompt(100, VOCAB, seed=400), 2, at=clock.now)
    admitted: list[str] = []
    waited = None
    warm = 1
    for _ in range(steps):
        engine.step()
        for seq in engine.scheduler.running:
            if not admitted or admitted[-1] != seq.request_id:
                admitted.append(seq.request_id)
                if seq.request_id == "cold":
                    waited = clock.now - seq.arrival_time
        if sum(seq.request_id.startswith("warm") for seq in engine.scheduler.waiting) < 2:
            _submit(engine, f"warm{warm}", [*HISTORY, warm % VOCAB], 3, at=clock.now)
            warm += 1
        clock.now += 1.0
    return waited, admitted


def test_a_cold_request_is_not_starved_by_a_stream_of_warm_ones() -> None:
    waited, admitted = _starvation_run(cold_max_wait_secs=10.0, steps=40)
    assert waited is not None and 10.0 <= waited <= 14.0  # admitted once it had waited 10 s, not long after
    assert admitted.index("cold") > 1  # warm turns that arrived after it went first until it had waited
    never, admitted_never = _starvation_run(cold_max_wait_secs=1e9, steps=40)
    assert never is None and "cold" not in admitted_never  # without the guard the stream starves it


def test_outputs_are_identical_under_both_policies() -> None:
    prompts = {f"cold{i}": p for i, p in enumerate(_cold(4))}
    prompts |= {f"warm{i}": HISTORY + random_prompt(5 + i, VOCAB, seed=500 + i) for i in range(4)}
    results = {}
    for policy, cap in (("fifo", 0), ("warm_first", 0), ("warm_first", 1)):
        # 40 blocks (640 tokens) for about 1,500 tokens of work: admissions wait for blocks, decodes preempt.
        engine = _engine(policy, max_cold_prefills=cap, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=128)
        _cache_history(engine)
        for i, (rid, prompt) in enumerate(sorted(prompts.items(), key=lambda item: item[0][-1])):
            _submit(engine, rid, prompt, 30 + i)
        outs = run_to_completion(engine)
        results[(policy, cap)] = {rid: out.new_token_ids for rid, out in outs.items()}
        stats = engine.stats()
        assert stats.preemptions > 0 and stats.used_blocks == 0
    baseline = results[("fifo", 0)]
    assert set(baseline) == set(prompts) and all(baseline.values())
    assert results[("warm_first", 0)] == baseline
    assert results[("warm_first", 1)] == baseline


def test_warmth_is_peeked_without_taking_blocks() -> None:
    engine = _engine("warm_first")
    _cache_history(engine)
    free, cached = engine.pool.num_free, engine.pool.num_cached
    seq = Sequence("peek", [*HISTORY, 1, 2, 3], len(HISTORY) + 3, greedy(1), arrival_time=0.0)
    assert engine.kv.peek_cached_tokens(seq) == len(HISTORY)  # 160 = 10 full blocks
    assert engine.kv.peek_cached_tokens(seq, enough=40) == 48  # stops at the first block run covering 40
    assert (engine.pool.num_free, engine.pool.num_cached) == (free, cached)
    assert all(block.ref_count == 0 for block in engine.pool.blocks)
    hashes = seq.lookup_hashes
    assert len(hashes) == 10 and engine.kv.lookup_hashes(seq) is hashes  # computed once, kept


class _KnownHostTier:
    """A host tier that is known to hold some hashes (and restores none): what a peek may count."""

    def __init__(self, known: set[bytes]) -> None:
        self.known = known

    def restore(self, block_hashes: list[bytes], max_blocks: int) -> list[int]:
        return []

    def offload(self, block_ids: list[int], block_hashes: list[bytes], *, finished: bool = False) -> None:
        return None

    def known_run(self, block_hashes: list[bytes]) -> int:
        run = 0
        while run < len(block_hashes) and block_hashes[run] in self.known:
            run += 1
        return run


def test_warmth_counts_the_run_the_host_tier_is_known_to_hold() -> None:
    engine = _engine("warm_first")
    _cache_history(engine)
    session = [*HISTORY, *random_prompt(96, VOCAB, seed=600)]
    seq = Sequence("l1", [*session, 1], len(session) + 1, greedy(1), arrival_time=0.0)
    hashes = engine.kv.lookup_hashes(seq)
    assert len(hashes) == 16  # 10 in L0, 6 more after them
    engine.kv.host_tier = _KnownHostTier(set(hashes[10:14]))
    assert engine.kv.peek_cached_tokens(seq) == 14 * 16  # L0's 10 blocks, then the 4 L1 holds
    engine.kv.host_tier = _KnownHostTier(set(hashes[11:16]))
    assert engine.kv.peek_cached_tokens(seq) == 10 * 16  # L1's run must continue L0's, not skip a block


def test_the_warm_part_of_the_waiting_queue_is_what_a_warm_turn_waits_for() -> None:
    # Reported to the router: a session's rank busy with cold prefills is not overloaded for its warm turn.
    clock = Clock()
    warm_first = _engine("warm_first", clock)
    _cache_history(warm_first)
    for i, prompt in enumerate(_cold(2)):
        _submit(warm_first, f"cold{i}", prompt, 4, at=clock.now)
    warm_prompt = [*HISTORY, 5, 6, 7, 8]
    _submit(warm_first, "warm", warm_prompt, 4, at=clock.now)
    sched = warm_first.scheduler
    # In prefill still to do: the cold prompts whole, the warm one's 4 tokens after its 160 cached ones.
    assert sched.waiting_prefill_tokens() == 2 * 150 + 4
    assert sched.waiting_warm_prefill_tokens() == 4, "the cold requests are not ahead of it"
    assert warm_first.stats().waiting_warm_prefill_tokens == 4
    _submit(warm_first, "warm2", [*HISTORY, 9, 10], 4, at=clock.now)
    assert sched.waiting_warm_prefill_tokens() == 4, "reused within LOAD_REFRESH_S"
    assert sched.waiting_prefill_tokens() == 2 * 150 + 4, "both parts come from one measurement"
    clock.now += LOAD_REFRESH_S
    assert sched.waiting_warm_prefill_tokens() == 4 + 2
    clock.now += sched.policy.cold_max_wait_secs
    assert sched.waiting_warm_prefill_tokens() == sched.waiting_prefill_tokens() == 306, "starved cold ones go first"

    fifo = _engine("fifo")
    for i, prompt in enumerate(_cold(2)):
        _submit(fifo, f"cold{i}", prompt, 4)
    assert fifo.scheduler.waiting_warm_prefill_tokens() == fifo.scheduler.waiting_prefill_tokens() == 300


def _bare_scheduler(
    cached: list[list[int]], num_blocks: int, policy: SchedulingConfig | None = None, **limits: int
) -> tuple[Scheduler, Clock]:
    """A scheduler over a real pool and cache manager, no model: each of `cached` is a finished first turn
    whose blocks are cache entries (computed, registered, released, as the engine leaves them)."""
    kv = KvCacheManager(BlockPool(num_blocks, caching=True), 16, b"load-test-namespace")
    clock = Clock()
    sched = Scheduler(kv, limits.get("max_num_seqs", 64), limits.get("max_num_batched_tokens", 4096), policy, clock)
    for i, tokens in enumerate(cached):
        seq = Sequence(f"first-turn{i}", list(tokens), len(tokens), greedy(1), arrival_time=clock.now)
        assert kv.allocate(seq, len(tokens))
        seq.num_computed_tokens = len(tokens)
        kv.register_full_blocks(seq)
        kv.free(seq)
    return sched, clock


def test_the_reported_load_counts_warm_turns_by_their_uncached_tokens_not_their_whole_prompts() -> None:
    # Ten sessions' next turns: 4,000 cached tokens each and 3 new ones. Prefill still to do is 30 tokens;
    # counting whole prompts said 40,030, which the router then added its own uncached estimate to.
    histories = [random_prompt(4000, VOCAB, seed=700 + i) for i in range(10)]
    sched, clock = _bare_scheduler(histories, num_blocks=2600)
    for i, history in enumerate(histories):
        sched.add(Sequence(f"turn{i}", [*history, 1, 2, 3], 4003, greedy(1), arrival_time=clock.now))
    assert sched.waiting_prefill_tokens() == 30
    assert sched.waiting_warm_prefill_tokens() == 30
    assert all(block.ref_count == 0 for block in sched.kv.pool.blocks), "measuring takes no block"


def test_the_reported_load_counts_host_tier_hits_at_the_restore_cost_and_chunked_prefills_by_what_is_left() -> None:
    history = random_prompt(4000, VOCAB, seed=800)
    sched, clock = _bare_scheduler([], num_blocks=600, max_num_batched_tokens=1024)
    turn = Sequence("restorable", [*history, 1, 2, 3], 4003, greedy(1), arrival_time=clock.now)
    sched.kv.host_tier = _KnownHostTier(set(sched.kv.lookup_hashes(turn)))
    sched.add(turn)
    # Its 4,000 tokens are restorable from L1: 3 to compute plus 4,000 x l1_restore_cost (0.05), not 4,003.
    assert sched.policy.l1_restore_cost == 0.05
    assert sched.waiting_prefill_tokens() == sched.waiting_warm_prefill_tokens() == 3 + 200

    sched.kv.host_tier = None
    sched.waiting.clear()
    cold = Sequence("cold", random_prompt(3000, VOCAB, seed=801), 3000, greedy(1), arrival_time=clock.now)
    sched.add(cold)
    (entry,) = sched.schedule().entries
    assert entry == (cold, 1024)
    cold.num_computed_tokens += 1024  # the step ran, as PagedEngine.step advances it
    clock.now += LOAD_REFRESH_S
    assert sched.waiting_prefill_tokens() == 3000 - 1024, "a chunked prefill counts only what is left"
    assert sched.waiting_warm_prefill_tokens() == 0, "a warm turn goes ahead of a running cold prefill"


def test_an_idle_scheduler_reports_no_load_at_once_not_the_value_kept_from_its_last_busy_step() -> None:
    # The engine loop stops asking once idle, so the stats of its last step are what the router hears until the
    # next request: a value reused from a busy moment would keep steering sessions away from an idle rank.
    sched, clock = _bare_scheduler([], num_blocks=600)
    seq = Sequence("busy", random_prompt(2000, VOCAB, seed=802), 2000, greedy(1), arrival_time=clock.now)
    sched.add(seq)
    assert sched.waiting_prefill_tokens() == 2000
    sched.remove(seq)  # it finished (or was aborted): nothing left waiting or running
    assert sched.waiting_prefill_tokens() == sched.waiting_warm_prefill_tokens() == 0, "within LOAD_REFRESH_S"


# --- cold work under warm_first: shortest first, and starvation measured from a sequence's last chunk ---


def _cold_work_scheduler(history: list[int], budget: int = 256) -> tuple[Scheduler, Clock]:
    policy = SchedulingConfig(
        scheduling_policy="warm_first", cold_max_wait_secs=30.0, decode_step_budget_ms=0.0, min_prefill_chunk_tokens=32
    )
    return _bare_scheduler([history], num_blocks=2000, policy=policy, max_num_batched_tokens=budget)


def test_a_long_running_cold_prefill_does_not_jump_ahead_of_a_warm_turn() -> None:
    # A 400K-token prefill runs for minutes on a GPU: it has been served all along, so the cold_max_wait_secs
    # guard must not put it ahead of the warm turns arriving meanwhile (it did when the wait ran from arrival).
    history = random_prompt(320, VOCAB, seed=900)
    sched, clock = _cold_work_scheduler(history)
    cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=901))
    for _ in range(40):  # one second a step: 40 s of chunks, past the 30 s wait
        batch = sched.schedule()
        assert chunk_of(batch, cold) == 256
        advance(sched, batch)
        clock.now += 1.0
    assert clock.now - cold.arrival_time > sched.policy.cold_max_wait_secs
    warm = queue_request(sched, "warm", [*history, 7, 7, 7])
    batch = sched.schedule()
    assert batch.entries[0] == (warm, 3), "the warm turn's tokens come first"
    assert chunk_of(batch, cold) == 256 - 3, "the prefill gets the rest of the budget"
    assert not cold.starved


def test_a_running_prefill_held_back_past_the_wait_is_starved_and_then_goes_first() -> None:
    history = random_prompt(320, VOCAB, seed=902)
    sched, clock = _cold_work_scheduler(history, budget=64)
    cold = queue_request(sched, "cold", random_prompt(2000, VOCAB, seed=903))
    advance(sched, sched.schedule())  # its first chunk
    assert cold.num_computed_tokens == 64
    served_at = clock.now
    # Warm turns of 64 new tokens each fill every step's budget: one at a time, the next queued as one ends.
    turns = [queue_request(sched, "warm0", [*history, *random_prompt(64, VOCAB, seed=1000)])]

    def next_step(batch: ScheduledBatch) -> ScheduledBatch:
        """The batch run, a warm turn done with its prompt gone (one output token), the next one queued."""
        advance(sched, batch)
        for seq, _ in batch.entries:
            if seq is not cold and seq.num_computed_tokens >= seq.num_prompt_tokens:
                sched.remove(seq)
        clock.now += 1.0
        turn = len(turns)
        turns.append(queue_request(sched, f"warm{turn}", [*history, *random_prompt(64, VOCAB, seed=1000 + turn)]))
        return sched.schedule()

    batch = sched.schedule()
    while chunk_of(batch, cold) == 0:
        batch = next_step(batch)
        assert len(turns) < 100, "the prefill was starved"
    assert cold.starved
    assert clock.now - served_at >= sched.policy.cold_max_wait_secs
    # starved: its minimum chunk is set aside, and the warm turn still gets the rest of the step
    assert [(seq.request_id, n) for seq, n in batch.entries] == [(turns[-1].request_id, 32), ("cold", 32)]
    for _ in range(5):  # and so every step from then on, until its prefill is done
        batch = next_step(batch)
        assert chunk_of(batch, cold) == 32


def test_cold_work_goes_shortest_first_running_or_waiting() -> None:
    history = random_prompt(320, VOCAB, seed=904)
    sched, clock = _cold_work_scheduler(history)
    long = queue_request(sched, "long", random_prompt(20_000, VOCAB, seed=905))
    advance(sched, sched.schedule())
    clock.now += 1.0
    # A new session's first prompt (cold, 1,000 tokens) and a turn whose cached 320 tokens are under half of it.
    short = queue_request(sched, "short", random_prompt(1000, VOCAB, seed=906))
    partly = queue_request(sched, "partly-cached", [*history, *random_prompt(600, VOCAB, seed=907)])
    batch = sched.schedule()
    # shortest uncached first: partly-cached has 600 to do, short 1,000, long 19,744 left
    assert [(seq.request_id, n) for seq, n in batch.entries] == [("partly-cached", 256)]
    assert partly.num_l0_cached_tokens == 320
    advance(sched, batch)
    done: dict[str, int] = {}
    for step in range(200):
        batch = sched.schedule()
        advance(sched, batch)
        for seq, _ in batch.entries:
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                done.setdefault(seq.request_id, step)
        if "long" in done:
            break
    assert done["partly-cached"] < done["short"] < done["long"]
    assert done["short"] <= 6, "the short prompt waited for its own four chunks, not the long one's 78"
    assert long.num_computed_tokens >= long.num_prompt_tokens and short.num_computed_tokens >= short.num_prompt_tokens
