"""A real rank worker process (python -m rank_worker, embedded SmolLM2-135M, small KV pool) over gRPC."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_processes import free_port, start_rank_worker
from tokenizers import Tokenizer

from contracts import internal_auth
from contracts.block_hash import BLOCK_HASH_BYTES, prefix_block_hashes
from protos import kv_events_pb2 as events_pb
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc

NUM_KV_BLOCKS = 256
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16
STEP_BUDGET = 512  # KVSERVE_MAX_NUM_BATCHED_TOKENS, as bench/peer_h200.sh gives `kvserve up` vLLM's budget
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]


@pytest.fixture(scope="module")
def worker_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rank-worker") / "worker.log"


@pytest.fixture(scope="module")
def worker(worker_log: Path) -> Iterator[str]:
    port = free_port()
    settings = {
        "KVSERVE_NUM_KV_BLOCKS": str(NUM_KV_BLOCKS),
        "KVSERVE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "KVSERVE_MAX_NUM_BATCHED_TOKENS": str(STEP_BUDGET),
    }
    with start_rank_worker(worker_log, port, **settings) as process:
        yield f"127.0.0.1:{port}"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    print(worker_log.read_text(errors="replace")[-3000:])
    assert process.returncode == 0, "the worker did not stop cleanly on SIGTERM"


@pytest.fixture(scope="module")
def channel(worker: str) -> Iterator[grpc.Channel]:
    with internal_auth.channel(worker, options=CHANNEL_OPTIONS) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.RankWorkerStub:
    return pb_grpc.RankWorkerStub(channel)


@pytest.fixture(scope="module")
def model_info(stub: pb_grpc.RankWorkerStub) -> pb.ModelInfoResponse:
    return stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)


@pytest.fixture(scope="module")
def tokenizer(model_info: pb.ModelInfoResponse) -> Tokenizer:
    return Tokenizer.from_str(model_info.tokenizer_json)


def generate_request(
    prompt: list[int], max_tokens: int = 8, request_id: str = "", ignore_eos: bool = True, **sampling: float
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling),
    )


def run_generate(stub: pb_grpc.RankWorkerStub, request: pb.GenerateRequest) -> tuple[list[list[int]], pb.Finished]:
    chunks: list[list[int]] = []
    finished: pb.Finished | None = None
    for response in stub.Generate(request, timeout=120):
        assert finished is None, "nothing may follow Finished"
        if response.HasField("tokens"):
            chunks.append(list(response.tokens.token_ids))
        elif response.HasField("finished"):  # Progress comes while no token is due (a slow machine)
            finished = response.finished
    assert finished is not None, "the stream must end with Finished"
    return chunks, finished


def wait_for_idle_pool(stub: pb_grpc.RankWorkerStub, timeout_s: float = 60.0) -> pb.StatsResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        if stats.used_blocks == 0 and stats.running == 0 and stats.waiting == 0:
            return stats
        assert time.monotonic() < deadline, f"pool not back at baseline: {stats}"
        time.sleep(0.1)


# ---- health, ModelInfo, Stats ----


def test_health_is_serving(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvserve.rank_worker.v1.RankWorker"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_model_info(model_info: pb.ModelInfoResponse, tokenizer: Tokenizer) -> None:
    assert model_info.served_model_name and model_info.model_id
    assert model_info.vocab_size == 49152
    assert model_info.max_model_len == MAX_MODEL_LEN
    assert model_info.trained_context_len >= MAX_MODEL_LEN
    assert model_info.block_size == BLOCK_SIZE
    assert len(model_info.hash_namespace) == BLOCK_HASH_BYTES
    assert "<|im_start|>" in model_info.chat_template
    assert model_info.eos_token_ids and model_info.eos_token
    assert tokenizer.get_vocab_size() <= model_info.vocab_size


def test_the_ready_line_names_the_pool_and_the_step_limits(stub: pb_grpc.RankWorkerStub, worker_log: Path) -> None:
    text = worker_log.read_text(errors="replace")
    assert f"KV pool: {NUM_KV_BLOCKS} blocks x {BLOCK_SIZE} tokens" in text
    assert f"max_model_len {MAX_MODEL_LEN}; max_num_batched_tokens {STEP_BUDGET}, max_num_seqs " in text


def test_stats_fields(stub: pb_grpc.RankWorkerStub) -> None:
    stats = stub.Stats(pb.StatsRequest(), timeout=10)
    assert stats.total_blocks == NUM_KV_BLOCKS and stats.block_size == BLOCK_SIZE
    assert 0 <= stats.free_blocks <= stats.total_blocks
    assert stats.used_blocks + stats.free_blocks == stats.total_blocks
    assert stats.prefix_hit_tokens <= stats.prefix_query_tokens


# ---- generation ----

PROMPT_TEXT = "<|im_start|>user\nName three prime numbers and explain why each of them is prime.<|im_end|>\n"


def test_streams_a_greedy_completion(stub: pb_grpc.RankWorkerStub, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False).ids
    assert len(prompt) > BLOCK_SIZE + 1  # at least one full block can come from the cache next time
    before = stub.Stats(pb.StatsRequest(), timeout=10)
    chunks, finished = run_generate(stub, generate_request(prompt, max_tokens=8))
    tokens = [t for chunk in chunks for t in chunk]
    assert all(chunks) and len(tokens) == 8
    assert finished.finish_reason == pb.FINISH_REASON_LENGTH and finished.stop_token_id == -1
    stats = finished.stats
    assert stats.prompt_tokens == len(prompt) and stats.output_tokens == 8
    assert stats.queue_wait_s >= 0 and stats.prefill_s > 0 and stats.total_s >= stats.prefill_s
    after = stub.Stats(pb.StatsRequest(), timeout=10)
    assert after.finished_requests == before.finished_requests + 1

    # The same request again: greedy gives the same tokens, and the prompt's full blocks come from L0.
    chunks_again, finished_again = run_generate(stub, generate_request(prompt, max_tokens=8))
    assert [t for chunk in chunks_again for t in chunk] == tokens
    cached = finished_again.stats.l0_cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached < len(prompt)


def test_stops_at_eos_without_ignore_eos(stub: pb_grpc.RankWorkerStub, tokenizer: Tokenizer) -> None:
    text = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    prompt = tokenizer.encode(text, add_special_tokens=False).ids
    _, finished = run_generate(stub, generate_request(prompt, max_tokens=64, ignore_eos=False))
    if finished.finish_reason == pb.FINISH_REASON_STOP:
        assert finished.stop_token_id >= 0
    else:
        assert finished.finish_reason == pb.FINISH_REASON_LENGTH


def test_generated_request_id_when_empty(stub: pb_grpc.RankWorkerStub) -> None:
    # Two empty ids at once must not collide with each other.
    calls = [stub.Generate(generate_request([1, 2, 3], max_tokens=2), timeout=60) for _ in range(2)]
    for call in calls:
        assert list(call)[-1].HasField("finished")


# ---- bad input ----

BAD_REQUESTS = {
    "empty prompt": (generate_request([]), "empty"),
    "prompt too long": (generate_request([1] * MAX_MODEL_LEN), "max_model_len"),
    "token id >= vocab": (generate_request([1, 2, 49152]), "vocabulary"),
    "negative token id": (generate_request([1, -5]), "vocabulary"),
    "max_tokens 0": (generate_request([1, 2], max_tokens=0), "max_tokens"),
    "max_tokens negative": (generate_request([1, 2], max_tokens=-3), "max_tokens"),
    "negative temperature": (generate_request([1, 2], temperature=-0.5), "temperature"),
    "top_p above 1": (generate_request([1, 2], top_p=1.5), "top_p"),
    "top_p negative": (generate_request([1, 2], top_p=-0.1), "top_p"),
    "top_k negative": (generate_request([1, 2], top_k=-1), "top_k"),
    "stop token outside vocab": (
        pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(max_tokens=2, stop_token_ids=[10**6])),
        "stop token",
    ),
    "sampling missing": (pb.GenerateRequest(prompt_token_ids=[1, 2]), "max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument(stub: pb_grpc.RankWorkerStub, case: str) -> None:
    request, expected = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in info.value.details()
    assert stub.Stats(pb.StatsRequest(), timeout=10).total_blocks == NUM_KV_BLOCKS  # still serving


def test_duplicate_request_id_in_flight(stub: pb_grpc.RankWorkerStub) -> None:
    first = stub.Generate(generate_request([5] * 20, max_tokens=64, request_id="same-id"), timeout=60)
    assert next(r for r in first if not r.HasField("progress")).HasField("tokens")  # it is running
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generate_request([6] * 20, max_tokens=2, request_id="same-id"), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in flight" in info.value.details()
    first.cancel()


def test_each_line_about_a_request_names_its_id(stub: pb_grpc.RankWorkerStub, worker_log: Path) -> None:
    run_generate(stub, generate_request([1, 2, 3, 4], max_tokens=3, request_id="msg_served"))
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(generate_request([], request_id="msg_refused"), timeout=30))
    cancelled = stub.Generate(generate_request([7] * 20, max_tokens=500, request_id="msg_cancelled"), timeout=60)
    assert next(r for r in cancelled if not r.HasField("progress")).HasField("tokens")  # it is running
    cancelled.cancel()
    expected = [
        r"accepted request=msg_served prompt_tokens=4 max_tokens=3$",
        r"finished request=msg_served reason=length prompt_tokens=4 .* output_tokens=3 ",
        r"refused request=msg_refused: .*empty",
        r"accepted request=msg_cancelled ",
        r"cancelled request=msg_cancelled: ",
    ]
    deadline = time.monotonic() + 30  # the cancel reaches the worker after this call returns
    while True:
        lines = worker_log.read_text(errors="replace").splitlines()
        missing = [pattern for pattern in expected if not any(re.search(pattern, line) for line in lines)]
        if not missing:
            break
        assert time.monotonic() < deadline, f"no line for {missing} in: {lines[-20:]}"
        time.sleep(0.1)


def test_still_serves_after_bad_input(stub: pb_grpc.RankWorkerStub) -> None:
    chunks, finished = run_generate(stub, generate_request([1, 2, 3, 4], max_tokens=3))
    assert sum(len(chunk) for chunk in chunks) == 3 and finished.finish_reason == pb.FINISH_REASON_LENGTH


# ---- cancellation ----


def test_cancelled_streams_free_their_blocks(worker: str, stub: pb_grpc.RankWorkerStub) -> None:
    shared = [(i * 37) % 4000 + 100 for i in range(24)]  # a common prefix: cancelled requests share cached blocks

    async def cancel_after_tokens(rank_worker: pb_grpc.RankWorkerStub, i: int) -> int:
        prompt = [*shared, 200 + i, 300 + i % 7, 400 + i]
        # Far more tokens than the test waits for: only working aborts can empty the pool before the deadline.
        call = rank_worker.Generate(generate_request(prompt, max_tokens=900), timeout=300)
        wanted, seen = 1 + i % 2, 0
        async for response in call:
            if response.HasField("tokens"):
                seen += len(response.tokens.token_ids)
                if seen >= wanted:
                    break
        call.cancel()
        return seen

    async def run() -> list[int]:
        async with internal_auth.aio_channel(worker) as channel:
            rank_worker = pb_grpc.RankWorkerStub(channel)
            return await asyncio.gather(*(cancel_after_tokens(rank_worker, i) for i in range(200)))

    seen = asyncio.run(run())
    assert all(count >= 1 for count in seen)  # each was cancelled mid-stream, not before it started
    stats = wait_for_idle_pool(stub)
    assert stats.free_blocks == stats.total_blocks  # cached blocks are evictable, hence free


# ---- KV events ----


def test_kv_events_report_stored_blocks(
    worker: str, model_info: pb.ModelInfoResponse, stub: pb_grpc.RankWorkerStub
) -> None:
    prompt = [(i * 53) % 40000 + 7 for i in range(3 * BLOCK_SIZE + 5)]  # 3 full blocks nobody else uses
    expected = set(prefix_block_hashes(model_info.hash_namespace, prompt, BLOCK_SIZE))

    async def run() -> list[events_pb.KvEventBatch]:
        async with internal_auth.aio_channel(worker) as channel:
            events = pb_grpc.RankWorkerStub(channel).KvEvents(events_pb.KvEventsRequest())
            # The server must have subscribed before the request runs: it has once the snapshot every
            # subscription starts with is here.
            batches: list[events_pb.KvEventBatch] = [await asyncio.wait_for(events.read(), timeout=30)]
            await asyncio.to_thread(run_generate, stub, generate_request(prompt, max_tokens=2))
            stored: set[bytes] = set()
            while True:
                for event in batches[-1].events:
                    if event.kind == events_pb.KV_EVENT_KIND_STORED:
                        stored.update(event.block_hashes)
                if expected <= stored:
                    break
                batches.append(await asyncio.wait_for(events.read(), timeout=30))
            events.cancel()
            return batches

    batches = asyncio.run(run())
    assert [batch.sequence for batch in batches] == list(range(1, len(batches) + 1))  # per subscriber, no gaps
    assert all(len(h) == BLOCK_HASH_BYTES for batch in batches for event in batch.events for h in event.block_hashes)
