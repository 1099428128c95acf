"""The decoders' time budget: while sequences decode, a step's prefill is cut to what the step-cost model says
fits decode_step_budget_ms (warm chunks first, min_prefill_chunk_tokens always, the whole token budget with
nobody decoding), and the cut follows the steps' measured times (injected here: no model, no sleeping). Last,
the engine feeds the model the time each step took."""

from __future__ import annotations

import time
from dataclasses import astuple

from engine_fixtures import greedy, make_engine, random_prompt
from l1_fixtures import tiny_model
from scheduler_fixtures import advance, chunk_of, queue_request

from contracts.config import SchedulingConfig
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.interface import EngineRequest
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.model_runner import LaunchedStep
from rank_worker.engine.scheduler import ScheduledBatch, Scheduler
from rank_worker.engine.sequence import Sequence
from rank_worker.engine.step_cost import StepCost, StepCostModel, StepLoad

BLOCK = 16
VOCAB = 128
# A cost easy to work by hand: 10 ms a step and 10 us a prefill token. A 30 ms budget leaves 2,000 tokens.
LINEAR = StepCost(
    step_s=0.01,
    prefill_step_s=0.0,
    decode_row_s=0.0,
    decode_kv_token_s=0.0,
    prefill_token_s=1e-5,
    prefill_attention_s=0.0,
)
TOKEN_BUDGET = 8192


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scheduler(
    policy: str = "warm_first", budget_ms: float = 30.0, min_chunk: int = 256, prior: StepCost = LINEAR
) -> Scheduler:
    kv = KvCacheManager(BlockPool(4000, caching=True), BLOCK, b"decode-budget-test")
    # the budget alone: paying back overruns (on by default) is test_decode_payback.py's
    scheduling = SchedulingConfig(
        scheduling_policy=policy,
        decode_step_budget_ms=budget_ms,
        min_prefill_chunk_tokens=min_chunk,
        decode_payback=False,
    )
    return Scheduler(kv, 64, TOKEN_BUDGET, scheduling, Clock(), step_cost=StepCostModel(prior=prior))


def _decoders(sched: Scheduler, count: int, context: int = 100) -> list[Sequence]:
    seqs = [queue_request(sched, f"decoder{i}", random_prompt(context, VOCAB, seed=i)) for i in range(count)]
    advance(sched, sched.schedule())  # nobody decodes yet: all their prompts in one step
    assert all(seq.num_uncomputed_tokens == 1 for seq in seqs)
    return seqs


def _cache(sched: Scheduler, tokens: list[int]) -> None:
    """A finished earlier turn: its blocks stay behind as cache entries."""
    seq = Sequence("history", list(tokens), len(tokens), greedy(1), arrival_time=sched.clock())
    assert sched.kv.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    sched.kv.register_full_blocks(seq)
    sched.kv.free(seq)


def test_with_decoders_a_long_cold_prefill_gets_the_chunk_the_budget_allows() -> None:
    sched = _scheduler()
    decoders = _decoders(sched, 4)
    cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=50))
    batch = sched.schedule()
    assert all(chunk_of(batch, seq) == 1 for seq in decoders)
    assert chunk_of(batch, cold) == 2000  # (30 ms - 10 ms) / 10 us, a whole number of blocks
    assert sched.step_cost.predict(batch.load) <= 0.030 + 1e-12


def test_without_decoders_the_chunk_is_max_num_batched_tokens() -> None:
    sched = _scheduler()
    cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=50))
    assert chunk_of(sched.schedule(), cold) == TOKEN_BUDGET


def test_a_budget_of_zero_is_todays_token_budget_with_decoders_too() -> None:
    sched = _scheduler(budget_ms=0.0)
    _decoders(sched, 4)
    cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=50))
    assert chunk_of(sched.schedule(), cold) == TOKEN_BUDGET - 4


def test_prefill_gets_its_minimum_when_the_decodes_alone_fill_the_budget() -> None:
    busy = StepCost(*astuple(LINEAR)[:2], 0.01, *astuple(LINEAR)[3:])  # 10 ms a decoding row: 4 fill 30 ms
    sched = _scheduler(prior=busy, min_chunk=256)
    _decoders(sched, 4)
    long = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=50))
    short = queue_request(sched, "later-cold", random_prompt(5_000, VOCAB, seed=51))
    for _ in range(3):
        batch = sched.schedule()
        # one minimum a step, to the cold work with the least left (warm_first), though it arrived second
        assert chunk_of(batch, short) == 256 and chunk_of(batch, long) == 0
        advance(sched, batch)
    assert short.num_computed_tokens == 3 * 256


def _measured_run(factor: float, steps: int = 4) -> list[int]:
    """Steps of 4 decoders and a long cold prefill on a machine `factor` times as slow as the model's prior;
    each step's time is given to the scheduler as the engine measures it. Returns the prefill's chunks."""
    sched = _scheduler()
    _decoders(sched, 4)
    cold = queue_request(sched, "cold", random_prompt(50_000, VOCAB, seed=60))
    chunks = []
    for _ in range(steps):
        batch = sched.schedule()
        chunks.append(chunk_of(batch, cold))
        sched.observe_step(batch.load, factor * LINEAR.seconds(batch.load))
        advance(sched, batch)
    return chunks


