"""KV events in vLLM's format from real processes: a rank worker (L0, medium GPU) and the kvstore it writes
through to (L1, medium CPU), each publishing on its loopback ZMQ endpoints, read by a subscriber written from
vLLM's documented format (tests/vllm_kv_subscriber.py): BlockStored chains with the prompt's tokens, evictions
as BlockRemoved, and the replay socket returning the buffered batches with their sequences. Also the block
pool's STORED events along chains, which those BlockStored events come from."""

from __future__ import annotations

import time
from pathlib import Path

from engine_fixtures import random_prompt
from l1_fixtures import kvstore_settings
from service_processes import free_port, start_kvstore, start_rank_worker
from vllm_kv_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, Received, Subscriber, events_of

from contracts import internal_auth
from contracts.block_hash import chain_block_hash
from contracts.kv_events import KvEvent, KvEventKind
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc
from rank_worker.engine.block_pool import BlockPool

BLOCK = 16
VOCAB = 49152  # SmolLM2
H = [bytes([i]) * 16 for i in range(8)]


def test_the_pool_merges_stored_blocks_with_tokens_only_along_a_chain() -> None:
    pool = BlockPool(8, caching=True)
    pool.record_stored_tokens = True
    blocks = pool.allocate(5)
    pool.register(blocks[0], H[0], None, (1, 2))
    pool.register(blocks[1], H[1], H[0], (3, 4))
    pool.register(blocks[2], H[2], H[7], (5, 6))  # another sequence's block, interleaved
    pool.register(blocks[3], H[3], H[1], (7, 8))  # the first chain again: a new event
    assert not pool.register(blocks[4], H[3], H[1], (7, 8))  # held by another block: no event
    pool.register(blocks[4], H[4], H[3], (9, 10))
    assert pool.drain_events() == [
        KvEvent(KvEventKind.STORED, (H[0], H[1]), None, (1, 2, 3, 4)),
        KvEvent(KvEventKind.STORED, (H[2],), H[7], (5, 6)),
        KvEvent(KvEventKind.STORED, (H[3], H[4]), H[1], (7, 8, 9, 10)),
    ]
    pool.release(blocks)
    pool.clear_cache()
    (removed,) = pool.drain_events()
    assert removed.kind is KvEventKind.REMOVED and set(removed.block_hashes) == set(H[:5])


def test_without_tokens_the_pool_merges_runs_as_before() -> None:
    pool = BlockPool(4, caching=True)
    blocks = pool.allocate(2)
    pool.register(blocks[0], H[0])
    pool.register(blocks[1], H[2])
    assert pool.drain_events() == [KvEvent(KvEventKind.STORED, (H[0], H[2]))]


def generate(stub: pb_grpc.RankWorkerStub, prompt: list[int], max_tokens: int) -> None:
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    responses = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=120))
    assert responses[-1].HasField("finished")


def collect_until(sub: Subscriber, received: list[Received], done: object, timeout_s: float = 60) -> None:
    """Live batches into `received` until done() holds; a gap in the sequences (or nothing live, ZMQ's slow
    joiner) is filled from the replay socket, as vLLM's example subscriber does."""
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not all events came: {events_of(received)}"
        item = sub.receive(0.2)
        last = received[-1].sequence if received else -1
        if item is not None and item.sequence == last + 1:
            received.append(item)
            continue
        received.extend(batch for batch in sub.replay_from(last + 1) if batch.sequence > last)


def stored(received: list[Received], medium: str) -> list[BlockStored]:
    return [e for e in events_of(received) if isinstance(e, BlockStored) and e.medium == medium]


def stored_hashes(received: list[Received], medium: str) -> set[bytes]:
    return {h for e in stored(received, medium) for h in e.block_hashes}  # type: ignore[misc]


