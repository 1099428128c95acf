"""A component test: the router's L1 feed against the real kvstore process, the test standing in for the rank
that writes to it: blocks committed to the kvstore show up as L1 presence (expected_l1_tokens in Route), and a
killed kvstore empties L1 in the router. tests/e2e/test_routing_e2e.py checks the same through the whole stack
(the ranks write L1, the gateway's requests are routed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from router_event_source import KvEventSource
from router_prompts import lookup_hashes, prompt_tokens
from service_processes import free_port, start_kvstore, start_router

from contracts import internal_auth
from protos import kvstore_pb2 as kv_pb
from protos import kvstore_pb2_grpc as kv_grpc
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not true after {timeout_s}s")
        time.sleep(0.05)


def test_l1_presence_comes_from_the_kvstore(tmp_path: Path) -> None:
    kvstore_port, router_port = free_port(), free_port()
    kvstore_settings = {
        "KVSERVE_L1_HOST_GB": "0.05",
        "KVSERVE_L1_ARENA_DIR": str(tmp_path),
        "KVSERVE_L1_HEADROOM_GB": "0",
    }
    router_settings = {
        "KVSERVE_KVSTORE": f"127.0.0.1:{kvstore_port}",
        "KVSERVE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # none there: memory only
    }
    tokens = prompt_tokens(1, 16 * 8 + 5)
    hashes = lookup_hashes(tokens)
    rank = KvEventSource(free_port()).start()  # an empty L0
    try:
        with (
            start_kvstore(tmp_path / "kvstore.log", kvstore_port, **kvstore_settings) as kvstore_process,
            start_router(tmp_path / "router.log", router_port, **router_settings),
            internal_auth.channel(f"127.0.0.1:{kvstore_port}") as kv_channel,
            internal_auth.channel(f"127.0.0.1:{router_port}") as channel,
        ):
            kvstore = kv_grpc.KvStoreStub(kv_channel)
            arena = kvstore.Attach(
                kv_pb.AttachRequest(rank_id="w", incarnation="w1", slot_bytes=1 << 16, hash_namespace=b"n" * 16),
                timeout=10,
            ).arena_id
            slots = kvstore.Allocate(
                kv_pb.AllocateRequest(rank_id="w", arena_id=arena, block_hashes=hashes[:5]), timeout=10
            ).slots
            assert all(slot >= 0 for slot in slots)
            kvstore.Commit(kv_pb.CommitRequest(rank_id="w", arena_id=arena, slots=slots), timeout=10)

            router = pb_grpc.RouterStub(channel)
            router.RegisterRank(
                pb.RegisterRankRequest(rank_id="r", address=rank.address, incarnation="i", block_size=16), timeout=5
            )
            wait_until(lambda: router.ListRanks(pb.ListRanksRequest(), timeout=2).l1_blocks == 5, 10, "L1 indexed")
            answer = router.Route(pb.RouteRequest(block_hashes=hashes, prompt_tokens=len(tokens)), timeout=5)
            assert (answer.expected_l0_tokens, answer.expected_l1_tokens) == (0, 80)

            kvstore_process.kill()
            kvstore_process.wait(timeout=10)
            wait_until(lambda: router.ListRanks(pb.ListRanksRequest(), timeout=2).l1_blocks == 0, 10, "L1 emptied")
            answer = router.Route(pb.RouteRequest(block_hashes=hashes, prompt_tokens=len(tokens)), timeout=5)
            assert answer.expected_l1_tokens == 0
    finally:
        rank.stop()
