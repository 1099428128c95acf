"""Issue 32: a burst of streams past max_num_seqs under pipelined steps. A successor is scheduled while the step
in flight still holds the rows of the sequences that end there (by length); admitting in their place took one
block-table row per ending sequence more than the model runner has, and the launch failed at ERROR level
("no free block-table row"). No step may hold more than max_num_seqs rows, pipelined or not."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from engine_fixtures import greedy, make_engine, random_prompt
from hypothesis import HealthCheck, given, settings
from l1_fixtures import tiny_model

from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.interface import EngineRequest, FinishReason, SamplingParams
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.model_runner import LaunchedStep
from rank_worker.engine.paged_engine import PagedEngine
from rank_worker.engine.scheduler import Scheduler
from rank_worker.engine.sequence import Sequence, SequenceStatus

MODEL = tiny_model()
VOCAB = MODEL.cfg.vocab_size

Arrival = tuple[str, list[int], SamplingParams]


@dataclass
class Served:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, FinishReason] = field(default_factory=dict)
    # Each launch as (its rows, sequences holding a row none can take back: running, or ending in the step in flight).
    launches: list[tuple[int, int]] = field(default_factory=list)
    errors: list[logging.LogRecord] = field(default_factory=list)


class _Errors(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _serve(engine: PagedEngine, schedule: list[list[Arrival]], aborts: dict[int, list[str]]) -> Served:
    """Submit schedule[i] (and abort aborts[i]) before the i-th step call, step until idle, and watch every launch
    and everything the engine logs at ERROR (a launch that raised is logged and run again: only the log tells)."""
    served = Served()
    launch = engine.runner.launch

    def watching(batch, carried=None) -> LaunchedStep:
        held = sum(1 for seq in engine.requests.values() if seq.status is SequenceStatus.RUNNING)
        served.launches.append((len(batch.entries), held))
        return launch(batch, carried)

    def take(outputs) -> None:
        for out in outputs:
            served.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                served.reasons[out.request_id] = out.finish_reason

    engine.runner.launch = watching  # type: ignore[method-assign]
    handler = _Errors(served.errors)
    logger = logging.getLogger("rank_worker")
    logger.addHandler(handler)
    try:
        for i, arrivals in enumerate(schedule):
            for request_id, prompt, params in arrivals:
                engine.add_request(EngineRequest(request_id, prompt, params))
            for victim in aborts.get(i, []):
                if victim in engine.requests:
                    take([engine.abort_request(victim)])
            take(engine.step())
        for _ in range(10_000):
            if not engine.has_unfinished():
                break
            take(engine.step())
    finally:
        logger.removeHandler(handler)
    assert not engine.has_unfinished()
    return served


def _plain_and_pipelined(
    schedule: list[list[Arrival]], aborts: dict[int, list[str]], max_num_seqs: int, **overrides: object
) -> tuple[Served, Served, PagedEngine]:
    values: dict[str, object] = {
        "num_blocks": 256,
        "max_model_len": 256,
        "max_num_seqs": max_num_seqs,
        "decode_step_budget_ms": 0,  # the steps' shapes follow the schedule alone, not the CPU's speed
    }
    values.update(overrides)
    plain = _serve(make_engine(MODEL, None, pipeline_steps=False, **values), schedule, aborts)
    engine = make_engine(MODEL, None, pipeline_steps=True, **values)
    return plain, _serve(engine, schedule, aborts), engine


def _check(plain: Served, piped: Served, engine: PagedEngine, max_num_seqs: int, requests: int) -> None:
    """No step over max_num_seqs rows, nothing at ERROR, every request ended, the plain engine's tokens."""
    for served in (plain, piped):
        assert [(r.getMessage(), r.exc_info and repr(r.exc_info[1])) for r in served.errors] == []
        over = [launch for launch in served.launches if max(launch) > max_num_seqs]
        assert over == [], f"launches past {max_num_seqs} rows (rows, held): {over}"
    assert len(plain.reasons) == len(piped.reasons) == requests
    for request_id, reason in sorted(plain.reasons.items()):
        if reason is FinishReason.ABORT or piped.reasons[request_id] is FinishReason.ABORT:
            continue  # an abort at the same call may find one side finished already
        assert piped.tokens[request_id] == plain.tokens[request_id], request_id
        assert piped.reasons[request_id] == reason, request_id
    stats = engine.stats()
    assert (stats.used_blocks, stats.running, stats.waiting) == (0, 0, 0)
    assert engine.scheduler.num_seated() == 0


