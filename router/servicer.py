"""The Router gRPC service: check and convert wire messages, call RouterState, convert back. Nothing else."""

from __future__ import annotations

import grpc

from contracts.address import split_host_port
from contracts.block_hash import BLOCK_HASH_BYTES
from contracts.ids import MAX_ID_CHARS
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc
from router.durable_state import DurableState
from router.rank_registry import ExpertParallelPlace, RankEntry, RankIdentity, RankLoad
from router.router_state import NoRankAvailableError, RouteQuery, RouterState
from router.session_view import FinishedCall, SessionStats

NO_RANK_ANSWER = (("kvserve-no-rank", "1"),)  # trailing metadata of Route's "no healthy rank left"


class InvalidMessageError(ValueError):
    """A request the router refuses with INVALID_ARGUMENT."""


def _check_id(name: str, value: str, *, required: bool) -> str:
    if required and not value:
        raise InvalidMessageError(f"{name} is required")
    if len(value) > MAX_ID_CHARS:
        raise InvalidMessageError(f"{name} is longer than {MAX_ID_CHARS} characters")
    if not value.isprintable():
        raise InvalidMessageError(f"{name} has unprintable characters")
    return value


def _check_address(address: str) -> str:
    try:
        split_host_port(address)
    except ValueError:
        raise InvalidMessageError(f"address must be host:port, got {address!r}") from None
    return _check_id("address", address, required=True)


def rank_load(message: pb.RankLoad) -> RankLoad:
    """The registry's load for a wire load; negative counts are refused."""
    load = RankLoad(
        running=message.running,
        waiting=message.waiting,
        waiting_prefill_tokens=message.waiting_prefill_tokens,
        free_blocks=message.free_blocks,
        total_blocks=message.total_blocks,
        waiting_warm_prefill_tokens=message.waiting_warm_prefill_tokens,
    )
    counts = (
        load.running,
        load.waiting,
        load.waiting_prefill_tokens,
        load.waiting_warm_prefill_tokens,
        load.free_blocks,
        load.total_blocks,
    )
    if min(counts) < 0:
        raise InvalidMessageError("load counts must not be negative")
    if load.waiting_warm_prefill_tokens > load.waiting_prefill_tokens:
        raise InvalidMessageError("waiting_warm_prefill_tokens must not exceed waiting_prefill_tokens")
    return load


def rank_identity(message: pb.RegisterRankRequest) -> RankIdentity:
    if message.block_size <= 0:
        raise InvalidMessageError("block_size must be positive")
    return RankIdentity(
        rank_id=_check_id("rank_id", message.rank_id, required=True),
        address=_check_address(message.address),
        incarnation=_check_id("incarnation", message.incarnation, required=True),
        block_size=message.block_size,
        hash_namespace=bytes(message.hash_namespace),
    )


def expert_parallel_place(message: pb.ExpertParallelPlace) -> ExpertParallelPlace | None:
    """The registry's group place for a wire one; None for no group (unset, or an empty name)."""
    if not message.group:
        return None
    group = _check_id("expert_parallel.group", message.group, required=True)
    if message.size < 1 or not 0 <= message.rank < message.size:
        raise InvalidMessageError(
            f"expert_parallel: rank {message.rank} of a group of {message.size} (0 <= rank < size is required)"
        )
    return ExpertParallelPlace(group, message.rank, message.size)


def expert_parallel_message(place: ExpertParallelPlace | None) -> pb.ExpertParallelPlace | None:
    return None if place is None else pb.ExpertParallelPlace(group=place.group, rank=place.rank, size=place.size)


def route_query(message: pb.RouteRequest) -> RouteQuery:
    if message.prompt_tokens < 0:
        raise InvalidMessageError("prompt_tokens must not be negative")
    hashes = list(message.block_hashes)
    if any(len(block_hash) != BLOCK_HASH_BYTES for block_hash in hashes):
        raise InvalidMessageError(f"block_hashes must be {BLOCK_HASH_BYTES} bytes each")
    return RouteQuery(
        request_id=_check_id("request_id", message.request_id, required=False),
        session_id=_check_id("session_id", message.session_id, required=False),
        block_hashes=hashes,
        prompt_tokens=message.prompt_tokens,
        avoid_rank_ids=frozenset(message.avoid_rank_ids),
    )


