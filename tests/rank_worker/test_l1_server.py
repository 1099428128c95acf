"""A real rank worker process wired to a real kvstore and router: flags and config reach L1 and the router
link, Stats reports the rank id and L1 counters, a restored prompt reports l1_cached_tokens on its first
chunk and in Finished, the router lists the rank healthy, and the worker stops cleanly."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from engine_fixtures import random_prompt
from l1_fixtures import kvstore_settings, kvstore_stats
from service_processes import free_port, start_kvstore, start_rank_worker, start_router

from contracts import internal_auth
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc
from protos import router_pb2 as router_pb
from protos import router_pb2_grpc as router_grpc
from rank_worker.main import config_from_args, parse_args

BLOCK = 16
VOCAB = 49152  # SmolLM2


def test_flags_override_rank_id_kvstore_and_router() -> None:
    args = parse_args(["--rank-id", "r7", "--kvstore", "10.0.0.1:1", "--router", "10.0.0.2:2", "--port", "0"])
    config = config_from_args(args)
    assert (config.rank_id, config.kvstore, config.router, config.rank_worker_port) == (
        "r7",
        "10.0.0.1:1",
        "10.0.0.2:2",
        0,
    )


def generate(stub: pb_grpc.RankWorkerStub, prompt: list[int], max_tokens: int) -> tuple[pb.TokenChunk, pb.Finished]:
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    responses = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=120))
    first = next(r.tokens for r in responses if r.HasField("tokens"))
    assert responses[-1].HasField("finished")
    return first, responses[-1].finished


def test_rank_worker_process_uses_l1_and_registers_with_the_router(tmp_path: Path) -> None:
    kvstore_port, router_port, rank_port = free_port(), free_port(), free_port()
    router_settings = {
        "KVSERVE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "KVSERVE_HEARTBEAT_INTERVAL_SECS": "0.2",
    }
    rank_settings = {
        "KVSERVE_NUM_KV_BLOCKS": "20",
        "KVSERVE_MAX_MODEL_LEN": "320",
        "KVSERVE_KVSTORE": f"127.0.0.1:{kvstore_port}",
        "KVSERVE_ROUTER": f"127.0.0.1:{router_port}",
        "KVSERVE_RANK_ID": "rank-l1-e2e",
        "KVSERVE_HEARTBEAT_INTERVAL_SECS": "0.2",
    }
    with (
        start_kvstore(tmp_path / "kvstore.log", kvstore_port, **kvstore_settings(tmp_path)),
        start_router(tmp_path / "router.log", router_port, **router_settings),
        start_rank_worker(tmp_path / "rank.log", rank_port, **rank_settings) as worker,
        internal_auth.channel(f"127.0.0.1:{rank_port}") as channel,
        internal_auth.channel(f"127.0.0.1:{router_port}") as router_channel,
    ):
        stub = pb_grpc.RankWorkerStub(channel)
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        assert stats.rank_id == "rank-l1-e2e" and stats.l1_attached

        a1_prompt = random_prompt(8 * BLOCK + 5, VOCAB, seed=61)
        _, a1 = generate(stub, a1_prompt, 4)
        assert a1.stats.l1_cached_tokens == 0
        generate(stub, random_prompt(300, VOCAB, seed=62), 2)  # evicts most of A from the 20-block pool
        first, a2 = generate(stub, a1_prompt + random_prompt(20, VOCAB, seed=63), 4)
        assert first.l1_cached_tokens >= 6 * BLOCK
        assert first.l1_cached_tokens + first.l0_cached_tokens == 8 * BLOCK
        assert (
            a2.stats.l1_cached_tokens == first.l1_cached_tokens and a2.stats.l0_cached_tokens == first.l0_cached_tokens
        )
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        assert stats.l1_restored_tokens == first.l1_cached_tokens
        assert stats.l1_offloaded_blocks >= 8 and stats.l1_copies_in_flight == 0
        assert stats.free_blocks == stats.total_blocks
        pins = kvstore_stats(kvstore_port)
        assert pins.pinned_slots == 0 and pins.writing_slots == 0

        router = router_grpc.RouterStub(router_channel)
        deadline = time.monotonic() + 10
        while True:
            listed = {r.rank_id: r for r in router.ListRanks(router_pb.ListRanksRequest(), timeout=2).ranks}
            if "rank-l1-e2e" in listed and listed["rank-l1-e2e"].load.total_blocks == 20:
                break
            assert time.monotonic() < deadline, f"the rank never showed up at the router: {listed}"
            time.sleep(0.1)
        assert listed["rank-l1-e2e"].healthy and listed["rank-l1-e2e"].address == f"127.0.0.1:{rank_port}"

        started = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        # The router's KvEvents stream is ended first, so it does not hold the 5 s shutdown grace open.
        assert time.monotonic() - started < 4
    log = (tmp_path / "rank.log").read_text()
    assert "L1 attached to the kvstore" in log and "registered with the router" in log
