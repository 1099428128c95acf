"""Which rank serves a request: the router's answer, or, without a router (or while it is away), a
session-hashed preference over the ranks we know, so a session still lands where its cache lives.

A router that does not answer (a timeout, a refused connection) is asked no more route questions: requests
route by the fallback at once, and the background refresher probes it every PROBE_INTERVAL_S until it
answers, so a hung router costs one ROUTE_TIMEOUT_S, not one per request."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Protocol

import grpc

from contracts import internal_auth
from protos import router_pb2 as router_pb
from protos import router_pb2_grpc as router_grpc

log = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 2.0
RANK_LIST_REFRESH_S = 2.0
PROBE_INTERVAL_S = 0.5  # while the router is away
PROBE_TIMEOUT_S = 1.0
NO_RANK_METADATA_KEY = "kvserve-no-rank"  # the router's answer "no rank is left", unlike a router that is away
REMEMBERED_SESSIONS = 100_000  # the router's last answer per session, for routing while it is away
# ReportFinished (the router's per-session view) is off every request's path: a short deadline, and beyond this
# many reports unanswered (a slow router) new ones are dropped rather than queued.
FINISHED_REPORT_TIMEOUT_S = 1.0
MAX_FINISHED_REPORTS_IN_FLIGHT = 256
# Reconnect to a restarted router within a second or two, not after gRPC's default backoff (up to minutes).
ROUTER_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class RankChoice:
    rank_id: str
    address: str
    reason: str = ""
    expected_l0_tokens: int = 0
    expected_l1_tokens: int = 0


class RankChooser(Protocol):
    async def choose(self, query: router_pb.RouteRequest, avoid: set[str]) -> RankChoice | None:
        """The rank to try next, never one whose rank_id is in `avoid`; None when none is left. `query` is the
        router's question as the gateway built it once per request, without avoid_rank_ids (`avoid` holds them)."""
        ...

    def report_failure(self, choice: RankChoice, detail: str, request_id: str) -> None:
        """A rank refused a connection or cut a stream (of the request `request_id`)."""
        ...

    def known_addresses(self) -> list[str]: ...

    async def close(self) -> None: ...


def session_preference(ranks: list[RankChoice], session_id: str) -> list[RankChoice]:
    """The ranks in the order to try: one session always starts at the same rank."""
    if not session_id or not ranks:
        return list(ranks)
    start = int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest()) % len(ranks)
    return ranks[start:] + ranks[:start]


def _no_rank_answer(exc: grpc.aio.AioRpcError) -> bool:
    return any(key == NO_RANK_METADATA_KEY for key, _ in (exc.trailing_metadata() or ()))


