"""The router's per-session view: counting calls and tokens by tier, cache hit, cold prefills, the LRU bound,
newest-first listing; and the servicer's checks of a ReportFinished."""

from __future__ import annotations

import pytest

from protos import router_pb2 as pb
from router.servicer import InvalidMessageError, finished_call, session_message
from router.session_view import FinishedCall, SessionView


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def call(session: str, prompt: int, l0: int = 0, l1: int = 0, rank: str = "rank-0", output: int = 5) -> FinishedCall:
    return FinishedCall(session, rank, prompt, l0, l1, output)


def test_calls_and_tokens_add_up_per_session() -> None:
    clock = Clock()
    view = SessionView(warm_prefix_fraction=0.5, clock=clock)
    view.report(call("a", 1000))  # first call: cold, nothing cached
    clock.now += 3
    view.report(call("a", 1100, l0=960, output=7))  # warm from L0
    clock.now += 3
    stats = view.report(call("a", 1200, l0=0, l1=1088, rank="rank-1"))  # moved, restored from L1
    assert (stats.calls, stats.prompt_tokens, stats.l0_cached_tokens, stats.l1_cached_tokens) == (3, 3300, 960, 1088)
    assert stats.computed_tokens == 3300 - 960 - 1088
    assert stats.output_tokens == 17
    assert stats.cache_hit == pytest.approx((960 + 1088) / 3300)
    assert stats.cold_prefills == 1
    assert stats.rank_id == "rank-1" and stats.rank_ids == {"rank-0", "rank-1"}
    assert (stats.first_seen, stats.last_seen) == (1000.0, 1006.0)


def test_a_call_below_the_warm_fraction_is_a_cold_prefill() -> None:
    view = SessionView(warm_prefix_fraction=0.5)
    view.report(call("s", 100, l0=49))  # 49% cached: cold
    view.report(call("s", 100, l0=30, l1=20))  # exactly the fraction: warm, as the scheduler says
    view.report(call("s", 0))  # no prompt: neither
    stats = view.newest()[0]
    assert stats.cold_prefills == 1 and stats.calls == 3
    stricter = SessionView(warm_prefix_fraction=0.9)
    assert stricter.report(call("s", 100, l0=80)).cold_prefills == 1


def test_a_session_with_no_prompt_has_no_cache_hit() -> None:
    view = SessionView(warm_prefix_fraction=0.5)
    assert view.report(call("s", 0)).cache_hit == 0.0


def test_newest_first_and_limit() -> None:
    clock = Clock()
    view = SessionView(warm_prefix_fraction=0.5, clock=clock)
    for session in ("a", "b", "c"):
        clock.now += 1
        view.report(call(session, 10))
    clock.now += 1
    view.report(call("a", 10))  # a seen again: newest
    assert [s.session_id for s in view.newest()] == ["a", "c", "b"]
    assert [s.session_id for s in view.newest(2)] == ["a", "c"]
    assert [s.session_id for s in view.newest(0)] == ["a", "c", "b"]
    assert [s.session_id for s in view.newest(10)] == ["a", "c", "b"]


def test_the_least_recently_seen_sessions_go_beyond_the_bound() -> None:
    view = SessionView(warm_prefix_fraction=0.5, max_sessions=3)
    for session in ("a", "b", "c"):
        view.report(call(session, 10))
    view.report(call("a", 10))  # a is recent again: b is now the oldest
    view.report(call("d", 10))
    assert len(view) == 3 and view.dropped == 1
    assert {s.session_id for s in view.newest()} == {"a", "c", "d"}
    view.report(call("b", 10))  # b comes back as a new session, counted from zero
    assert view.newest(1)[0].calls == 1 and len(view) == 3
    with pytest.raises(ValueError):
        SessionView(warm_prefix_fraction=0.5, max_sessions=0)


def test_the_servicer_checks_a_report() -> None:
    good = pb.ReportFinishedRequest(
        session_id="s", rank_id="rank-0", prompt_tokens=100, l0_cached_tokens=60, l1_cached_tokens=40, output_tokens=3
    )
    assert finished_call(good) == FinishedCall("s", "rank-0", 100, 60, 40, 3)
    bad = [
        (pb.ReportFinishedRequest(rank_id="r", prompt_tokens=1), "session_id is required"),
        (pb.ReportFinishedRequest(session_id="s", prompt_tokens=1), "rank_id is required"),
        (pb.ReportFinishedRequest(session_id="s\x00", rank_id="r"), "unprintable"),
        (pb.ReportFinishedRequest(session_id="s", rank_id="r", prompt_tokens=-1), "negative"),
        (
            pb.ReportFinishedRequest(
                session_id="s", rank_id="r", prompt_tokens=10, l0_cached_tokens=6, l1_cached_tokens=5
            ),
            "must not exceed",
        ),
    ]
    for message, error in bad:
        with pytest.raises(InvalidMessageError, match=error):
            finished_call(message)


def test_the_wire_session_carries_the_derived_numbers() -> None:
    view = SessionView(warm_prefix_fraction=0.5, clock=lambda: 1234.5)
    view.report(call("s", 100))
    stats = view.report(call("s", 120, l0=96, rank="rank-1"))
    message = session_message(stats)
    assert (message.session_id, message.rank_id, message.calls, message.ranks_used) == ("s", "rank-1", 2, 2)
    assert (message.prompt_tokens, message.l0_cached_tokens, message.computed_tokens) == (220, 96, 124)
    assert message.cache_hit == pytest.approx(96 / 220) and message.cold_prefills == 1
    assert message.last_seen_unix_s == 1234.5
