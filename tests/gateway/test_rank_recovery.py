"""Waiting for a rank to come back, without processes: a rank client whose rank is down until a test brings it
back, streams that a script cuts. A new request and a cut stream wait for the rank (pinging meanwhile), go on
once it is back from the prompt plus the tokens already sent, and fail as they did before the wait (503, or
the stream's error) once rank_recovery_wait_s has passed; a rank that keeps failing still ends the request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest

from gateway.http.errors import StreamBroken, Unavailable, api_error_for
from gateway.prompt.chat import ChatRequest
from gateway.ranks.generation import MAX_RANK_SWITCHES, Generation, Ping, PreparedRequest
from gateway.ranks.rank_choice import StaticRanks
from gateway.ranks.rank_client import RankRefused, RankStream
from gateway.ranks.rank_recovery import RankRevivals
from protos import rank_worker_pb2 as pb

RANK = "127.0.0.1:1"
PROMPT = [11, 12, 13]
PING_S = 0.05


class ScriptedCall:
    """A Generate call: its token chunks, then Finished, or a broken transport (the rank killed) if `cut`."""

    def __init__(self, chunks: list[list[int]], cut: bool, on_cut: object = None) -> None:
        self.chunks, self.cut, self.on_cut = chunks, cut, on_cut
        self._done = False

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[pb.GenerateResponse]:
        for chunk in self.chunks:
            await asyncio.sleep(0.01)
            yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=chunk))
        self._done = True
        if self.cut:
            if callable(self.on_cut):
                self.on_cut()
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Socket closed"
            )
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH))

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._done = True


class RestartingRank:
    """The rank client: a rank that refuses connections and answers no probe while down; each accepted request
    plays the next script (chunks, cut). A cut takes the rank down for `down_s` (None: for good)."""

    def __init__(self, scripts: list[tuple[list[list[int]], bool]], up: bool = True, down_s: float | None = 0.3):
        self.scripts = list(scripts)
        self.up = up
        self.down_s = down_s
        self.starts: list[pb.GenerateRequest] = []
        self.refused = 0
        self.probes = 0

    async def start(
        self, target: str, request: pb.GenerateRequest, timeout_s: float | None, accept_timeout_s: float | None = None
    ) -> RankStream:
        if not self.up:
            self.refused += 1
            raise RankRefused(target, grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
        self.starts.append(request)
        chunks, cut = self.scripts.pop(0)
        call = ScriptedCall(chunks, cut, on_cut=self.go_down)
        return RankStream(target, call, last_heard=time.monotonic(), request_id=request.request_id)  # type: ignore[arg-type]

    async def serving(self, target: str, timeout_s: float) -> bool:
        self.probes += 1
        await asyncio.sleep(0.001)
        return self.up

    def go_down(self) -> None:
        self.up = False
        if self.down_s is not None:
            asyncio.get_running_loop().call_later(self.down_s, self.come_back)

    def come_back(self) -> None:
        self.up = True


def generation(ranks: RestartingRank, wait_s: float) -> Generation:
    model = SimpleNamespace(info=pb.ModelInfoResponse())  # no block size: no block hashes
    return Generation(
        ranks,  # type: ignore[arg-type]
        StaticRanks([RANK]),
        model,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]  # prompts: the token chunks are read below, not parsed
        ping_interval_s=PING_S,
        request_timeout_s=60.0,
        rank_stall_s=5.0,
        rank_recovery_wait_s=wait_s,
    )


def prepared(max_tokens: int = 50) -> PreparedRequest:
    return PreparedRequest(ChatRequest(messages=[]), "prompt", list(PROMPT), max_tokens, request_id="msg_test")


async def read_chunks(gen: Generation, request: PreparedRequest) -> tuple[list[int], int, object]:
    """The tokens and pings of one request, and how it ended: None, or the exception it raised."""
    opened = await gen.open(request)
    tokens: list[int] = []
    pings = 0
    try:
        async for item in opened._token_chunks():
            if isinstance(item, Ping):
                pings += 1
            else:
                tokens.extend(item)
    except Exception as exc:
        return tokens, pings, (exc, opened)
    return tokens, pings, (None, opened)


def test_a_new_request_with_no_rank_up_waits_then_gets_todays_503() -> None:
    ranks = RestartingRank([], up=False)
    gen = generation(ranks, wait_s=0.6)

    async def scenario() -> tuple[float, list[int], int, object, int]:
        began = time.monotonic()
        task = asyncio.create_task(read_chunks(gen, prepared()))
        while gen.waiting_for_rank == 0 and not task.done():  # until it waits for a rank (or has ended)
            assert time.monotonic() - began < 5, "the request neither waited for a rank nor ended"
            await asyncio.sleep(0.01)
        waiting = gen.waiting_for_rank
        tokens, pings, (error, _) = await task
        return time.monotonic() - began, tokens, pings, error, waiting

    elapsed, tokens, pings, error, waiting = asyncio.run(scenario())
    assert isinstance(error, Unavailable) and tokens == [] and waiting == 1 and gen.waiting_for_rank == 0
    assert 0.6 <= elapsed < 0.6 + 1.0, elapsed
    assert pings >= 0.6 / PING_S - 3  # the client's stream stayed alive
    # the answer the API gave before the wait: 503, api_error, retry later
    api_error = api_error_for(error)
    assert (api_error.status, api_error.kind) == (503, "api_error")
    assert api_error.message == "no rank worker is available; retry later" and api_error.retry_after_s
    # no busy loop: the dead rank was sent the request once, and probed a few times a second
    assert ranks.refused == 1 and ranks.probes <= 8, (ranks.refused, ranks.probes)


def test_a_new_request_goes_to_the_rank_once_it_is_back() -> None:
    ranks = RestartingRank([([[1, 2], [3]], False)], up=False)
    gen = generation(ranks, wait_s=10.0)

    async def scenario() -> tuple[list[int], int, object, float]:
        asyncio.get_running_loop().call_later(0.4, ranks.come_back)
        began = time.monotonic()
        tokens, pings, (error, opened) = await read_chunks(gen, prepared())
        return tokens, pings, (error, opened), time.monotonic() - began

    tokens, pings, (error, opened), elapsed = asyncio.run(scenario())
    assert error is None and tokens == [1, 2, 3] and pings >= 2
    assert elapsed < 0.4 + 1.5, elapsed  # once back, it was taken within a probe interval or two
    assert opened.rank_switches == 0  # no stream was cut: not a switch
    assert list(ranks.starts[0].prompt_token_ids) == PROMPT


def test_a_stream_cut_by_its_only_rank_goes_on_once_the_rank_is_back() -> None:
    # the rank dies after 3 tokens and is back 0.3 s later (a new incarnation at the same address)
    ranks = RestartingRank([([[1], [2], [3]], True), ([[4], [5]], False)], down_s=0.3)
    gen = generation(ranks, wait_s=10.0)
    tokens, pings, (error, opened) = asyncio.run(read_chunks(gen, prepared()))
    assert error is None, error
    assert tokens == [1, 2, 3, 4, 5] and pings >= 2
    # continued from the prompt plus the tokens sent, on the rank that failed, as it came back
    first, second = ranks.starts
    assert list(second.prompt_token_ids) == [*PROMPT, 1, 2, 3] and second.request_id == "msg_test+3"
    assert second.sampling.max_tokens == first.sampling.max_tokens - 3
    assert ranks.refused == 0  # the dead rank was not sent the continuation before its health said it was back
    assert opened.rank_switches == 1 and gen.waiting_for_rank == 0


def test_a_cut_stream_gives_up_after_the_recovery_wait_with_todays_error() -> None:
    ranks = RestartingRank([([[1], [2]], True)], down_s=None)
    gen = generation(ranks, wait_s=0.5)
    began = time.monotonic()
    tokens, _, (error, _) = asyncio.run(read_chunks(gen, prepared()))
    assert isinstance(error, StreamBroken) and tokens == [1, 2]
    assert "no other rank could continue" in str(error)
    assert 0.5 <= time.monotonic() - began < 0.5 + 1.0
    api_error = api_error_for(error)
    assert (api_error.status, api_error.kind) == (500, "api_error")


def test_a_rank_that_keeps_failing_ends_the_request_after_max_switches() -> None:
    # each incarnation serves one token and dies; each is back at once
    scripts = [([[i]], True) for i in range(1, MAX_RANK_SWITCHES + 3)]
    ranks = RestartingRank(scripts, down_s=0.05)
    gen = generation(ranks, wait_s=10.0)
    tokens, _, (error, opened) = asyncio.run(read_chunks(gen, prepared()))
    assert isinstance(error, StreamBroken)
    assert tokens == list(range(1, MAX_RANK_SWITCHES + 2)) and opened.rank_switches == MAX_RANK_SWITCHES


def test_one_probe_of_a_rank_serves_every_waiting_request() -> None:
    probes: list[str] = []

    async def probe(address: str, timeout_s: float) -> bool:
        probes.append(address)
        await asyncio.sleep(0.05)
        return True

    async def scenario() -> list[bool]:
        revivals = RankRevivals(probe)
        return await asyncio.gather(*(revivals.serving(RANK) for _ in range(500)))

    assert all(asyncio.run(scenario())) and probes == [RANK]


@pytest.mark.parametrize("wait_s", [0.0, -1.0])
def test_the_recovery_wait_must_be_positive(wait_s: float) -> None:
    from pydantic import ValidationError

    from contracts.config import KvServeConfig

    assert KvServeConfig().rank_recovery_wait_secs == 120.0
    with pytest.raises(ValidationError):
        KvServeConfig(rank_recovery_wait_secs=wait_s)
