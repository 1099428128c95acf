"""The gateway's Generation against a real rank worker: the prompt's block hashes are computed once per request,
in the worker thread that tokenizes it (never on the event loop), then go to the router's query and, with
their namespace, in the Generate request; the rank's cache answers the second request from them."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_processes import free_port, start_rank_worker
from starlette.requests import Request

import gateway.ranks.prompt_hashes as prompt_hashes
from contracts.block_hash import lookup_block_hashes, prefix_block_hashes
from gateway.flow import prepare_off_loop
from gateway.prompt.chat import ChatMessage, ChatRequest
from gateway.prompt.prompt_format import PromptFormat
from gateway.prompt.served_model import ServedModel
from gateway.ranks.generation import Finish, Generation
from gateway.ranks.rank_choice import RankChoice, StaticRanks
from gateway.ranks.rank_client import RankClient, RankStream
from protos import rank_worker_pb2 as pb
from protos import router_pb2 as router_pb


@pytest.fixture(scope="module")
def rank_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path: Path = tmp_path_factory.mktemp("hash-rank") / "rank.log"
    with start_rank_worker(log_path, port, KVSERVE_NUM_KV_BLOCKS="256", KVSERVE_MAX_MODEL_LEN="1024"):
        yield f"127.0.0.1:{port}"


class SeenRanks(StaticRanks):
    """The static chooser, keeping each route query it was asked."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__(addresses)
        self.queries: list[router_pb.RouteRequest] = []

    async def choose(self, query: router_pb.RouteRequest, avoid: set[str]) -> RankChoice | None:
        self.queries.append(query)
        return await super().choose(query, avoid)


class SentRequests(RankClient):
    """The real rank client, keeping each Generate request it sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[pb.GenerateRequest] = []

    async def start(
        self, target: str, request: pb.GenerateRequest, timeout_s: float | None, accept_timeout_s: float | None = None
    ) -> RankStream:
        self.sent.append(request)
        return await super().start(target, request, timeout_s, accept_timeout_s)


def test_hashes_computed_off_the_loop_once_go_to_the_router_and_the_rank(
    rank_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashing_threads: list[int] = []
    hash_prefix = prompt_hashes.prefix_block_hashes

    def recorded(*args: object) -> list[bytes]:
        hashing_threads.append(threading.get_ident())
        return hash_prefix(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prompt_hashes, "prefix_block_hashes", recorded)

    async def scenario() -> None:
        loop_thread = threading.get_ident()
        ranks, chooser = SentRequests(), SeenRanks([rank_address])
        info = await ranks.model_info([rank_address])
        model = ServedModel.from_info(info)
        generation = Generation(ranks, chooser, model, PromptFormat.for_model(model), 10.0, 120.0)
        words = " ".join(f"word{i}" for i in range(120))
        chat = ChatRequest([ChatMessage("user", f"Repeat after me: {words}")], max_tokens=4, temperature=0.0)
        chat.model = model.name
        try:
            finishes = []
            for turn in range(2):
                prepared = await prepare_off_loop(Request({"type": "http"}), generation, chat, f"msg_hashes{turn}")
                opened = await generation.open(prepared)
                events = [event async for event in opened.events()]
                assert isinstance(events[-1], Finish)
                finishes.append(events[-1])
            namespace, block_size, ids = info.hash_namespace, info.block_size, prepared.prompt_ids
            assert len(ids) > 4 * block_size
            assert hashing_threads and loop_thread not in hashing_threads
            assert len(hashing_threads) == 2  # once per request
            assert prepared.block_hashes == prefix_block_hashes(namespace, ids, block_size)
            for query, request in zip(chooser.queries, ranks.sent, strict=True):
                assert query.block_hashes == lookup_block_hashes(namespace, ids, block_size)
                assert list(request.prompt_block_hashes) == prepared.block_hashes
                assert request.block_hash_namespace == namespace
            assert finishes[1].usage.cached_tokens == (len(ids) - 1) // block_size * block_size

            # A stream continued on another rank: the continued prompt's chain, from the prompt's, off the loop.
            hashing_threads.clear()
            continuation = [int(t) for t in ids[:37]]
            stream, _ = await generation._start(dataclasses.replace(prepared, max_tokens=64), set(), continuation)
            stream.cancel()
            assert hashing_threads and loop_thread not in hashing_threads
            continued = list(ranks.sent[-1].prompt_block_hashes)
            assert continued == prefix_block_hashes(namespace, ids + continuation, block_size)
            assert chooser.queries[-1].block_hashes == lookup_block_hashes(namespace, ids + continuation, block_size)
        finally:
            await ranks.close()

    asyncio.run(scenario())
