"""This rank's presence at the router: RegisterRank once the engine is ready, then a Heartbeat with its load
every heartbeat interval. A heartbeat answered known=false (the router restarted, or declared this rank
dead) registers again. The router being away never touches serving: failed calls are retried quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from contracts import internal_auth
from contracts.service_main import client_target
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc
from rank_worker.engine.interface import EngineStats

log = logging.getLogger(__name__)

# Reach a restarted router within about a heartbeat (gRPC's default reconnect backoff grows to two minutes).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass(frozen=True)
class RankIdentity:
    rank_id: str
    address: str  # host:port the gateways and the router use to reach this rank
    incarnation: str  # unique per process start
    block_size: int
    hash_namespace: bytes
    expert_parallel_group: str = ""  # the rank's expert-parallel group (config expert_parallel_group); "" = none
    expert_parallel_rank: int = 0  # its place in the group
    expert_parallel_size: int = 1  # ranks in the group

    def expert_parallel(self) -> pb.ExpertParallelPlace | None:
        """The group place the router is told, in registration and every heartbeat; None out of any group."""
        if not self.expert_parallel_group:
            return None
        return pb.ExpertParallelPlace(
            group=self.expert_parallel_group, rank=self.expert_parallel_rank, size=self.expert_parallel_size
        )


def advertise_address(configured: str, host: str, port: int) -> str:
    """Where others reach this rank: the configured address, else host:port as a client would dial it."""
    return configured or client_target(host, port)


def rank_load(stats: EngineStats) -> pb.RankLoad:
    return pb.RankLoad(
        running=stats.running,
        waiting=stats.waiting,
        waiting_prefill_tokens=stats.waiting_prefill_tokens,
        free_blocks=stats.free_blocks,
        total_blocks=stats.total_blocks,
        waiting_warm_prefill_tokens=stats.waiting_warm_prefill_tokens,
    )


class RouterLink:
    """Keeps this rank registered at `router_address` from a task on the server's event loop."""

    def __init__(
        self,
        router_address: str,
        identity: RankIdentity,
        load: Callable[[], EngineStats],
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.router_address = router_address
        self.identity = identity
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.registered = False  # the router has acknowledged this incarnation and not forgotten it since
        self.heartbeats = 0  # acknowledged heartbeats (tests, logs)
        self._load = load
        self._reachable = True  # as last seen, so a failure is logged once, not every interval
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        async with internal_auth.aio_channel(self.router_address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.RouterStub(channel)
            while True:
                await self.beat(stub)
                await asyncio.sleep(self.interval_s)

    async def beat(self, stub: pb_grpc.RouterStub) -> None:
        """One register-or-heartbeat exchange; never raises for a router that is away."""
        try:
            if self.registered:
                reply = await stub.Heartbeat(
                    pb.HeartbeatRequest(
                        rank_id=self.identity.rank_id,
                        incarnation=self.identity.incarnation,
                        load=rank_load(self._load()),
                        expert_parallel=self.identity.expert_parallel(),
                    ),
                    timeout=self.timeout_s,
                )
                if reply.known:
                    self.heartbeats += 1
                else:
                    log.info("the router at %s does not know this rank: registering again", self.router_address)
                    self.registered = False
            if not self.registered:
                await self._register(stub)
            self._mark_reachable()
        except grpc.aio.AioRpcError as exc:
            self._mark_unreachable(f"{exc.code().name}: {exc.details()}")

    async def _register(self, stub: pb_grpc.RouterStub) -> None:
        identity = self.identity
        await stub.RegisterRank(
            pb.RegisterRankRequest(
                rank_id=identity.rank_id,
                address=identity.address,
                incarnation=identity.incarnation,
                block_size=identity.block_size,
                hash_namespace=identity.hash_namespace,
                load=rank_load(self._load()),
                expert_parallel=identity.expert_parallel(),
            ),
            timeout=self.timeout_s,
        )
        self.registered = True
        group = f", expert-parallel group {identity.expert_parallel_group}" if identity.expert_parallel_group else ""
        log.info(
            "registered with the router at %s as %s (%s%s)",
            self.router_address,
            identity.rank_id,
            identity.address,
            group,
        )

    def _mark_reachable(self) -> None:
        if not self._reachable:
            log.info("the router at %s answers again", self.router_address)
        self._reachable = True

    def _mark_unreachable(self, reason: str) -> None:
        if self._reachable:
            log.warning(
                "the router at %s did not answer (%s): retrying every %.1f s; serving is not affected",
                self.router_address,
                reason,
                self.interval_s,
            )
        else:
            log.debug("the router at %s still does not answer: %s", self.router_address, reason)
        self._reachable = False
