"""A soak: thousands of requests through the router to two rank workers with a tiny L0 pool (preemptions)
and an L1 arena, a third of them cancelled at random points. At the end every pool is empty: no block is
referenced in L0, no slot pinned or half-written in L1.

The model is random weights in a tiny Llama shape, so the soak measures bookkeeping, not arithmetic. A
component test: the clients stand in for the gateway, speaking gRPC to the router and the ranks as it does;
tests/e2e/test_gateway_soak_e2e.py is the soak through the real gateway (fewer requests, the embedded model)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from service_processes import ROOT
from whole_stack import Stack, whole_stack

from contracts import internal_auth
from contracts.block_hash import lookup_block_hashes
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc
from protos import router_pb2, router_pb2_grpc

REQUESTS = 2000
CONCURRENCY = 24
SESSIONS = 40
RANK_SETTINGS = {
    "KVSERVE_MODEL": str(ROOT / "bench/shapes/tiny/config.json"),
    "KVSERVE_LOAD_FORMAT": "dummy",
    "KVSERVE_NUM_KV_BLOCKS": "48",  # 768 tokens: concurrent requests outgrow it and get preempted
    "KVSERVE_MAX_MODEL_LEN": "512",
    "KVSERVE_MAX_NUM_SEQS": "16",
    "KVSERVE_MAX_NUM_BATCHED_TOKENS": "256",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("soak")
    with whole_stack(tmp, ranks=2, rank_settings=RANK_SETTINGS, gateway=False, l1_host_gb="0.05") as s:
        yield s


class SoakClient:
    """Route through the router, then stream from the chosen rank, as the gateway does."""

    def __init__(self, stack: Stack, info: pb.ModelInfoResponse) -> None:
        self.info = info
        self.router = router_pb2_grpc.RouterStub(internal_auth.channel(stack["router"].address))
        self.ranks = {
            stack[name].address: pb_grpc.RankWorkerStub(internal_auth.channel(stack[name].address))
            for name in stack.rank_names()
        }
        self.lock = threading.Lock()
        self.outcomes = {"finished": 0, "cancelled": 0}

    def one(self, index: int, rng: random.Random, session_prompts: list[list[int]]) -> None:
        session = index % SESSIONS
        with self.lock:  # a session's conversation grows turn by turn, as an agent's does
            prompt = session_prompts[session]
            if len(prompt) > 380:
                prompt = prompt[:64]
            prompt = prompt + [rng.randrange(self.info.vocab_size) for _ in range(rng.randrange(4, 40))]
            session_prompts[session] = prompt
        hashes = lookup_block_hashes(self.info.hash_namespace, prompt, self.info.block_size)
        route = self.router.Route(
            router_pb2.RouteRequest(
                request_id=f"soak-{index}", session_id=f"s{session}", block_hashes=hashes, prompt_tokens=len(prompt)
            ),
            timeout=10,
        )
        request = pb.GenerateRequest(
            request_id=f"soak-{index}",
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0.8, max_tokens=rng.randrange(1, 24), ignore_eos=True),
        )
        call = self.ranks[route.address].Generate(request, timeout=120)
        cancel_after = rng.randrange(0, 6) if rng.random() < 0.33 else None
        chunks = 0
        try:
            for response in call:
                if cancel_after is not None and chunks >= cancel_after:
                    call.cancel()
                    break
                chunks += response.HasField("tokens")
            else:
                with self.lock:
                    self.outcomes["finished"] += 1
                return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                raise
        with self.lock:
            self.outcomes["cancelled"] += 1


def test_soak_ends_with_every_pool_empty(stack: Stack) -> None:
    first = stack.rank_names()[0]
    with internal_auth.channel(stack[first].address) as channel:
        info = pb_grpc.RankWorkerStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10)
    client = SoakClient(stack, info)
    session_prompts: list[list[int]] = [[] for _ in range(SESSIONS)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(client.one, i, random.Random(i), session_prompts) for i in range(REQUESTS)]
        for future in futures:
            future.result(timeout=600)
    assert sum(client.outcomes.values()) == REQUESTS
    assert client.outcomes["cancelled"] > REQUESTS // 5 and client.outcomes["finished"] > REQUESTS // 2

    stack.wait_until("every pool empty in L0 and L1", stack.holds_nothing, timeout_s=60)
    ranks = [stack.rank_stats(name) for name in stack.rank_names()]
    assert sum(r.preemptions for r in ranks) > 0  # the pool was really too small
    assert sum(r.l1_offloaded_blocks for r in ranks) > 0
    assert sum(r.finished_requests for r in ranks) >= REQUESTS
    assert stack.kvstore_stats().stored_slots > 0
