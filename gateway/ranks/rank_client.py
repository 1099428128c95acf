"""Talking to rank workers over gRPC: what model they serve, and one Generate stream whose refusals surface
before any token is produced. Which rank to talk to is rank_choice's business.

A broken stream is either the rank's fault (RankFailed: the transport broke, the stream ended without its
Finished message, or the caller found it silent) or the request's own (RequestFailed: the rank ended it with
a status of its own, our deadline passed, we cancelled it): only the first counts against the rank."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts import internal_auth
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    # Reach a restarted rank within a second of its start, not after gRPC's default backoff (up to minutes):
    # streams cut by its restart wait for it.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class RankRefused(Exception):
    """The rank would not take the request; `code` says why (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"rank {target}: {code.name}: {details}")
        self.target, self.code, self.details = target, code, details


class RankFailed(Exception):
    """The rank accepted the request, then the stream broke: the rank's fault, the request may go on elsewhere."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str, tokens_sent: int) -> None:
        super().__init__(f"rank {target} failed after {tokens_sent} tokens: {code.name}: {details}")
        self.target, self.code, self.details, self.tokens_sent = target, code, details, tokens_sent


class RequestFailed(Exception):
    """The request ended on a healthy rank: its own failure (INTERNAL, INVALID_ARGUMENT), our deadline, or
    our cancel. Not retried elsewhere, and it says nothing against the rank."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str, tokens_sent: int) -> None:
        super().__init__(f"request failed on rank {target} after {tokens_sent} tokens: {code.name}: {details}")
        self.target, self.code, self.details, self.tokens_sent = target, code, details, tokens_sent


def rank_at_fault(code: grpc.StatusCode, cancelled_by_us: bool = False) -> bool:
    """Whether a call that ended with `code` says the rank (process or connection) is broken. UNAVAILABLE is
    the transport's (refused, reset, closed) or a rank stopping; CANCELLED that we did not ask for is a rank
    going away. Every other status is an answer the rank gave about this request, or our own deadline."""
    return code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.CANCELLED and not cancelled_by_us)


@dataclass
class RankStream:
    """An accepted Generate call: iterate token chunks, then read `finished`."""

    target: str
    call: grpc.aio.UnaryStreamCall
    finished: pb.Finished | None = None
    tokens_sent: int = 0
    l0_cached_tokens: int = 0  # from the first chunk, so known even if we stop reading early
    l1_cached_tokens: int = 0
    queue_wait_s: float = 0.0
    last_heard: float = 0.0  # time.monotonic() of the last message (token, progress, finished) or acceptance
    cancelled_by_us: bool = False
    progress: pb.Progress | None = None  # the last one, while no token came
    request_id: str = ""  # as the rank got it: the client's id, `<id>+<n>` for a continuation after n tokens

    async def token_chunks(self) -> AsyncIterator[list[int]]:
        try:
            async for response in self.call:
                self.last_heard = time.monotonic()
                if response.HasField("progress"):
                    self.progress = response.progress
                elif response.HasField("tokens"):
                    if self.tokens_sent == 0:
                        self.l0_cached_tokens = response.tokens.l0_cached_tokens
                        self.l1_cached_tokens = response.tokens.l1_cached_tokens
                        self.queue_wait_s = response.tokens.queue_wait_s
                    chunk = list(response.tokens.token_ids)
                    self.tokens_sent += len(chunk)
                    yield chunk
                elif response.HasField("finished"):
                    self.finished = response.finished
        except grpc.aio.AioRpcError as exc:
            failure = RankFailed if rank_at_fault(exc.code(), self.cancelled_by_us) else RequestFailed
            raise failure(self.target, exc.code(), exc.details() or "", self.tokens_sent) from exc
        if self.finished is None:
            raise RankFailed(self.target, grpc.StatusCode.UNKNOWN, "stream ended without Finished", self.tokens_sent)

    def silent_for(self) -> float:
        """Seconds since the rank last said anything on this stream."""
        return time.monotonic() - self.last_heard

    def cancel(self) -> None:
        self.cancelled_by_us = True
        self.call.cancel()


class RankClient:
    """gRPC channels to rank workers, one per address, opened on first use (the router names new ranks)."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.RankWorkerStub] = {}

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = internal_auth.aio_channel(target, options=CHANNEL_OPTIONS)
        return channel

    def _stub(self, target: str) -> pb_grpc.RankWorkerStub:
        stub = self._stubs.get(target)
        if stub is None:
            stub = self._stubs[target] = pb_grpc.RankWorkerStub(self._channel(target))
        return stub

    async def serving(self, target: str, timeout_s: float) -> bool:
        """Whether the rank says SERVING on the standard health service within timeout_s (waiting that long for
        a connection): False while it is down, loading its model, or hung."""
        request = health_pb2.HealthCheckRequest(service="")
        try:
            reply = await health_pb2_grpc.HealthStub(self._channel(target)).Check(
                request, timeout=timeout_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def model_info(self, targets: list[str], timeout_s: float = 10.0) -> pb.ModelInfoResponse:
        errors = []
        for target in targets:
            try:
                return await self._stub(target).ModelInfo(pb.ModelInfoRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{target}: {exc.code().name}")
        raise ConnectionError("no rank worker answered ModelInfo (" + ", ".join(errors) + ")")

    async def start(
        self, target: str, request: pb.GenerateRequest, timeout_s: float | None, accept_timeout_s: float | None = None
    ) -> RankStream:
        """Open the stream and wait until the rank has accepted (or refused) the request; a rank that does
        neither within accept_timeout_s (a stopped process) is refused as UNAVAILABLE."""
        call = self._stub(target).Generate(request, timeout=timeout_s)
        try:
            try:
                metadata = await asyncio.wait_for(call.initial_metadata(), accept_timeout_s)
            except TimeoutError:
                call.cancel()
                raise RankRefused(
                    target, grpc.StatusCode.UNAVAILABLE, f"did not accept the request within {accept_timeout_s:.1f} s"
                ) from None
            if not any(key == "kvserve-accepted" for key, _ in (metadata or ())):
                # A refusal sends no headers of its own: the status follows the (empty) initial metadata.
                code = await call.code()
                raise RankRefused(target, code, await call.details() or "no acceptance from the rank")
        except grpc.aio.AioRpcError as exc:
            raise RankRefused(target, exc.code(), exc.details() or "") from exc
        except asyncio.CancelledError:  # the caller gave up waiting (a client gone): the rank must not go on
            call.cancel()
            raise
        return RankStream(target, call, last_heard=time.monotonic(), request_id=request.request_id)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
