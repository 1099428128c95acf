"""Per-step statistics and the verdict (pure functions over request records)."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen.agent import RequestRecord
from loadgen.report import (
    TABLE_COLUMNS,
    Thresholds,
    agent_tok_s,
    failed_criteria,
    largest_passing,
    percentile,
    request_tok_s,
    step_row,
    step_stats,
)


def _record(
    agent: int = 0,
    warm: bool = True,
    ttft: float | None = 1.0,
    output: int = 101,
    decode: float = 2.0,
    input_tokens: int = 1000,
    cached: int = 950,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        agent=agent,
        session="s",
        turn=0,
        session_turn=0,
        warm=warm,
        expected_reuse=0.95 if warm else 0.0,
        expected_input_tokens=input_tokens,
        max_tokens=output,
        sent_s=0.0,
        ttft_s=ttft,
        decode_s=decode,
        output_tokens=output,
        input_tokens=input_tokens,
        cached_tokens=cached,
        error=error,
    )


def test_percentile_interpolates_like_numpy_linear() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(range(1, 101), 95) == pytest.approx(95.05)
    assert percentile([10, 0, 5], 0) == 0 and percentile([10, 0, 5], 100) == 10


def test_agent_tok_s_counts_tokens_after_the_first() -> None:
    records = [
        _record(agent=0, output=101, decode=2.0),  # 100 tokens in 2 s
        _record(agent=0, output=51, decode=3.0),  # 50 tokens in 3 s -> 150 / 5 = 30
        _record(agent=1, output=11, decode=1.0),
        _record(agent=1, error="http 529", ttft=None, output=0, decode=0.0),
        _record(agent=2, output=1, decode=0.0),  # one token: no decode time, no rate
    ]
    assert agent_tok_s(records) == {0: 30.0, 1: 10.0}


def test_request_tok_s_rates_each_answered_call_on_its_own() -> None:
    records = [
        _record(agent=0, output=101, decode=2.0),  # 50 tok/s
        _record(agent=0, output=51, decode=5.0),  # 10 tok/s: the agent's pooled rate (150 / 7 s) hides it
        _record(agent=1, output=11, decode=0.5),  # 20 tok/s
        _record(agent=1, error="http 529", ttft=None, output=0, decode=0.0),
        _record(agent=2, output=1, decode=0.0),  # one token: no decode time, no rate
        _record(agent=2, output=5, decode=0.0),  # tokens but no measurable time: no rate
    ]
    assert request_tok_s(records) == [50.0, 10.0, 20.0]
    stats = step_stats(records, agents=3)
    assert stats["request_tok_s_p50"] == 20.0
    assert stats["request_tok_s_p10"] == 12.0  # linear between 10 and 20
    assert agent_tok_s(records)[0] == pytest.approx(150 / 7), "per agent, the slow call is pooled away"
    assert step_stats([], 3)["request_tok_s_p50"] is None


def test_the_table_shows_the_per_call_rate_beside_the_per_agent_one() -> None:
    stats = step_stats([_record(agent=0, output=101, decode=2.0), _record(agent=1, output=21, decode=2.0)], 2)
    row = dict(zip(TABLE_COLUMNS, step_row(stats), strict=True))
    assert row["tok/s p50"] == "30.0" and row["call tok/s p50 / p10"] == "30.0 / 14.0"
    older = dict(zip(TABLE_COLUMNS, step_row(stats | {"request_tok_s_p50": None}), strict=True))
    assert older["call tok/s p50 / p10"] == "- / 14.0"


def test_a_good_step_passes() -> None:
    records = [_record(agent=a, warm=i > 0, ttft=0.5 + a * 0.1) for a in range(4) for i in range(5)]
    stats = step_stats(records, agents=4, cached_by_tier={"l0": 3000.0, "l1": 800.0}, wall_s=12.5)
    assert stats["passed"] and stats["failed"] == []
    assert stats["requests"] == stats["answered"] == 20 and stats["errors"] == 0.0
    assert stats["warm_requests"] == 16 and stats["cold_requests"] == 4
    assert stats["ttft_p50"] == pytest.approx(0.65) and stats["ttft_p95_cold"] == pytest.approx(0.785)
    assert stats["tok_s_p50"] == 50.0 and stats["tok_s_p10"] == 50.0
    assert stats["cache_hit"] == 0.95 and stats["input_tokens"] == 20_000
    assert stats["cache_hit_l0"] == 0.15 and stats["cache_hit_l1"] == 0.04 and stats["l1_cached_tokens"] == 800
    for key in ("agents", "ttft_p50", "ttft_p95", "ttft_p95_warm", "ttft_p95_cold", "tok_s_p50", "tok_s_p10"):
        assert key in stats


def test_each_criterion_fails_on_its_own() -> None:
    good = [_record(agent=a) for a in range(10)]
    assert step_stats(good, 10)["failed"] == []
    slow_first_token = [*good[:9], _record(agent=9, ttft=40.0)] * 2
    assert step_stats(slow_first_token, 10)["failed"] == ["ttft_p95"]
    slow_agents = [_record(agent=a, decode=10.0 if a < 6 else 2.0) for a in range(10)]  # 10 tok/s for six
    assert step_stats(slow_agents, 10)["failed"] == ["tok_s_p50"]
    one_very_slow = [_record(agent=a, decode=20.0 if a < 2 else 2.0) for a in range(10)]  # 5 tok/s for two
    assert step_stats(one_very_slow, 10)["failed"] == ["tok_s_p10"]
    poorly_cached = [_record(agent=a, cached=800) for a in range(10)]
    assert step_stats(poorly_cached, 10)["failed"] == ["cache_hit"]
    one_error = [*good, _record(agent=0, error="overloaded_error", ttft=None)]
    stats = step_stats(one_error, 10)
    assert stats["failed"] == ["errors"] and stats["errors"] == pytest.approx(1 / 11, abs=1e-4)


def test_the_cache_bar_is_the_optimum_of_the_answered_calls() -> None:
    # cold first turns answered (nothing to reuse), the warm turns failed: over every call the optimum would be the
    # warm turns' 95% and the answered calls' 0% hit would fail "cache_hit" beside "errors"
    answered = [_record(agent=a, warm=False, cached=0) for a in range(4)]
    failed = [_record(agent=a, warm=True, error="api_error", ttft=None, output=0) for a in range(4)]
    stats = step_stats(answered + failed, 4)
    assert stats["cache_hit"] == 0.0 and stats["expected_cache_hit"] == 0.0
    assert stats["failed"] == ["errors"]
    warm_answered = step_stats([_record(agent=a, warm=True, cached=930) for a in range(4)] + failed, 4)
    assert warm_answered["expected_cache_hit"] == 0.95 and warm_answered["failed"] == ["errors"]  # 0.93 >= 0.97 x 0.95


def test_thresholds_are_adjustable() -> None:
    records = [_record(agent=a, ttft=20.0) for a in range(4)]
    assert "ttft_p95" in step_stats(records, 4)["failed"]
    assert step_stats(records, 4, thresholds=Thresholds(ttft_p95_s=30.0))["passed"]


def test_a_step_with_nothing_answered_fails_everything_measured() -> None:
    records = [_record(error="http 500", ttft=None, output=0) for _ in range(3)]
    stats = step_stats(records, 3)
    assert not stats["passed"]
    assert set(stats["failed"]) == {"ttft_p95", "tok_s_p50", "tok_s_p10", "cache_hit", "errors"}
    assert stats["ttft_p95_warm"] is None and stats["errors"] == 1.0
    assert "requests" in step_stats([], 3)["failed"]


def test_missing_statistic_fails_its_criterion() -> None:
    stats = {"ttft_p95": None, "tok_s_p50": 30, "tok_s_p10": 20, "cache_hit": 0.95, "errors": 0.0, "requests": 5}
    assert failed_criteria({**stats, "expected_cache_hit": 0.95}, Thresholds()) == ["ttft_p95"]
    # a cache hit with no optimum to weigh it against cannot pass
    assert failed_criteria(stats, Thresholds()) == ["ttft_p95", "cache_hit"]


def test_the_cache_criterion_is_a_share_of_the_traces_own_reuse() -> None:
    """0.97 of the infinite-cache optimum of the same calls: a trace that allows 85% asks 82.45%, not 90%."""
    stats = {"ttft_p95": 1.0, "tok_s_p50": 30, "tok_s_p10": 20, "errors": 0.0, "requests": 5}
    assert failed_criteria({**stats, "cache_hit": 0.83, "expected_cache_hit": 0.85}, Thresholds()) == []
    assert failed_criteria({**stats, "cache_hit": 0.82, "expected_cache_hit": 0.85}, Thresholds()) == ["cache_hit"]
    strict = Thresholds(cache_hit_of_optimum=1.0)
    assert failed_criteria({**stats, "cache_hit": 0.84, "expected_cache_hit": 0.85}, strict) == ["cache_hit"]
    # an older result file's flat bar is dropped when read back; its criterion takes today's default
    assert Thresholds.from_record({"ttft_p95_s": 9.0, "cache_hit": 0.9}) == Thresholds(ttft_p95_s=9.0)


def test_largest_passing() -> None:
    steps = [{"agents": 2, "passed": True}, {"agents": 4, "passed": True}, {"agents": 8, "passed": False}]
    assert largest_passing(steps) == 4
    assert largest_passing([{"agents": 2, "passed": False}]) is None
    # a pass above a failure is not capacity: the run of passes from the smallest count ends at the first failure
    noisy = [{"agents": 16, "passed": False}, {"agents": 4, "passed": True}, {"agents": 8, "passed": True}]
    assert largest_passing([*noisy, {"agents": 32, "passed": True}]) == 8


def test_short_outputs_count_answered_calls_that_stopped_before_max_tokens() -> None:
    """A server that drops ignore_eos stops calls early: the step says how many, so tok/s is read with it."""
    records = [_record(agent=a) for a in range(4)]
    records[1] = dataclasses.replace(records[1], output_tokens=40)
    records.append(_record(agent=5, error="http 500", ttft=None, output=0))  # unanswered: not counted
    assert step_stats(records, 5)["short_outputs"] == 1
