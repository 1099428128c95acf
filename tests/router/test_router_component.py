"""A component test: the real router process with a real redis-server, the test standing in for the ranks
(announced over gRPC: Register, Heartbeat) and their KV events (an in-test publisher double).

Checked: routes follow prefixes and sessions; bad input is refused; a SIGKILLed router restarted on the same
Redis sends every session back to its rank; with Redis killed Route still answers, and once Redis is back
the state made meanwhile is written into it.

The same through the whole stack (real ranks, the gateway's requests), in tests/e2e: test_routing_e2e.py
(sessions stick, a new session goes to the rank whose L0 holds its prefix), test_service_failures_e2e.py (the
router killed and restarted, Redis restarted) and test_hung_services_e2e.py."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from router_event_source import KvEventSource
from router_prompts import lookup_hashes, prompt_tokens
from service_processes import free_port, redis_client, start_redis, start_router

from contracts import internal_auth
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc

RANK_DOWN_AFTER_S = 3.0
HEARTBEAT_S = 0.2


class RankAnnouncer:
    """What a rank worker does towards the router: register, heartbeat, register again when not known."""

    def __init__(self, router: str, ranks: dict[str, KvEventSource]) -> None:
        self.registrations = 0
        self._ranks = ranks
        self._router = router
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RankAnnouncer:
        with internal_auth.channel(self._router) as channel:
            stub = pb_grpc.RouterStub(channel)
            for rank_id, source in self._ranks.items():
                self._register(stub, rank_id, source)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _register(self, stub: pb_grpc.RouterStub, rank_id: str, source: KvEventSource) -> None:
        request = pb.RegisterRankRequest(
            rank_id=rank_id, address=source.address, incarnation=f"{rank_id}-inc", block_size=16, hash_namespace=b"n"
        )
        stub.RegisterRank(request, timeout=2)
        self.registrations += 1

    def _run(self) -> None:
        with internal_auth.channel(self._router) as channel:
            stub = pb_grpc.RouterStub(channel)
            while not self._stop.wait(HEARTBEAT_S):
                for rank_id, source in self._ranks.items():
                    try:
                        reply = stub.Heartbeat(
                            pb.HeartbeatRequest(rank_id=rank_id, incarnation=f"{rank_id}-inc"), timeout=1
                        )
                        if not reply.known:
                            self._register(stub, rank_id, source)
                    except grpc.RpcError:
                        pass  # the router is away: keep trying, as a rank does


@dataclass
class Stack:
    tmp: Path
    redis_port: int
    router_port: int
    sources: dict[str, KvEventSource]

    @property
    def router(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    def start_redis(self) -> contextlib.AbstractContextManager[object]:
        return start_redis(self.tmp / f"redis-{time.monotonic_ns()}.log", self.redis_port, self.tmp / "redis-data")

    def start_router(self) -> contextlib.AbstractContextManager[object]:
        settings = {
            "KVSERVE_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "KVSERVE_RANK_DOWN_AFTER_SECS": str(RANK_DOWN_AFTER_S),
            "KVSERVE_HEARTBEAT_INTERVAL_SECS": str(HEARTBEAT_S),
        }
        return start_router(self.tmp / f"router-{time.monotonic_ns()}.log", self.router_port, **settings)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    sources = {name: KvEventSource(free_port()).start() for name in ("rank-a", "rank-b")}
    try:
        yield Stack(tmp_path, free_port(), free_port(), sources)
    finally:
        for source in sources.values():
            source.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not true after {timeout_s}s")
        time.sleep(0.05)


def route(
    stub: pb_grpc.RouterStub, conversation: int, length: int, session: str = "", **kwargs: object
) -> pb.RouteResponse:
    tokens = prompt_tokens(conversation, length)
    request = pb.RouteRequest(
        request_id=f"req-{conversation}-{length}",
        session_id=session,
        block_hashes=lookup_hashes(tokens),
        prompt_tokens=len(tokens),
        **kwargs,  # type: ignore[arg-type]
    )
    return stub.Route(request, timeout=2)


def rank_status(stub: pb_grpc.RouterStub) -> dict[str, pb.RankStatus]:
    return {rank.rank_id: rank for rank in stub.ListRanks(pb.ListRanksRequest(), timeout=2).ranks}


def test_routes_follow_prefixes_and_sessions_and_bad_input_is_refused(stack: Stack) -> None:
    stack.sources["rank-a"].store(lookup_hashes(prompt_tokens(1, 161)))  # conversation 1: 10 blocks on a
    stack.sources["rank-b"].store(lookup_hashes(prompt_tokens(2, 321)))  # conversation 2: 20 blocks on b
    with (
        stack.start_redis(),
        stack.start_router(),
        RankAnnouncer(stack.router, stack.sources),
        internal_auth.channel(stack.router) as channel,
    ):
        stub = pb_grpc.RouterStub(channel)
        wait_until(lambda: {r.l0_blocks for r in rank_status(stub).values()} == {10, 20}, 10, "snapshots indexed")

        first = route(stub, 1, 400, session="s1")
        assert (first.rank_id, first.reason, first.expected_l0_tokens) == ("rank-a", "prefix", 160)
        assert first.address == stack.sources["rank-a"].address
        second = route(stub, 2, 500, session="s2")
        assert (second.rank_id, second.reason, second.expected_l0_tokens) == ("rank-b", "prefix", 320)
        unrelated = route(stub, 3, 800, session="s1")
        assert (unrelated.rank_id, unrelated.reason) == ("rank-a", "session")

        stack.sources["rank-b"].store(lookup_hashes(prompt_tokens(4, 161)))  # a delta, not a snapshot
        wait_until(lambda: rank_status(stub)["rank-b"].l0_blocks == 30, 5, "delta indexed")
        assert route(stub, 4, 300).rank_id == "rank-b"

        stub.ReportRankFailure(pb.ReportRankFailureRequest(rank_id="rank-a", detail="refused"), timeout=2)
        moved = route(stub, 1, 420, session="s1", avoid_rank_ids=["rank-a"])
        assert moved.rank_id == "rank-b"
        assert route(stub, 1, 440, session="s1").rank_id == "rank-b", "the session follows its new rank"

        with pytest.raises(grpc.RpcError) as refused:
            route(stub, 1, 100, avoid_rank_ids=["rank-a", "rank-b"])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as bad_hash:
            stub.Route(pb.RouteRequest(block_hashes=[b"short"], prompt_tokens=10), timeout=2)
        assert bad_hash.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as no_id:
            stub.RegisterRank(pb.RegisterRankRequest(address="127.0.0.1:1", incarnation="x", block_size=16), timeout=2)
        assert no_id.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as bad_address:
            stub.RegisterRank(pb.RegisterRankRequest(rank_id="x", address="nowhere", incarnation="x", block_size=16))
        assert bad_address.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as bad_load:
            load = pb.RankLoad(waiting_prefill_tokens=10, waiting_warm_prefill_tokens=11)
            stub.Heartbeat(pb.HeartbeatRequest(rank_id="rank-a", incarnation="x", load=load), timeout=2)
        assert bad_load.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.Heartbeat(pb.HeartbeatRequest(rank_id="stranger", incarnation="x"), timeout=2).known is False
        assert set(rank_status(stub)) == {"rank-a", "rank-b"}, "refused requests changed nothing"


def test_sessions_survive_a_router_kill_and_redis_outage_is_bridged(stack: Stack) -> None:
    sessions = {f"s{n}": n for n in range(6)}
    with (
        stack.start_redis() as redis_process,
        stack.start_router() as router_process,
        RankAnnouncer(stack.router, stack.sources) as announcer,
        internal_auth.channel(stack.router) as channel,
    ):
        stub = pb_grpc.RouterStub(channel)
        first = {session: route(stub, n, 200 + n, session=session).rank_id for session, n in sessions.items()}
        assert set(first.values()) == {"rank-a", "rank-b"}, "new sessions spread over both ranks"
        client = redis_client(stack.redis_port, socket_timeout=2)
        wait_until(lambda: all(client.exists(f"kvserve:session:{s}") for s in sessions), 5, "sessions saved")
        router_process.kill()
        router_process.wait(timeout=10)
        registrations_before = announcer.registrations

        with stack.start_router():
            wait_until(
                lambda: all(r.healthy for r in rank_status(stub).values()) and len(rank_status(stub)) == 2,
                10,
                "ranks healthy again",
            )
            again = {session: route(stub, n, 220 + n, session=session) for session, n in sessions.items()}
            assert {s: answer.rank_id for s, answer in again.items()} == first, "sessions stay sticky"
            assert {answer.reason for answer in again.values()} == {"session"}
            assert announcer.registrations == registrations_before, "restored ranks confirmed by heartbeat"

            redis_process.send_signal(9)
            redis_process.wait(timeout=10)
            answer = route(stub, 7, 300, session="during-outage")
            assert answer.rank_id in ("rank-a", "rank-b")
            wait_until(
                lambda: not stub.ListRanks(pb.ListRanksRequest(), timeout=2).redis_connected,
                10,
                "Redis seen down",
            )
            assert route(stub, 0, 260, session="s0").rank_id == first["s0"], "still routing from memory"

            with stack.start_redis():
                wait_until(
                    lambda: stub.ListRanks(pb.ListRanksRequest(), timeout=2).redis_connected,
                    10,
                    "Redis seen back",
                )
                client = redis_client(stack.redis_port, socket_timeout=2)
                wait_until(
                    lambda: client.get("kvserve:session:during-outage") == answer.rank_id.encode(),
                    5,
                    "the outage's session written back",
                )
                assert client.exists("kvserve:rank:rank-a") and client.exists("kvserve:rank:rank-b")


def test_router_serves_without_redis(stack: Stack) -> None:
    """Redis never started: the router still becomes SERVING and routes from memory."""
    with (
        stack.start_router(),
        RankAnnouncer(stack.router, {"rank-a": stack.sources["rank-a"]}),
        internal_auth.channel(stack.router) as channel,
    ):
        stub = pb_grpc.RouterStub(channel)
        answer = route(stub, 1, 100, session="s")
        assert (answer.rank_id, answer.reason) == ("rank-a", "only-rank")
        assert route(stub, 2, 100, session="s").reason == "session"
        listing = stub.ListRanks(pb.ListRanksRequest(), timeout=2)
        assert not listing.redis_connected and listing.sessions == 1