def test_rank_and_kvstore_publish_vllm_kv_events(tmp_path: Path) -> None:
    kvstore_port, rank_port = free_port(), free_port()
    rank_pub, rank_replay, l1_pub, l1_replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(4))
    l1_settings = {
        **kvstore_settings(tmp_path),
        "KVSERVE_KVSTORE_KV_EVENTS_ENDPOINT": l1_pub,
        "KVSERVE_KVSTORE_KV_EVENTS_REPLAY_ENDPOINT": l1_replay,
        "KVSERVE_KV_EVENTS_TOPIC": "kv@node",
    }
    rank_settings = {
        "KVSERVE_NUM_KV_BLOCKS": "20",
        "KVSERVE_MAX_MODEL_LEN": "320",
        "KVSERVE_KVSTORE": f"127.0.0.1:{kvstore_port}",
        "KVSERVE_KV_EVENTS_ENDPOINT": rank_pub,
        "KVSERVE_KV_EVENTS_REPLAY_ENDPOINT": rank_replay,
        "KVSERVE_KV_EVENTS_TOPIC": "kv@rank",
    }
    with (
        start_kvstore(tmp_path / "kvstore.log", kvstore_port, **l1_settings),
        start_rank_worker(tmp_path / "rank.log", rank_port, **rank_settings),
        internal_auth.channel(f"127.0.0.1:{rank_port}") as channel,
    ):
        rank_sub = Subscriber(rank_pub, rank_replay, topic="kv@rank")
        l1_sub = Subscriber(l1_pub, l1_replay, topic="kv@node")
        try:
            stub = pb_grpc.RankWorkerStub(channel)
            namespace = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).hash_namespace
            prompt = random_prompt(5 * BLOCK + 3, VOCAB, seed=71)
            generate(stub, prompt, 4)  # 87 tokens computed: the prompt's 5 full blocks

            gpu: list[Received] = []
            collect_until(rank_sub, gpu, lambda: len(stored_hashes(gpu, "GPU")) >= 5)
            assert isinstance(gpu[0].batch.events[0], AllBlocksCleared) and gpu[0].sequence == 0
            assert [item.sequence for item in gpu] == list(range(len(gpu)))
            chain: list[bytes] = []
            tokens: list[int] = []
            for event in stored(gpu, "GPU"):
                assert event.block_size == BLOCK and event.lora_id is None
                assert event.parent_block_hash == (chain[-1] if chain else None)
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                chain.extend(event.block_hashes)  # type: ignore[arg-type]
                tokens.extend(event.token_ids)
            assert tokens == prompt[: 5 * BLOCK]
            parent = namespace
            for index, block_hash in enumerate(chain):  # our 16-byte chain hashes, sent as bytes
                assert block_hash == chain_block_hash(parent, prompt[index * BLOCK : (index + 1) * BLOCK])
                parent = block_hash

            # The kvstore: the same blocks, written through to L1, as CPU blocks without tokens or parents.
            cpu: list[Received] = []
            collect_until(l1_sub, cpu, lambda: stored_hashes(cpu, "CPU") >= set(chain))
            assert isinstance(cpu[0].batch.events[0], AllBlocksCleared)
            for event in stored(cpu, "CPU"):
                assert event.block_size == BLOCK and event.token_ids == [] and event.parent_block_hash is None

            # A long prompt (19 blocks) evicts the first one's tail from the 20-block pool: BlockRemoved, GPU.
            generate(stub, random_prompt(300, VOCAB, seed=72), 2)

            def removed() -> set[bytes]:
                return {h for e in events_of(gpu) if isinstance(e, BlockRemoved) for h in e.block_hashes}  # type: ignore[misc]

            collect_until(rank_sub, gpu, lambda: set(chain[1:]) <= removed())
            assert all(e.medium == "GPU" for e in events_of(gpu) if isinstance(e, BlockRemoved))

            # Replay: every buffered batch from a sequence on, with its sequence, as it was published.
            replayed = rank_sub.replay_from(1)
            assert [item.sequence for item in replayed] == list(range(1, len(replayed) + 1))
            assert len(replayed) >= len(gpu) - 1
            assert [item.batch for item in replayed[: len(gpu) - 1]] == [item.batch for item in gpu[1:]]
        finally:
            rank_sub.close()
            l1_sub.close()
    assert "publishing GPU KV events in vLLM's format" in (tmp_path / "rank.log").read_text()
    assert "publishing CPU KV events in vLLM's format" in (tmp_path / "kvstore.log").read_text()
