"""decode_payback (scheduler.py): a step carrying prefill beside decoders that ran past decode_step_budget_ms is
paid back by decode-only steps (no prefill, no admission) until what they leave of the budget covers it; a
decode-only step that fills the budget by itself clears the debt (prefill never starves); nobody decoding, no
debt. The arithmetic (payback) directly, then a Scheduler driven with injected step times (no model)."""

from __future__ import annotations

import json

from engine_fixtures import random_prompt
from scheduler_fixtures import advance, chunk_of, queue_request
from test_decode_step_budget import VOCAB, _decoders, _scheduler
from test_engine_loop import NUM_BLOCKS, TINY_LLAMA

from contracts.config import KvServeConfig
from rank_worker.engine.factory import build_engine
from rank_worker.engine.scheduler import payback
from rank_worker.engine.step_cost import StepLoad

BUDGET = 0.030
DECODE = StepLoad(decode_rows=4, decode_kv_tokens=400)
MIXED = StepLoad(decode_rows=4, decode_kv_tokens=400, prefill_tokens=1024, prefill_attention=1e6)
PREFILL_ONLY = StepLoad(prefill_tokens=4096)


def test_a_step_with_prefill_past_the_budget_owes_its_overrun() -> None:
    assert payback(0.0, MIXED, 0.130, BUDGET) == 0.100
    assert payback(0.100, MIXED, 0.020, BUDGET) == 0.100  # within the budget: owes nothing more


def test_decode_only_steps_pay_back_what_they_leave_of_the_budget() -> None:
    owed = payback(0.100, DECODE, 0.010, BUDGET)
    assert abs(owed - 0.080) < 1e-12
    assert payback(0.015, DECODE, 0.010, BUDGET) == 0.0  # never below zero


def test_a_decode_only_step_that_fills_the_budget_clears_the_debt() -> None:
    assert payback(0.500, DECODE, 0.031, BUDGET) == 0.0


def test_steps_without_decoders_leave_the_debt_as_it_is() -> None:
    assert payback(0.100, PREFILL_ONLY, 2.0, BUDGET) == 0.100


def _payback_scheduler():
    sched = _scheduler(budget_ms=30.0, min_chunk=256)
    sched.policy = sched.policy.model_copy(update={"decode_payback": True})
    return sched


def test_after_an_overrun_the_next_steps_decode_only_then_prefill_resumes() -> None:
    sched = _payback_scheduler()
    decoders = _decoders(sched, 4)
    cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=50))
    batch = sched.schedule()
    assert chunk_of(batch, cold) > 0
    sched.observe_step(batch.load, 0.110)  # the step ran 80 ms past its 30 ms budget
    advance(sched, batch)
    assert abs(sched.overrun_s - 0.080) < 1e-9
    waiting = queue_request(sched, "warm-later", random_prompt(64, VOCAB, seed=51))
    decode_only = 0
    while True:
        batch = sched.schedule()
        if chunk_of(batch, cold):
            break
        assert all(chunk_of(batch, seq) == 1 for seq in decoders) and len(batch.entries) == len(decoders)
        assert chunk_of(batch, waiting) == 0  # nobody admitted while paying back
        sched.observe_step(batch.load, 0.010)  # each leaves 20 ms of its budget
        advance(sched, batch)
        decode_only += 1
    assert decode_only == 4  # 80 ms owed, 20 ms paid a step
    assert sched.overrun_s == 0.0


def test_off_by_default_an_overrun_changes_nothing() -> None:
    sched = _scheduler(budget_ms=30.0, min_chunk=256)
    _decoders(sched, 4)
    cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=50))
    batch = sched.schedule()
    sched.observe_step(batch.load, 0.500)
    advance(sched, batch)
    assert sched.overrun_s == 0.0
    assert chunk_of(sched.schedule(), cold) > 0


def test_with_nobody_decoding_the_debt_is_dropped() -> None:
    sched = _payback_scheduler()
    sched.overrun_s = 1.0
    cold = queue_request(sched, "cold", random_prompt(20_000, VOCAB, seed=50))
    assert chunk_of(sched.schedule(), cold) > 0
    assert sched.overrun_s == 0.0


def test_the_config_key_reaches_the_engines_scheduler(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    for on in (False, True):
        model = str(tmp_path / "config.json")
        config = KvServeConfig(model=model, load_format="dummy", device="cpu", num_kv_blocks=NUM_BLOCKS)
        config = config.model_copy(update={"scheduling": config.scheduling.model_copy(update={"decode_payback": on})})
        assert build_engine(config).scheduler.policy.decode_payback is on


def test_the_rank_logs_the_scheduling_it_runs(tmp_path, caplog) -> None:
    # a benchmark's logs must show the budget and payback a run had: their defaults differ by device and date
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = KvServeConfig(
        model=str(tmp_path / "config.json"), load_format="dummy", device="cpu", num_kv_blocks=NUM_BLOCKS
    )
    config = config.model_copy(
        update={
            "scheduling": config.scheduling.model_copy(update={"decode_step_budget_ms": 25.0, "decode_payback": False})
        }
    )
    with caplog.at_level("INFO", logger="rank_worker.engine.factory"):
        build_engine(config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("scheduling:")]
    assert lines == [
        "scheduling: warm_first, decode step budget 25 ms, decode payback off, min prefill chunk 1024 tokens"
    ]
