"""Talking to rank workers over gRPC: which ranks exist (a static list until the router), what model they
serve, and one Generate stream whose refusals surface before any token is produced."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
]


class RankRefused(Exception):
    """The rank would not take the request; `code` says why (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"rank {target}: {code.name}: {details}")
        self.target, self.code, self.details = target, code, details


class RankFailed(Exception):
    """The rank accepted the request, then the stream broke."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str, tokens_sent: int) -> None:
        super().__init__(f"rank {target} failed after {tokens_sent} tokens: {code.name}: {details}")
        self.target, self.code, self.details, self.tokens_sent = target, code, details, tokens_sent


@dataclass
class RankStream:
    """An accepted Generate call: iterate token chunks, then read `finished`."""

    target: str
    call: grpc.aio.UnaryStreamCall
    finished: pb.Finished | None = None
    tokens_sent: int = 0
    cached_tokens: int = 0  # from the first chunk, so known even if we stop reading early
    queue_wait_s: float = 0.0

    async def token_chunks(self) -> AsyncIterator[list[int]]:
        try:
            async for response in self.call:
                if response.HasField("tokens"):
                    if self.tokens_sent == 0:
                        self.cached_tokens = response.tokens.cached_tokens
                        self.queue_wait_s = response.tokens.queue_wait_s
                    chunk = list(response.tokens.token_ids)
                    self.tokens_sent += len(chunk)
                    yield chunk
                elif response.HasField("finished"):
                    self.finished = response.finished
        except grpc.aio.AioRpcError as exc:
            raise RankFailed(self.target, exc.code(), exc.details() or "", self.tokens_sent) from exc
        if self.finished is None:
            raise RankFailed(self.target, grpc.StatusCode.UNKNOWN, "stream ended without Finished", self.tokens_sent)

    def cancel(self) -> None:
        self.call.cancel()


class RankClient:
    def __init__(self, targets: list[str]) -> None:
        if not targets:
            raise ValueError("no rank workers configured")
        self.targets = list(targets)
        self._channels = {t: grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS) for t in self.targets}
        self._stubs = {t: pb_grpc.RankWorkerStub(c) for t, c in self._channels.items()}

    def preference(self, session_id: str, avoid: set[str] | None = None) -> list[str]:
        """Ranks in the order to try: a session always starts at the same rank (its cache lives there)."""
        order = self.targets
        if session_id:
            start = int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest()) % len(order)
            order = order[start:] + order[:start]
        return [t for t in order if t not in (avoid or set())]

    async def model_info(self, timeout_s: float = 10.0) -> pb.ModelInfoResponse:
        errors = []
        for target in self.targets:
            try:
                return await self._stubs[target].ModelInfo(pb.ModelInfoRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{target}: {exc.code().name}")
        raise ConnectionError("no rank worker answered ModelInfo (" + ", ".join(errors) + ")")

    async def stats(self, target: str, timeout_s: float = 5.0) -> pb.StatsResponse:
        return await self._stubs[target].Stats(pb.StatsRequest(), timeout=timeout_s)

    async def start(self, target: str, request: pb.GenerateRequest, timeout_s: float | None) -> RankStream:
        """Open the stream and wait until the rank has accepted (or refused) the request."""
        call = self._stubs[target].Generate(request, timeout=timeout_s)
        try:
            metadata = await call.initial_metadata()
            if not any(key == "kvserve-accepted" for key, _ in (metadata or ())):
                # A refusal sends no headers of its own: the status follows the (empty) initial metadata.
                code = await call.code()
                raise RankRefused(target, code, await call.details() or "no acceptance from the rank")
        except grpc.aio.AioRpcError as exc:
            raise RankRefused(target, exc.code(), exc.details() or "") from exc
        return RankStream(target, call)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
