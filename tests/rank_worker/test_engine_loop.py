"""The engine loop around a real engine (tiny random weights through the factory): streaming, aborts,
KV event fan-out, failure recovery, stop, and sleeping while idle."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from contracts.config import KvServeConfig
from contracts.kv_event_feed import KvEventsEndedError
from contracts.kv_events import KvEventBatch, KvEventKind
from rank_worker.engine.factory import build_engine
from rank_worker.engine.interface import (
    Engine,
    EngineRequest,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)
from rank_worker.engine_loop import (
    EngineFailedError,
    EngineLoop,
    EngineLoopStoppedError,
    RequestStream,
)

VOCAB = 256
NUM_BLOCKS = 64
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    config_path = tmp_path_factory.mktemp("tiny-llama") / "config.json"
    config_path.write_text(json.dumps(TINY_LLAMA))
    config = KvServeConfig(model=str(config_path), load_format="dummy", device="cpu", num_kv_blocks=NUM_BLOCKS)
    return build_engine(config)


@pytest.fixture
def engine_loop(engine: Engine) -> Iterator[EngineLoop]:
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()
    assert engine.stats().used_blocks == 0  # every test leaves the pool as it found it


def request(request_id: str, prompt: list[int], max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % VOCAB for i in range(length)]


async def collect(stream: RequestStream) -> tuple[list[int], RequestOutput]:
    tokens: list[int] = []
    async for output in stream:
        tokens.extend(output.new_token_ids)
        if output.finished:
            return tokens, output
    raise AssertionError("stream ended without a finished output")


async def wait_for(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.01)


def test_streams_tokens_then_finished(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        tokens, final = await collect(engine_loop.submit(request("a", prompt_of(20, 1), max_tokens=6)))
        assert len(tokens) == 6 and all(0 <= t < VOCAB for t in tokens)
        assert final.finish_reason is FinishReason.LENGTH
        assert final.stats is not None and final.stats.prompt_tokens == 20 and final.stats.output_tokens == 6

    asyncio.run(run())


def test_invalid_request_fails_in_the_caller(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        with pytest.raises(InvalidRequestError, match="empty"):
            engine_loop.submit(request("empty", []))
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            engine_loop.submit(request("oov", [VOCAB]))
        assert engine_loop.in_flight() == 0

    asyncio.run(run())


def test_duplicate_request_id_is_refused_while_in_flight(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        first = engine_loop.submit(request("dup", prompt_of(10, 2), max_tokens=4))
        with pytest.raises(InvalidRequestError, match="already in flight"):
            engine_loop.submit(request("dup", prompt_of(10, 2)))
        await collect(first)
        await collect(engine_loop.submit(request("dup", prompt_of(10, 2), max_tokens=2)))  # free again

    asyncio.run(run())


def test_concurrent_requests_each_get_their_own_tokens(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        prompts = [prompt_of(12 + i, i) for i in range(8)]
        streams = [engine_loop.submit(request(f"c{i}", p, max_tokens=5)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert all(len(tokens) == 5 for tokens, _ in results)
        # Greedy and deterministic: the same prompt alone gives the same tokens as inside the batch.
        alone, _ = await collect(engine_loop.submit(request("again", prompts[3], max_tokens=5)))
        assert alone == results[3][0]

    asyncio.run(run())


def test_a_steps_outputs_reach_their_streams_in_one_hand_over(engine_loop: EngineLoop) -> None:
    """Eight requests decoding together: each step wakes the consumers' event loop once, not once per
    request (call_soon_threadsafe is a syscall on the engine thread), and every stream still gets its own
    tokens in order."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        hand_overs = 0
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal hand_overs
            hand_overs += 1
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        prompts = [prompt_of(16, 40 + i) for i in range(8)]
        streams = [engine_loop.submit(request(f"h{i}", p, max_tokens=12)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
        assert all(len(tokens) == 12 for tokens, _ in results)
        # 8 x 12 outputs; per step at most one hand-over (plus the submit wake-ups, which are not this loop's)
        assert hand_overs <= 12 + 4, hand_overs
        alone, _ = await collect(engine_loop.submit(request("h-alone", prompts[5], max_tokens=12)))
        assert alone == results[5][0]

    asyncio.run(run())


def test_abort_ends_the_stream_and_frees_blocks(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        stream = engine_loop.submit(request("long", prompt_of(40, 3), max_tokens=400))
        first = await anext(stream)
        assert first.new_token_ids and not first.finished
        assert engine_loop.abort("long")
        _, final = await collect(stream)
        assert final.finish_reason is FinishReason.ABORT
        await wait_for(lambda: engine_loop.stats().used_blocks == 0 and engine_loop.stats().running == 0)
        assert not engine_loop.abort("long")  # no longer in flight

    asyncio.run(run())


def test_abort_before_the_engine_sees_the_request(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        streams = [engine_loop.submit(request(f"q{i}", prompt_of(30, i), max_tokens=50)) for i in range(4)]
        for i in range(4):
            engine_loop.abort(f"q{i}")
        finals = [final for _, final in await asyncio.gather(*(collect(s) for s in streams))]
        assert all(f.finished for f in finals)
        await wait_for(lambda: engine_loop.stats().used_blocks == 0 and engine_loop.in_flight() == 0)

    asyncio.run(run())


def test_kv_events_fan_out_with_sequence_numbers(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        subscribers = [engine_loop.subscribe_kv_events() for _ in range(2)]
        await collect(engine_loop.submit(request("kv", prompt_of(48, 100), max_tokens=2)))
        for subscription in subscribers:
            batches: list[KvEventBatch] = []
            stored = 0
            while stored < 3:  # 48 new prompt tokens = 3 full blocks; batches may still be on their way
                batches.append(await asyncio.wait_for(subscription.get(), 5))
                stored += sum(len(e.block_hashes) for e in batches[-1].events if e.kind is KvEventKind.STORED)
            assert [b.sequence for b in batches] == list(range(1, len(batches) + 1))
            subscription.close()

    asyncio.run(run())


def test_slow_subscriber_loses_batches_and_sees_the_gap(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        subscription = engine_loop.subscribe_kv_events(max_batches=1)
        for i in range(3):
            await collect(engine_loop.submit(request(f"s{i}", prompt_of(33, 10 + i), max_tokens=1)))
        # A marker: a subscriber joining now gets its snapshot from an engine iteration after those of the
        # requests, handed to this loop after every batch they caused; once it is here, each of those batches
        # has been offered to `subscription` (kept or dropped).
        marker = engine_loop.subscribe_kv_events()
        await asyncio.wait_for(marker.get(), 5)
        marker.close()
        batch = await subscription.get()
        assert batch.sequence == 1 and subscription.dropped_batches >= 1
        subscription.close()

    asyncio.run(run())


def test_step_failure_fails_in_flight_requests_and_the_loop_keeps_serving(
    engine: Engine, engine_loop: EngineLoop, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_step = engine.step
    calls = {"n": 0}

    def step_failing_once() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == 2:  # after the first token, mid-stream
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine, "step", step_failing_once)  # fault injection into the real engine

    async def run() -> None:
        stream = engine_loop.submit(request("victim", prompt_of(20, 5), max_tokens=50))
        with pytest.raises(EngineFailedError, match="injected fault"):
            await collect(stream)
        await wait_for(lambda: engine_loop.stats().used_blocks == 0 and engine_loop.stats().running == 0)
        tokens, final = await collect(engine_loop.submit(request("survivor", prompt_of(20, 6), max_tokens=3)))
        assert len(tokens) == 3 and final.finish_reason is FinishReason.LENGTH

    with caplog.at_level(logging.ERROR, logger="rank_worker.engine_loop"):
        asyncio.run(run())
    assert any("injected fault" in (r.exc_text or "") for r in caplog.records)  # the traceback is logged


def test_stop_aborts_in_flight_and_refuses_new_work(engine: Engine) -> None:
    loop = EngineLoop(engine)
    loop.start()

    async def run() -> None:
        subscription = loop.subscribe_kv_events()
        stream = loop.submit(request("inflight", prompt_of(20, 7), max_tokens=400))
        await anext(stream)
        await asyncio.to_thread(loop.stop)
        _, final = await collect(stream)
        assert final.finish_reason is FinishReason.ABORT
        with pytest.raises(EngineLoopStoppedError):
            loop.submit(request("late", prompt_of(5, 8)))
        with pytest.raises(KvEventsEndedError):
            while True:
                await asyncio.wait_for(subscription.get(), 5)

    asyncio.run(run())
    assert engine.stats().used_blocks == 0 and not engine.has_unfinished()


def test_idle_loop_sleeps(engine_loop: EngineLoop) -> None:
    async def run() -> None:
        await collect(engine_loop.submit(request("warm", prompt_of(8, 9), max_tokens=2)))
        await wait_for(lambda: engine_loop.in_flight() == 0 and engine_loop.stats().running == 0)

    asyncio.run(run())
    cpu_before = time.process_time()
    time.sleep(0.5)  # the window measured, not a wait for anything
    assert time.process_time() - cpu_before < 0.1  # a busy-waiting loop would burn ~0.5 s of CPU here


def test_late_subscriber_gets_a_snapshot_of_the_cache_first(engine: Engine, engine_loop: EngineLoop) -> None:
    async def run() -> None:
        await collect(engine_loop.submit(request("before", prompt_of(64, 300), max_tokens=1)))
        subscription = engine_loop.subscribe_kv_events()
        first = await asyncio.wait_for(subscription.get(), 5)
        assert first.sequence == 1
        assert [e.kind for e in first.events] == [KvEventKind.ALL_CLEARED, KvEventKind.STORED]
        snapshot = set(first.events[1].block_hashes)
        # the engine holds no request: its cache cannot change under us
        await wait_for(lambda: engine_loop.in_flight() == 0 and not engine.has_unfinished())
        assert snapshot == set(engine.cached_block_hashes()) and len(snapshot) >= 3
        subscription.close()

    asyncio.run(run())


def test_step_timing_is_logged_with_prefill_and_decode_steps_apart(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    loop = EngineLoop(engine, timing_log_interval_s=0.0)  # a summary after every step
    loop.start()
    with caplog.at_level(logging.INFO, logger="rank_worker.engine_loop"):
        try:

            async def run() -> None:
                await collect(loop.submit(request("timed", prompt_of(40, 3), max_tokens=5)))

            asyncio.run(run())
        finally:
            loop.stop()  # joins the thread: the last step's summary is logged inside the capture
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine loop: ")]
    assert len(lines) >= 5  # one prefill step, then a decode step per further token
    assert "with prefill 1 at" in lines[0] and "decode-only 0" in lines[0]
    assert any("decode-only 1 at" in line for line in lines[1:])
    assert loop.last_step_timing is not None and loop.last_step_timing.steps == 1


def sampled_request(request_id: str, prompt: list[int], temperature: float, top_k: int = 0) -> EngineRequest:
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=3, max_tokens=6, ignore_eos=True)
    return EngineRequest(request_id, prompt, params)


def test_a_tiny_temperature_is_served_greedy_beside_other_requests(engine_loop: EngineLoop) -> None:
    # 1e-40 is a valid float the APIs accept: logits / 1e-40 overflowed and failed every request of the step
    async def run() -> None:
        prompts = [prompt_of(16, 40 + i) for i in range(3)]
        greedy = [engine_loop.submit(request(f"g{i}", p, max_tokens=6)) for i, p in enumerate(prompts)]
        tiny = engine_loop.submit(sampled_request("tiny", prompts[0], temperature=1e-40))
        results = await asyncio.gather(*(collect(s) for s in [*greedy, tiny]))
        assert all(len(tokens) == 6 for tokens, _ in results)
        assert results[3][0] == results[0][0]  # greedy: the same tokens as the greedy request on its prompt

    asyncio.run(run())


def test_a_requests_own_sampling_failure_fails_it_alone(
    engine: Engine, engine_loop: EngineLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rank_worker.engine import sampler

    real_top_k = sampler._top_k

    def failing_for_top_k_7(params, vocab):  # type: ignore[no-untyped-def]
        if params.top_k == 7:
            raise RuntimeError("injected sampling fault")
        return real_top_k(params, vocab)

    # Fault injection into the real engine: the batched sampler fails, falls back row by row, and names the row.
    monkeypatch.setattr(sampler, "_top_k", failing_for_top_k_7)

    async def run() -> None:
        others = [
            engine_loop.submit(request("greedy", prompt_of(16, 50), max_tokens=6)),
            engine_loop.submit(sampled_request("sampled", prompt_of(16, 51), temperature=0.8)),
        ]
        victim = engine_loop.submit(sampled_request("victim", prompt_of(16, 52), temperature=0.8, top_k=7))
        with pytest.raises(EngineFailedError, match="injected sampling fault"):
            await collect(victim)
        results = await asyncio.gather(*(collect(s) for s in others))
        assert [len(tokens) for tokens, _ in results] == [6, 6]
        assert all(final.finish_reason is FinishReason.LENGTH for _, final in results)
        await wait_for(lambda: engine_loop.stats().used_blocks == 0 and engine_loop.in_flight() == 0)

    asyncio.run(run())


def test_progress_is_reported_only_while_the_engine_thread_makes_progress(engine: Engine) -> None:
    loop = EngineLoop(engine, max_step_s=0.3)
    loop.start()
    release = threading.Event()
    real_step = engine.step

    def stuck_step() -> list[RequestOutput]:
        release.wait(10)  # a hung kernel: the engine thread is inside a step and does not come back
        return real_step()

    async def run() -> None:
        stream = loop.submit(request("p", prompt_of(20, 60), max_tokens=400))
        await wait_for(lambda: loop.progress("p") is not None and not loop.progress("p").queued)  # type: ignore[union-attr]
        progress = loop.progress("p")
        assert progress is not None and progress.computed_prompt_tokens == 20  # launched counts (pipeline_steps)
        engine.step = stuck_step  # type: ignore[method-assign]
        await wait_for(lambda: loop.progress("p") is None)  # stuck past max_step_s: no progress to report
        release.set()
        await wait_for(lambda: loop.progress("p") is not None)  # iterating again
        loop.abort("p")
        await collect(stream)

    try:
        asyncio.run(run())
    finally:
        release.set()
        del engine.step  # the instance attribute; the class's step again
        loop.stop()


def _generate_kinds(engine: Engine, max_step_s: float, first_step_s: float) -> list[str]:
    """The Generate stream's message kinds for one request whose first (prefill) step takes first_step_s."""
    from rank_worker.servicer import response_messages

    loop = EngineLoop(engine, max_step_s=max_step_s)
    loop.start()
    real_step = engine.step
    steps = {"n": 0}

    def slow_first_step() -> list[RequestOutput]:
        steps["n"] += 1
        if steps["n"] == 1:
            time.sleep(first_step_s)  # a long prefill step, or a stuck one
        return real_step()

    engine.step = slow_first_step  # type: ignore[method-assign]

    async def run() -> list[str]:
        stream = loop.submit(request("slow", prompt_of(20, 70), max_tokens=2))
        return [str(m.WhichOneof("kind")) async for m in response_messages(stream, loop, progress_interval_s=0.1)]

    try:
        return asyncio.run(run())
    finally:
        del engine.step
        loop.stop()


def test_the_generate_stream_carries_progress_only_while_the_engine_makes_progress(engine: Engine) -> None:
    kinds = _generate_kinds(engine, max_step_s=5.0, first_step_s=1.0)
    assert kinds[0] == "progress" and kinds.count("progress") >= 5  # about every 0.1 s of the 1 s step
    assert kinds[-1] == "finished" and "tokens" in kinds
    # the same step, but past max_step_s: a stuck engine thread, and the stream goes quiet
    stuck = _generate_kinds(engine, max_step_s=0.3, first_step_s=1.5)
    assert stuck.count("progress") <= 4 and stuck[-1] == "finished"