def finished_call(message: pb.ReportFinishedRequest) -> FinishedCall:
    """The session view's call for a wire report: ids as Route takes them, counts >= 0, l0 + l1 <= prompt."""
    counts = (message.prompt_tokens, message.l0_cached_tokens, message.l1_cached_tokens, message.output_tokens)
    if min(counts) < 0:
        raise InvalidMessageError("token counts must not be negative")
    if message.l0_cached_tokens + message.l1_cached_tokens > message.prompt_tokens:
        raise InvalidMessageError("l0_cached_tokens + l1_cached_tokens must not exceed prompt_tokens")
    return FinishedCall(
        session_id=_check_id("session_id", message.session_id, required=True),
        rank_id=_check_id("rank_id", message.rank_id, required=True),
        prompt_tokens=message.prompt_tokens,
        l0_cached_tokens=message.l0_cached_tokens,
        l1_cached_tokens=message.l1_cached_tokens,
        output_tokens=message.output_tokens,
    )


def session_message(stats: SessionStats) -> pb.SessionStats:
    return pb.SessionStats(
        session_id=stats.session_id,
        rank_id=stats.rank_id,
        calls=stats.calls,
        prompt_tokens=stats.prompt_tokens,
        l0_cached_tokens=stats.l0_cached_tokens,
        l1_cached_tokens=stats.l1_cached_tokens,
        computed_tokens=stats.computed_tokens,
        output_tokens=stats.output_tokens,
        cache_hit=stats.cache_hit,
        cold_prefills=stats.cold_prefills,
        first_seen_unix_s=stats.first_seen,
        last_seen_unix_s=stats.last_seen,
        ranks_used=len(stats.rank_ids),
    )


def load_message(load: RankLoad) -> pb.RankLoad:
    return pb.RankLoad(
        running=load.running,
        waiting=load.waiting,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        free_blocks=load.free_blocks,
        total_blocks=load.total_blocks,
        waiting_warm_prefill_tokens=load.waiting_warm_prefill_tokens,
    )


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, state: RouterState, durable: DurableState | None) -> None:
        self._state = state
        self._durable = durable

    async def RegisterRank(
        self, request: pb.RegisterRankRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterRankResponse:
        try:
            identity, load = rank_identity(request), rank_load(request.load)
            place = expert_parallel_place(request.expert_parallel)
        except InvalidMessageError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._state.register_rank(identity, load, place)
        return pb.RegisterRankResponse()

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        try:
            rank_id = _check_id("rank_id", request.rank_id, required=True)
            load = rank_load(request.load)
            place = expert_parallel_place(request.expert_parallel)
        except InvalidMessageError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.HeartbeatResponse(known=self._state.heartbeat(rank_id, request.incarnation, load, place))

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        try:
            query = route_query(request)
        except InvalidMessageError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            answer = self._state.route(query)
        except NoRankAvailableError as exc:
            # Marked, so a gateway tells this answer from a router that is away (also UNAVAILABLE).
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailing_metadata=NO_RANK_ANSWER)
        choice = answer.choice
        return pb.RouteResponse(
            rank_id=choice.rank_id,
            address=answer.address,
            expected_l0_tokens=choice.expected_l0_tokens,
            expected_l1_tokens=choice.expected_l1_tokens,
            reason=choice.reason,
        )

    async def ListRanks(self, request: pb.ListRanksRequest, context: grpc.aio.ServicerContext) -> pb.ListRanksResponse:
        return pb.ListRanksResponse(
            ranks=[self._rank_status(entry) for entry in self._state.ranks()],
            l1_blocks=self._state.index.l1_blocks,
            redis_connected=self._durable is not None and self._durable.connected,
            sessions=len(self._state.sessions),
        )

    async def ReportRankFailure(
        self, request: pb.ReportRankFailureRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportRankFailureResponse:
        try:
            rank_id = _check_id("rank_id", request.rank_id, required=True)
            request_id = _check_id("request_id", request.request_id, required=False)
        except InvalidMessageError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._state.report_failure(rank_id, request.detail[:1000], request_id)  # unknown or already down: nothing to do
        return pb.ReportRankFailureResponse()

    async def ReportFinished(
        self, request: pb.ReportFinishedRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportFinishedResponse:
        try:
            call = finished_call(request)
        except InvalidMessageError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._state.session_view.report(call)
        return pb.ReportFinishedResponse()

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:
        view = self._state.session_view
        return pb.ListSessionsResponse(
            sessions=[session_message(stats) for stats in view.newest(request.limit)],
            tracked=len(view),
            warm_prefix_fraction=view.warm_prefix_fraction,
        )

    def _rank_status(self, entry: RankEntry) -> pb.RankStatus:
        return pb.RankStatus(
            rank_id=entry.rank_id,
            address=entry.identity.address,
            healthy=entry.healthy,
            load=load_message(entry.load),
            l0_blocks=self._state.index.l0_blocks(entry.rank_id),
            last_heartbeat_age_s=self._state.heartbeat_age(entry),
            expert_parallel=expert_parallel_message(entry.expert_parallel),
        )
