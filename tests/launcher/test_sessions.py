"""`kvserve sessions`: the router's per-session view as a table (newest first) or JSON, from a router stand-in
in this process; its errors."""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from launcher.cli import main
from launcher.sessions import age, print_sessions, sessions_json
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc

NOW = 1_800_000_000.0


def reply() -> pb.ListSessionsResponse:
    older = pb.SessionStats(
        session_id="older-session",
        rank_id="rank-1",
        calls=1,
        prompt_tokens=15_000,
        computed_tokens=15_000,
        output_tokens=40,
        cold_prefills=1,
        first_seen_unix_s=NOW - 7200,
        last_seen_unix_s=NOW - 7200,
        ranks_used=1,
    )
    newer = pb.SessionStats(
        session_id="d1c4a0e2-claude-code",
        rank_id="rank-0",
        calls=12,
        prompt_tokens=480_000,
        l0_cached_tokens=430_000,
        l1_cached_tokens=20_000,
        computed_tokens=30_000,
        output_tokens=3_100,
        cache_hit=0.9375,
        cold_prefills=2,
        first_seen_unix_s=NOW - 600,
        last_seen_unix_s=NOW - 3,
        ranks_used=2,
    )
    # out of order on purpose: the command sorts by last seen itself
    return pb.ListSessionsResponse(sessions=[older, newer], tracked=7, warm_prefix_fraction=0.5)


def test_the_table_lists_sessions_newest_first() -> None:
    out = io.StringIO()
    print_sessions(reply(), as_json=False, out=out, now=NOW)
    text = out.getvalue()
    assert text.index("d1c4a0e2-claude-code") < text.index("older-session")
    row = next(line for line in text.splitlines() if "d1c4a0e2" in line)
    for cell in ("rank-0 (+1)", "12", "480,000", "430,000", "20,000", "30,000", "93.8%", "3,100", "3s ago"):
        assert cell in row, (cell, row)
    assert "2h ago" in next(line for line in text.splitlines() if "older-session" in line)
    assert "2 of 7 session(s) in the router's view" in text and "under 50% of the prompt cached" in text


def test_json_has_every_number_newest_first() -> None:
    document = json.loads(sessions_json(reply()))
    assert [s["session_id"] for s in document["sessions"]] == ["d1c4a0e2-claude-code", "older-session"]
    first = document["sessions"][0]
    assert first["calls"] == 12 and first["rank_id"] == "rank-0" and first["ranks_used"] == 2
    assert first["l0_cached_tokens"] + first["l1_cached_tokens"] + first["computed_tokens"] == first["prompt_tokens"]
    assert first["cache_hit"] == 0.9375 and first["cold_prefills"] == 2 and first["last_seen_unix_s"] == NOW - 3
    assert document["tracked"] == 7 and document["warm_prefix_fraction"] == 0.5


def test_no_sessions_says_so() -> None:
    out = io.StringIO()
    print_sessions(pb.ListSessionsResponse(warm_prefix_fraction=0.5), as_json=False, out=out)
    assert "no sessions" in out.getvalue()


def test_ages() -> None:
    assert [age(s) for s in (-1, 0, 59.9, 60, 3599, 3600, 86400 * 3)] == ["0s", "0s", "59s", "1m", "59m", "1h", "3d"]


class FakeRouter(pb_grpc.RouterServicer):
    def __init__(self) -> None:
        self.limits: list[int] = []

    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext) -> pb.ListSessionsResponse:
        self.limits.append(request.limit)
        return reply()


@pytest.fixture
def router() -> Iterator[tuple[str, FakeRouter]]:
    fake = FakeRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RouterServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", fake
    finally:
        server.stop(None)


def test_the_command_asks_the_router(router: tuple[str, FakeRouter], capsys: pytest.CaptureFixture[str]) -> None:
    target, fake = router
    assert main(["sessions", "--target", target, "--json", "--limit", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"][0]["session_id"] == "d1c4a0e2-claude-code"
    assert main(["sessions", "--target", target]) == 0
    assert "d1c4a0e2-claude-code" in capsys.readouterr().out
    assert fake.limits == [5, 50]


def test_a_router_that_is_not_there_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["sessions", "--target", f"127.0.0.1:{port}"]) == 1
    assert "error from the router at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sessions", "--limit", "-1"])
