"""The gateway's ReportFinished, against the router's real servicer in this process (loopback gRPC): a finished
request of a session is counted in the router's per-session view under the id the router routes by, in the
background; a router that is not there costs nothing but a `failed` count, and requests without a session or a
rank are not reported."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from contracts.config import KvServeConfig
from gateway.observability.request_log import RequestRecord
from gateway.ranks.rank_choice import RouterRanks
from gateway.ranks.session_key import routing_session_id
from gateway.state import GatewayState
from protos import router_pb2_grpc
from router.route_score import RoutePolicy
from router.router_state import RouterState
from router.servicer import RouterServicer


def reports(state: GatewayState, outcome: str) -> float:
    return state.metrics.session_reports.labels(outcome=outcome)._value.get()


async def until(check: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not true in time"
        await asyncio.sleep(0.01)


def record(session: str, rank: str = "rank-0", prompt: int = 100, cached: int = 0, l1: int = 0) -> RequestRecord:
    return RequestRecord(
        request_id="msg_1",
        api="anthropic",
        session=session,
        rank=rank,
        prompt_tokens=prompt,
        cached_tokens=cached,
        l1_cached_tokens=l1,
        output_tokens=4,
    )


def test_finished_requests_reach_the_router_view() -> None:
    async def go() -> None:
        router_state = RouterState(RoutePolicy(l1_restore_cost=0.1, overload_prefill_tokens=32_000), 600, 3)
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router_state, None), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        state = GatewayState(KvServeConfig(router=f"127.0.0.1:{port}"))
        state.chooser = RouterRanks(f"127.0.0.1:{port}", [])
        long_id = "x" * 5000  # the router takes at most MAX_ID_CHARS: the gateway routes it by a digest
        try:
            state.report_finished(record("alpha", prompt=100))
            state.report_finished(record("alpha", prompt=120, cached=112, l1=16))
            state.report_finished(record(long_id))
            state.report_finished(record("", prompt=10))  # no session: not reported
            state.report_finished(record("beta", rank=""))  # no rank took it: not reported
            await until(lambda: reports(state, "sent") == 3)
            view = {stats.session_id: stats for stats in router_state.session_view.newest()}
            assert set(view) == {"alpha", routing_session_id(long_id)}
            alpha = view["alpha"]
            assert (alpha.calls, alpha.prompt_tokens, alpha.l0_cached_tokens, alpha.l1_cached_tokens) == (
                2,
                220,
                96,
                16,
            )
            assert alpha.computed_tokens == 108 and alpha.cold_prefills == 1 and alpha.output_tokens == 8
            assert reports(state, "failed") == reports(state, "dropped") == 0
        finally:
            await state.close()
            await server.stop(None)

    asyncio.run(go())


def test_a_router_that_is_not_there_fails_nothing_but_the_report() -> None:
    async def go() -> None:
        server = grpc.aio.server()  # bound, then stopped: a port nothing listens on
        port = server.add_insecure_port("127.0.0.1:0")
        state = GatewayState(KvServeConfig(router=f"127.0.0.1:{port}"))
        state.chooser = RouterRanks(f"127.0.0.1:{port}", [])
        try:
            started = time.monotonic()
            state.report_finished(record("alpha"))  # returns at once, whatever the router does
            assert time.monotonic() - started < 0.1
            await until(lambda: reports(state, "failed") == 1)
            assert reports(state, "sent") == 0
        finally:
            await state.close()

    asyncio.run(go())


def test_without_a_router_nothing_is_sent() -> None:
    static = GatewayState(KvServeConfig())
    static.report_finished(record("alpha"))  # no chooser (accounting called outside the app) or a static list
    assert reports(static, "sent") == reports(static, "failed") == reports(static, "dropped") == 0