def router_away_error(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed router call means the router is away (hung, dead, unreachable) rather than an answer:
    a refusal (INVALID_ARGUMENT) or "no rank left" says the router is there."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return not _no_rank_answer(exc)
    return code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


class StaticRanks:
    """A fixed list of rank addresses (no router): the address is the rank's id."""

    def __init__(self, addresses: list[str]) -> None:
        if not addresses:
            raise ValueError("no rank workers configured")
        self._ranks = [RankChoice(address, address, "static") for address in addresses]

    async def choose(self, query: router_pb.RouteRequest, avoid: set[str]) -> RankChoice | None:
        return next((r for r in session_preference(self._ranks, query.session_id) if r.rank_id not in avoid), None)

    def report_failure(self, choice: RankChoice, detail: str, request_id: str) -> None:
        pass

    def known_addresses(self) -> list[str]:
        return [r.address for r in self._ranks]

    async def close(self) -> None:
        pass


class RouterRanks:
    """Routing by the router. While it does not answer, the last rank list it gave (or the static fallback
    list) is used with the session-hashed preference, so serving never depends on the router being up."""

    def __init__(self, router_address: str, fallback_addresses: list[str]) -> None:
        self.router_address = router_address
        self._channel = internal_auth.aio_channel(router_address, options=ROUTER_CHANNEL_OPTIONS)
        self._stub = router_grpc.RouterStub(self._channel)
        self._fallback = [RankChoice(a, a, "fallback") for a in fallback_addresses]
        self._known: list[RankChoice] = []  # healthy ranks from the router's last ListRanks
        self._sessions: OrderedDict[str, RankChoice] = OrderedDict()  # session -> the router's last choice
        self._router_down_since: float | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._failure_reports: set[asyncio.Task[None]] = set()
        self._finished_reports: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    @property
    def router_away(self) -> bool:
        return self._router_down_since is not None

    async def refresh(self) -> bool:
        """Read the router's rank list; False if the router did not answer."""
        timeout_s = PROBE_TIMEOUT_S if self.router_away else ROUTE_TIMEOUT_S
        try:
            reply = await self._stub.ListRanks(router_pb.ListRanksRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if router_away_error(exc):
                self._router_unreachable(exc)
            return False
        self._router_back()
        self._known = [RankChoice(r.rank_id, r.address, "fallback") for r in reply.ranks if r.healthy]
        return True

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(PROBE_INTERVAL_S if self.router_away else RANK_LIST_REFRESH_S)

    async def choose(self, query: router_pb.RouteRequest, avoid: set[str]) -> RankChoice | None:
        if self.router_away:  # the refresher brings it back once it answers
            return self._choose_without_router(query, avoid)
        request = router_pb.RouteRequest()
        request.CopyFrom(query)
        request.avoid_rank_ids.extend(sorted(avoid))
        try:
            reply = await self._stub.Route(request, timeout=ROUTE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # Also when the router answers that no rank is left, or refuses the query: the known list is then
            # tried, and each dead rank refuses at once, so the request still ends quickly.
            if router_away_error(exc):
                self._router_unreachable(exc)
            elif not _no_rank_answer(exc):
                log.warning("router refused to route %s: %s: %s", query.request_id, exc.code().name, exc.details())
            return self._choose_without_router(query, avoid)
        self._router_back()
        choice = RankChoice(
            reply.rank_id, reply.address, reply.reason, reply.expected_l0_tokens, reply.expected_l1_tokens
        )
        if query.session_id:
            self._sessions[query.session_id] = choice
            self._sessions.move_to_end(query.session_id)
            if len(self._sessions) > REMEMBERED_SESSIONS:
                self._sessions.popitem(last=False)
        return choice

    def _choose_without_router(self, query: router_pb.RouteRequest, avoid: set[str]) -> RankChoice | None:
        """The session's last rank while it is still known healthy (its cache is there), else the
        session-hashed preference over the known ranks."""
        candidates = self._known or self._fallback
        last = self._sessions.get(query.session_id)
        if last is not None and last.rank_id not in avoid and any(r.rank_id == last.rank_id for r in candidates):
            return RankChoice(last.rank_id, last.address, "remembered-session")
        preferred = session_preference(candidates, query.session_id)
        return next((r for r in preferred if r.rank_id not in avoid and r.address not in avoid), None)

    def report_failure(self, choice: RankChoice, detail: str, request_id: str) -> None:
        failure = router_pb.ReportRankFailureRequest(rank_id=choice.rank_id, detail=detail, request_id=request_id)

        async def report() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.ReportRankFailure(failure, timeout=ROUTE_TIMEOUT_S)

        _in_background(asyncio.get_running_loop(), report(), self._failure_reports)

    def report_finished(
        self, report: router_pb.ReportFinishedRequest, outcome: Callable[[str], None] = lambda _: None
    ) -> None:
        """Tell the router a session's request finished (its per-session view), in the background: never waits,
        never raises. `outcome` is called with "sent", "failed" (logged at debug) or "dropped" (the router is
        away, too many reports are unanswered, or no event loop runs)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            outcome("dropped")
            return
        if self.router_away or len(self._finished_reports) >= MAX_FINISHED_REPORTS_IN_FLIGHT:
            outcome("dropped")
            return

        async def send() -> None:
            try:
                await self._stub.ReportFinished(report, timeout=FINISHED_REPORT_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.debug("ReportFinished of session %s: %s: %s", report.session_id, exc.code().name, exc.details())
                outcome("failed")
            else:
                outcome("sent")

        _in_background(loop, send(), self._finished_reports)

    def known_addresses(self) -> list[str]:
        addresses = [r.address for r in self._known] or [r.address for r in self._fallback]
        return list(dict.fromkeys(addresses))

    def _router_unreachable(self, exc: grpc.aio.AioRpcError) -> None:
        if self._router_down_since is None:
            self._router_down_since = time.monotonic()
            log.warning(
                "router %s not answering (%s): routing by session hash over %d known rank(s) until it answers "
                "a probe again",
                self.router_address,
                exc.code().name,
                len(self._known or self._fallback),
            )

    def _router_back(self) -> None:
        if self._router_down_since is not None:
            log.warning(
                "router %s is back after %.1f s", self.router_address, time.monotonic() - self._router_down_since
            )
            self._router_down_since = None

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for task in list(self._finished_reports):
            task.cancel()
        await self._channel.close()


def _in_background(
    loop: asyncio.AbstractEventLoop, work: Coroutine[object, object, None], tasks: set[asyncio.Task[None]]
) -> None:
    """Run `work` as a task held in `tasks` until it is done (the loop keeps only weak references to tasks)."""
    task = loop.create_task(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