@pytest.mark.parametrize("policy", ["fifo", "warm_first"])
def test_a_burst_of_streams_never_needs_more_rows_than_max_num_seqs(policy: str) -> None:
    """60 streams at once on 24 rows, most in waves that end together (the wave's last step is in flight when
    its successor admits), a few ending early or on a stop token, more arriving, some aborted."""
    rng = random.Random(32)
    max_num_seqs = 24
    schedule: list[list[Arrival]] = [[] for _ in range(24)]
    count = 0

    def arrive(step: int, max_tokens: int, stop: list[int] | None = None) -> None:
        nonlocal count
        request_id = f"b{count}"
        prompt = random_prompt(rng.randint(3, 40), VOCAB, seed=3200 + count)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop or [])
        schedule[step].append((request_id, prompt, params))
        count += 1

    for i in range(60):
        wave = i % 5 != 0  # four in five end with their wave, at their 6th token
        arrive(0, 6 if wave else rng.randint(1, 12), None if wave or i % 3 else [rng.randrange(VOCAB)])
    for step in range(4, 24, 3):
        for _ in range(rng.randint(1, 3)):
            arrive(step, rng.randint(1, 8))
    aborts = {step: [f"b{rng.randrange(60)}" for _ in range(2)] for step in (2, 7, 13)}
    plain, piped, engine = _plain_and_pipelined(schedule, aborts, max_num_seqs, scheduling_policy=policy)
    _check(plain, piped, engine, max_num_seqs, count)
    assert engine.pipelined_steps > 20
    assert max(rows for rows, _ in piped.launches) == max_num_seqs  # the burst did fill every row


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_num_seqs=st.integers(1, 4),
    requests=st.lists(
        st.tuples(
            st.integers(0, 6),  # the step call it arrives before
            st.integers(1, 30),  # prompt tokens
            st.integers(1, 4),  # max_tokens
            st.one_of(st.none(), st.integers(0, 10)),  # aborted before this step call, or not
        ),
        min_size=1,
        max_size=8,
    ),
    chunk=st.sampled_from([16, 32, 4096]),
)
def test_any_arrivals_and_endings_keep_every_step_within_max_num_seqs(
    max_num_seqs: int, requests: list[tuple[int, int, int, int | None]], chunk: int
) -> None:
    """Arrivals over the first calls, endings at any token, aborts at any call, prompts in one step or chunks."""
    schedule: list[list[Arrival]] = [[] for _ in range(7)]
    aborts: dict[int, list[str]] = {}
    for i, (step, length, max_tokens, abort_at) in enumerate(requests):
        schedule[step].append((f"p{i}", random_prompt(length, VOCAB, seed=i), greedy(max_tokens)))
        if abort_at is not None:
            aborts.setdefault(max(step, abort_at), []).append(f"p{i}")
    schedule += [[] for _ in range(max(aborts, default=0) + 1 - len(schedule))]
    plain, piped, engine = _plain_and_pipelined(schedule, aborts, max_num_seqs, max_num_batched_tokens=chunk)
    _check(plain, piped, engine, max_num_seqs, len(requests))


def test_a_sequence_ending_in_the_step_in_flight_keeps_its_seat_until_removed() -> None:
    """Scheduler.end: the sequence leaves the running ones (no later step gives it tokens) but still counts
    against max_num_seqs, so nobody is admitted in its place until it is removed (its step read)."""
    kv = KvCacheManager(BlockPool(16, caching=True), 4, b"ending-seat-test")
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    first, second, late = (Sequence(name, list(range(8)), 8, greedy(4), float(i)) for i, name in enumerate("abc"))
    scheduler.add(first)
    scheduler.add(second)
    assert [seq for seq, _ in scheduler.schedule().entries] == [first, second]
    for seq in (first, second):
        seq.num_computed_tokens = 8
        seq.token_ids.append(5)
    scheduler.end(first)  # the step in flight is its last
    scheduler.add(late)
    batch = scheduler.schedule(preempt=False)
    assert [seq for seq, _ in batch.entries] == [second] and list(scheduler.waiting) == [late]
    assert scheduler.running == [second] and scheduler.num_seated() == 2
    scheduler.remove(first)  # that step was read: its row and blocks go back
    batch = scheduler.schedule(preempt=False)
    assert [seq for seq, _ in batch.entries] == [second, late] and scheduler.num_seated() == 2