def test_the_chunk_follows_the_measured_step_times() -> None:
    assert _measured_run(1.0) == [2000] * 4  # the prior was right
    # Twice as slow: (30 ms - 20 ms) / 20 us = 500 -> 496; twice as fast: (30 - 5) / 5 us = 5000 -> 4992.
    assert _measured_run(2.0) == [2000, 496, 496, 496]
    assert _measured_run(0.5) == [2000, 4992, 4992, 4992]


def test_warm_chunks_go_first_and_fifo_obeys_the_budget_too() -> None:
    history = random_prompt(2000, VOCAB, seed=70)
    warm_prompt = [*history, *random_prompt(1504, VOCAB, seed=71)]  # 2000 cached (125 blocks), 1504 new
    chunks = {}
    for policy in ("warm_first", "fifo"):
        sched = _scheduler(policy)
        _cache(sched, history)
        _decoders(sched, 4)
        cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=72))
        advance(sched, sched.schedule())  # the cold prefill runs, with its first chunk behind it
        warm = queue_request(sched, "warm", warm_prompt)
        batch = sched.schedule()
        chunks[policy] = (chunk_of(batch, warm), chunk_of(batch, cold))
        assert sched.step_cost.predict(batch.load) <= 0.030 + 1e-12
    # warm_first: the warm turn's 1,504 tokens, then the cold prefill the 496 that are left; fifo: the running cold
    # prefill (the older) takes the step's whole 2,000 and the warm turn waits.
    assert chunks == {"warm_first": (1504, 496), "fifo": (0, 2000)}


def test_the_engine_feeds_each_step_time_to_the_model() -> None:
    # Not pipelined: a pipelined step returns its outputs a call later
    # (test_pipelined_steps.py checks the model hears those too).
    engine = make_engine(tiny_model(), max_num_batched_tokens=64, pipeline_steps=False)
    launch = engine.runner.launch

    def slow_launch(batch: ScheduledBatch) -> LaunchedStep:
        time.sleep(0.02)  # a tiny model's step takes well under a millisecond: give it a real step's time
        return launch(batch)

    engine.runner.launch = slow_launch  # type: ignore[method-assign]
    engine.add_request(EngineRequest("r", random_prompt(150, VOCAB, seed=80), greedy(5)))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert engine.scheduler.step_cost.steps == steps == 3 + 4  # 150 tokens in 64-token chunks, 4 more decodes
    # The prior says ~8 ms for such a step (an H200's); every step here took 20 ms or more.
    assert engine.scheduler.step_cost.predict(StepLoad(decode_rows=1, decode_kv_tokens=155)) >= 0.015


def test_the_budget_is_the_gpus_by_default_and_off_on_the_cpu_unless_configured() -> None:
    """A CPU decode step alone outlasts 50 ms (SmolLM2: ~160 ms): there the budget would only cut every prefill
    beside a decoder to the minimum chunk, so unset means off on the CPU and 50 ms on CUDA."""
    import torch

    from contracts.config import GPU_DECODE_STEP_BUDGET_MS, KvServeConfig
    from rank_worker.engine.factory import decode_step_budget_ms

    unset = KvServeConfig()
    assert unset.scheduling.decode_step_budget_ms is None
    assert decode_step_budget_ms(unset, torch.device("cpu")) == 0.0
    assert decode_step_budget_ms(unset, torch.device("cuda")) == GPU_DECODE_STEP_BUDGET_MS == 40.0
    assert decode_step_budget_ms(KvServeConfig(decode_step_budget_ms=80), torch.device("cpu")) == 80.0
    assert decode_step_budget_ms(KvServeConfig(decode_step_budget_ms=0), torch.device("cuda")) == 0.0


def test_a_starved_prefill_gets_its_own_minimum_beside_decoders_and_warm_prefill() -> None:
    # Decoders fill the time budget and a warm turn takes the step's minimum chunk: a cold prefill that has gone
    # cold_max_wait_secs without a token still gets a minimum chunk of its own every step (scheduler.py).
    busy = StepCost(*astuple(LINEAR)[:2], 0.01, *astuple(LINEAR)[3:])  # 10 ms a decoding row: 4 fill 30 ms
    sched = _scheduler(prior=busy, min_chunk=256)
    history = random_prompt(4000, VOCAB, seed=70)
    _cache(sched, history)
    _decoders(sched, 4)
    cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=71))
    advance(sched, sched.schedule())
    assert cold.num_computed_tokens == 256  # admitted with the step's minimum
    warm = queue_request(sched, "warm", [*history, *random_prompt(2000, VOCAB, seed=72)])
    batch = sched.schedule()
    assert chunk_of(batch, warm) == 256 and chunk_of(batch, cold) == 0  # the warm turn takes the minimum
    advance(sched, batch)
    assert isinstance(sched.clock, Clock)
    sched.clock.now += sched.policy.cold_max_wait_secs
    batch = sched.schedule()
    assert cold.starved and not warm.starved
    assert chunk_of(batch, warm) == 256 and chunk_of(batch, cold) == 256
