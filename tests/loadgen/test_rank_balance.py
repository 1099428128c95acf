"""Reading a multi-rank run from the gateway's request lines: load per rank, stickiness, and the recovery of a
killed rank's sessions."""

from __future__ import annotations

from gateway.observability.request_log import RequestRecord, format_request_line
from loadgen.rank_balance import failover, parse_request_lines, rank_load, stickiness


def line(second: int, session: str, rank: str, prompt: int, cached: int, l1: int = 0, ttft: float = 0.5) -> str:
    record = RequestRecord(
        request_id=f"msg_{second}",
        api="anthropic",
        model="m",
        session=session,
        prompt_tokens=prompt,
        cached_tokens=cached,
        l1_cached_tokens=l1,
        ttft_s=ttft,
        rank=rank,
    )
    return f"2026-11-29 13:00:{second:02d},000 INFO kvserve.gateway.requests: {format_request_line(record)}"


RUN = [
    line(1, "a", "rank-0", 1000, 0, ttft=4.0),  # cold first turns
    line(2, "b", "rank-1", 1000, 0, ttft=4.2),
    line(3, "a", "rank-0", 1100, 1000),
    line(4, "b", "rank-1", 1100, 1000),
    line(5, "c", "rank-0", 900, 0, ttft=3.8),
    line(6, "other line", "rank-1", 10, 0).replace(" request id=", " something else="),
    # rank-0 is killed at second 10; a and c come back on rank-1 from L1
    line(12, "a", "rank-1", 1200, 1100, l1=1100, ttft=0.6),
    line(13, "c", "rank-1", 1000, 896, l1=896, ttft=0.5),
    line(14, "a", "rank-1", 1300, 1200),
]


def test_lines_parse_with_their_fields() -> None:
    served = parse_request_lines(RUN)
    assert len(served) == 8
    first = served[0]
    assert (first.session, first.rank, first.prompt_tokens, first.cached_tokens, first.ttft_s) == (
        "a",
        "rank-0",
        1000,
        0,
        4.0,
    )
    assert served[5].l1_cached_tokens == 1100 and served[5].at - served[0].at == 11.0


def test_load_per_rank_and_stickiness() -> None:
    served = parse_request_lines(RUN)
    load = rank_load(served, ["rank-0", "rank-1", "rank-2"])
    assert load["per_rank"] == {
        "rank-0": {"requests": 3, "computed_tokens": 1000 + 100 + 900},
        "rank-1": {"requests": 5, "computed_tokens": 1000 + 100 + 100 + 104 + 100},
        "rank-2": {"requests": 0, "computed_tokens": 0},
    }
    assert load["max_over_mean_requests"] == round(5 / (8 / 3), 3)
    # sessions a (2 of 4 on rank-0), b (2 of 2), c (1 of 2): 2 + 2 + 1 = 5 of 8 on their main rank
    assert stickiness(served) == round(5 / 8, 4)


def test_failover_reports_the_dead_ranks_sessions_coming_back() -> None:
    # rank-0 restarted and serves a new session at second 40
    served = parse_request_lines([*RUN, line(40, "d", "rank-0", 1000, 0, ttft=4.0)])
    killed_at = served[0].at + 9  # second 10
    report = failover(served, "rank-0", killed_at)
    assert report["orphaned_sessions"] == 2 and report["resumed_sessions"] == 2
    assert report["resumed_ttft_p50_s"] == 0.55 and report["cold_ttft_p50_s"] == 4.0
    assert report["resumed_prompt_tokens_p50"] == 1100 and report["cold_prompt_tokens_p50"] == 1000
    assert report["resumed_l1_share"] == round((1100 + 896) / 2200, 4)
    assert report["failed_after_kill"] == 0
    assert report["served_by_restarted_rank"] == 1 and report["restarted_rank_first_served_after_s"] == 30.0
    quiet = failover(parse_request_lines(RUN), "rank-0", killed_at)
    assert quiet["served_by_restarted_rank"] == 0 and quiet["restarted_rank_first_served_after_s"] is None
