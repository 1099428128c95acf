"""A step that runs out of GPU memory loses nothing: it is dropped and scheduled again under a cap of half its tokens
(and the prefill windows with it), the requests' tokens are those of a run that never ran out, the cap doubles
back after enough steps, and a step at the floor fails its own requests while the others go on. The model here
raises torch.OutOfMemoryError, as the CUDA caching allocator does, past a step size or at a position."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_fixtures import greedy, make_engine, random_prompt, run_to_completion
from l1_fixtures import tiny_model
from scheduler_fixtures import chunk_of, queue_request

from contracts.config import SchedulingConfig
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.interface import EngineRequest, RequestsFailedError
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.paged_engine import PagedEngine
from rank_worker.engine.scheduler import Scheduler
from rank_worker.engine.step_token_cap import StepTokenCap
from rank_worker.engine_loop import EngineFailedError, EngineLoop
from rank_worker.model.forward_batch import ForwardBatch

VOCAB = 128  # tiny_model's
BUDGET = 128  # max_num_batched_tokens
SEATS = 8  # max_num_seqs: the cap's floor


class RunsOut:
    """The model, but a step runs out of memory when it carries more than `over` tokens or reaches position `at`."""

    def __init__(self, model: torch.nn.Module, over: int | None = None, at: int | None = None) -> None:
        self.model, self.over, self.at = model, over, at
        self.steps: list[int] = []  # tokens of each step that ran
        self.ran_out: list[int] = []  # tokens of each step that ran out

    def __call__(self, forward: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = forward.num_tokens
        if (self.over is not None and tokens > self.over) or (
            self.at is not None and int(forward.positions.max()) >= self.at
        ):
            self.ran_out.append(tokens)
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {tokens} MiB")
        self.steps.append(tokens)
        return self.model(forward, kv_cache)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model()


def _engine(model: torch.nn.Module, pipeline: bool, **overrides: object) -> PagedEngine:
    values: dict[str, object] = dict(
        max_model_len=512, max_num_batched_tokens=BUDGET, max_num_seqs=SEATS, pipeline_steps=pipeline
    )
    values.update(overrides)
    return make_engine(model, **values)


def _run(engine: PagedEngine, prompts: list[list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, greedy(max_tokens)))
    return {rid: out.new_token_ids for rid, out in run_to_completion(engine).items()}


def test_the_cap_halves_the_failed_step_doubles_back_and_stops_at_the_floor() -> None:
    cap = StepTokenCap(longest_step=1000, floor=8, recovery_steps=3)
    assert cap.tokens is None and cap.window() == 1000
    assert cap.lower(900) and cap.tokens == 450 and cap.window() == 450
    assert cap.lower(450) and cap.tokens == 225 and cap.dropped_steps == 2
    assert cap.lower(12) and cap.tokens == 8  # never under the floor
    assert cap.window() == 125  # the window stops at an eighth of the longest step
    assert not cap.lower(8) and cap.tokens == 8 and cap.dropped_steps == 3  # nothing smaller left: no change
    moves = [cap.ran() for _ in range(9)]
    assert moves == [False, False, True] * 3 and cap.tokens == 64  # 8 -> 16 -> 32 -> 64, every 3 steps
    cap.lower(64)  # a step that runs out starts the count again
    assert cap.tokens == 32 and not cap.ran() and cap.steps_under_cap == 1
    cap = StepTokenCap(longest_step=1000, floor=8, recovery_steps=1)
    cap.lower(900)
    assert cap.ran() and cap.tokens == 900
    assert cap.ran() and cap.tokens is None and cap.window() == 1000  # 1800 would pass the longest step: gone
    assert not cap.ran()  # no cap, nothing to count


def test_the_scheduler_keeps_a_step_and_a_solo_prefill_under_the_cap() -> None:
    kv = KvCacheManager(BlockPool(400, caching=True), 16, b"step-token-cap-test")
    policy = SchedulingConfig(decode_step_budget_ms=0.0, solo_prefill_tokens=2048)
    sched = Scheduler(kv, SEATS, 512, policy)
    sched.step_token_cap = 200
    cold = queue_request(sched, "cold", random_prompt(3000, VOCAB, seed=1))
    assert chunk_of(sched.schedule(), cold) == 200  # not the solo prefill's 2048, not the budget's 512


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
def test_a_step_that_runs_out_is_dropped_and_its_requests_get_the_same_tokens(
    model: torch.nn.Module, pipeline: bool
) -> None:
    prompts = [random_prompt(300, VOCAB, seed=s) for s in (1, 2, 3)]
    expected = _run(_engine(model, pipeline), prompts)

    engine = _engine(model, pipeline)
    assert engine.attention.context_window_tokens == BUDGET
    runs_out = RunsOut(model, over=40)
    engine.runner.model = runs_out
    assert _run(engine, prompts) == expected  # nothing lost, nothing changed
    assert runs_out.ran_out[:2] == [BUDGET, BUDGET // 2]  # 128 ran out, then 64; 32 fits
    stats = engine.stats()
    assert stats.oom_dropped_steps == len(runs_out.ran_out) == 2 and stats.step_token_cap == 32
    assert engine.scheduler.step_token_cap == 32 and engine.attention.context_window_tokens == 32
    dropped_at = len([n for n in runs_out.steps if n > 32])
    assert dropped_at == 0  # every step that ran carried at most the cap
    assert stats.used_blocks == 0


def test_the_cap_goes_after_enough_steps_and_long_steps_come_back(model: torch.nn.Module) -> None:
    engine = _engine(model, pipeline=False)
    runs_out = RunsOut(model, over=40)
    engine.runner.model = runs_out
    _run(engine, [random_prompt(300, VOCAB, seed=4)], max_tokens=2)
    assert engine.stats().oom_dropped_steps == 2 and engine.step_cap.tokens == 32
    runs_out.over = None  # the shortage has passed
    runs_out.steps.clear()
    engine.step_cap.recovery_steps = 4
    _run(engine, [random_prompt(480, VOCAB, seed=5)], max_tokens=12)
    assert engine.scheduler.step_token_cap is None and engine.stats().step_token_cap == 0
    assert engine.attention.context_window_tokens == BUDGET
    assert max(runs_out.steps) == BUDGET  # full steps again
    assert engine.stats().oom_dropped_steps == 2  # cumulative


def test_a_step_at_the_floor_fails_its_own_requests(model: torch.nn.Module) -> None:
    engine = _engine(model, pipeline=False)
    engine.runner.model = RunsOut(model, at=100)  # a decode past position 100: one token, at the floor
    engine.add_request(EngineRequest("long", random_prompt(99, VOCAB, seed=6), greedy(8)))
    with pytest.raises(RequestsFailedError) as failed:
        run_to_completion(engine)
    assert failed.value.request_ids == ["long"] and isinstance(failed.value.cause, torch.OutOfMemoryError)
    assert engine.stats().oom_dropped_steps == 0  # a decode step is at the floor: nothing to drop


def test_through_the_loop_the_one_that_runs_out_fails_alone(model: torch.nn.Module) -> None:
    engine = _engine(model, pipeline=True)
    engine.runner.model = RunsOut(model, at=100)
    loop = EngineLoop(engine)
    loop.start()

    async def run() -> None:
        doomed = loop.submit(EngineRequest("long", random_prompt(99, VOCAB, seed=7), greedy(8)))
        with pytest.raises(EngineFailedError, match="OutOfMemoryError"):
            async for _ in doomed:
                pass
        tokens: list[int] = []
        async for output in loop.submit(EngineRequest("short", random_prompt(40, VOCAB, seed=8), greedy(8))):
            tokens += output.new_token_ids
        assert len(tokens) == 8

    try:
        asyncio.run(run())
    finally:
        loop.stop()
    assert engine.stats().used_blocks == 0  # the failed request's blocks went back


def test_the_sizing_probe_refuses_to_measure_a_shorter_step(model: torch.nn.Module) -> None:
    from rank_worker.engine.factory import run_probe

    probe = _engine(model, pipeline=False)
    probe.runner.model = RunsOut(model, over=40)
    probe.add_request(EngineRequest("profile", [1] * 300, greedy(1)))
    with pytest.raises(RuntimeError, match=f"longest step \\({BUDGET} tokens\\) runs out of GPU memory"):
        run_probe(probe, BUDGET)
    fits = _engine(model, pipeline=False)
    fits.add_request(EngineRequest("profile", [1] * 300, greedy(1)))
    run_probe(fits, BUDGET)
    assert not fits.has_unfinished() and fits.finished_requests == 1
