"""RouterLink against the real router process: it registers, heartbeats its load, rides out a router that
is away without raising, and registers again when a restarted router does not know it."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from service_processes import free_port, start_router

from contracts import internal_auth
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc
from rank_worker.engine.interface import EngineStats
from rank_worker.router_link import RankIdentity, RouterLink, advertise_address

HEARTBEAT_S = 0.2


def engine_stats(free_blocks: int) -> EngineStats:
    return EngineStats(
        total_blocks=100,
        free_blocks=free_blocks,
        cached_blocks=0,
        used_blocks=100 - free_blocks,
        running=2,
        waiting=3,
        prefix_query_tokens=0,
        prefix_hit_tokens=0,
        finished_requests=0,
        preemptions=0,
        block_size=16,
        waiting_prefill_tokens=777,
        waiting_warm_prefill_tokens=300,
    )


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not true after {timeout_s}s")
        time.sleep(0.05)


def ranks(router: str) -> dict[str, pb.RankStatus]:
    with internal_auth.channel(router) as channel:
        reply = pb_grpc.RouterStub(channel).ListRanks(pb.ListRanksRequest(), timeout=2)
    return {rank.rank_id: rank for rank in reply.ranks}


@pytest.fixture
def background_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on its own thread, as the rank worker's server loop runs beside the test's checks."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def test_advertise_address_is_what_a_client_dials() -> None:
    assert advertise_address("", "0.0.0.0", 5) == "127.0.0.1:5"
    assert advertise_address("", "::", 5) == "[::1]:5"
    assert advertise_address("", "10.0.0.2", 5) == "10.0.0.2:5"
    assert advertise_address("", "fd00::2", 5) == "[fd00::2]:5"
    assert advertise_address("rank-0.internal:7000", "0.0.0.0", 5) == "rank-0.internal:7000"


def test_link_registers_heartbeats_and_survives_a_router_restart(
    tmp_path: Path, background_loop: asyncio.AbstractEventLoop
) -> None:
    router_port = free_port()
    router = f"127.0.0.1:{router_port}"
    settings = {
        "KVSERVE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # no Redis: the router keeps state in memory
        "KVSERVE_HEARTBEAT_INTERVAL_SECS": str(HEARTBEAT_S),
        "KVSERVE_RANK_DOWN_AFTER_SECS": "3",
    }
    free = {"blocks": 60}
    attempts = {"calls": 0}  # the link reads the load as it builds each RegisterRank or Heartbeat

    def load() -> EngineStats:
        attempts["calls"] += 1
        return engine_stats(free["blocks"])

    def attempts_after(count: int) -> Callable[[], bool]:
        target = attempts["calls"] + count + 1  # one more begun: `count` have ended
        return lambda: attempts["calls"] >= target

    identity = RankIdentity("rank-link-test", "127.0.0.1:50999", "incarnation-1", 16, b"n" * 16)
    link = RouterLink(router, identity, load, interval_s=HEARTBEAT_S, timeout_s=1)

    # The link starts before the router exists: it must keep trying, quietly.
    background_loop.call_soon_threadsafe(link.start)
    wait_until(attempts_after(3), 10, "three attempts to register")
    assert not link.registered

    with start_router(tmp_path / "router-1.log", router_port, **settings):
        wait_until(lambda: "rank-link-test" in ranks(router), 10, "the rank registered")
        status = ranks(router)["rank-link-test"]
        assert status.healthy and status.address == "127.0.0.1:50999"
        assert status.load.waiting_prefill_tokens == 777 and status.load.total_blocks == 100
        assert status.load.waiting_warm_prefill_tokens == 300, "the warm part of the queue reaches the router"
        free["blocks"] = 42  # heartbeats carry the current load
        wait_until(lambda: ranks(router)["rank-link-test"].load.free_blocks == 42, 10, "load updated")
        beats = link.heartbeats
        wait_until(lambda: link.heartbeats > beats + 2, 10, "heartbeats acknowledged")

    # A new router (no Redis) has never heard of the rank: the heartbeat says known=false, the link registers.
    with start_router(tmp_path / "router-2.log", router_port, **settings) as process:
        wait_until(lambda: "rank-link-test" in ranks(router), 10, "the rank registered again")
        assert ranks(router)["rank-link-test"].healthy
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    # beats against a dead router: nothing raises, the task keeps running
    wait_until(attempts_after(3), 10, "three heartbeats against the dead router")
    assert link.running
    asyncio.run_coroutine_threadsafe(link.stop(), background_loop).result(10)


def test_link_reports_its_expert_parallel_group(tmp_path: Path, background_loop: asyncio.AbstractEventLoop) -> None:
    """Registration and every heartbeat carry the rank's group; the router lists it (and none for a plain rank)."""
    router_port = free_port()
    router = f"127.0.0.1:{router_port}"
    settings = {
        "KVSERVE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "KVSERVE_HEARTBEAT_INTERVAL_SECS": str(HEARTBEAT_S),
    }
    grouped = RankIdentity("rank-ep", "127.0.0.1:50998", "inc-ep", 16, b"n" * 16, "ep-2", 1, 2)
    plain = RankIdentity("rank-plain", "127.0.0.1:50997", "inc-plain", 16, b"n" * 16)
    links = [RouterLink(router, rank, lambda: engine_stats(50), interval_s=HEARTBEAT_S) for rank in (grouped, plain)]
    with start_router(tmp_path / "router.log", router_port, **settings):
        for link in links:
            background_loop.call_soon_threadsafe(link.start)
        wait_until(lambda: all(link.heartbeats > 2 for link in links), 10, "both ranks heartbeating")
        listed = ranks(router)
        assert listed["rank-ep"].HasField("expert_parallel")
        place = listed["rank-ep"].expert_parallel
        assert (place.group, place.rank, place.size) == ("ep-2", 1, 2)
        assert not listed["rank-plain"].HasField("expert_parallel")
        for link in links:
            asyncio.run_coroutine_threadsafe(link.stop(), background_loop).result(10)
    assert "expert-parallel group ep-2 rank 1/2" in (tmp_path / "router.log").read_text()
