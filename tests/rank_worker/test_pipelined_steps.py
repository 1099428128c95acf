"""pipeline_steps: a step scheduled and launched before the previous one's tokens are read (the input ids it
needs taken on the device) gives exactly the tokens of the plain engine, whatever ends a request meanwhile: a
length limit, a stop token drawn by the step in flight, an abort, an arrival, prefill chunks beside decodes, a
pool too small for everyone, a failed draw, a failed launch."""

from __future__ import annotations

import random

import pytest
from engine_fixtures import greedy, make_engine, random_prompt, run_to_completion
from l1_fixtures import tiny_model

from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.interface import EngineRequest, FinishReason, RequestsFailedError, SamplingParams
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.model_runner import LaunchedStep
from rank_worker.engine.scheduler import Scheduler
from rank_worker.engine.sequence import Sequence, SequenceStatus


def _prompts(count: int, vocab: int, seed: int, low: int = 5, high: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng.randint(low, high), vocab, seed=seed * 1000 + i) for i in range(count)]


def _run(model, tokenizer, requests: list[tuple[list[int], SamplingParams]], pipelined: bool, **settings):
    engine = make_engine(model, tokenizer, pipeline_steps=pipelined, **settings)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(EngineRequest(f"q{i}", prompt, params))
    outputs = run_to_completion(engine)
    return engine, [(outputs[f"q{i}"].new_token_ids, outputs[f"q{i}"].finish_reason) for i in range(len(requests))]


def _beside_plain(smollm2, count: int, seed: int, max_tokens: int):
    """Greedy requests, the plain engine's results for them, and a fresh pipelined engine to run them on."""
    model, tokenizer = smollm2
    requests = [(p, greedy(max_tokens)) for p in _prompts(count, model.cfg.vocab_size, seed=seed)]
    _, plain = _run(model, tokenizer, requests, pipelined=False)
    return requests, plain, make_engine(model, tokenizer, pipeline_steps=True)


def test_pipelined_steps_give_the_plain_engines_tokens(engine_model) -> None:
    model, tokenizer = engine_model
    prompts = _prompts(12, model.cfg.vocab_size, seed=1)
    requests = [(p, greedy(3 + i % 9)) for i, p in enumerate(prompts)]  # ending at 9 different steps
    _, plain = _run(model, tokenizer, requests, pipelined=False, max_num_seqs=16)
    engine, pipelined = _run(model, tokenizer, requests, pipelined=True, max_num_seqs=16)
    assert pipelined == plain
    assert engine.pipelined_steps > 0
    stats = engine.stats()
    assert stats.used_blocks == 0 and stats.running == 0


def test_a_stop_token_drawn_while_the_next_step_runs_ends_the_request_there(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = _prompts(6, model.cfg.vocab_size, seed=2)
    _, free_running = _run(model, tokenizer, [(p, greedy(12)) for p in prompts], pipelined=False)
    # Each request stops at its own 4th output token (the plain engine's), drawn by a step whose successor
    # was launched already: the successor's row for it is discarded.
    requests = [
        (p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens[3]]))
        for p, (tokens, _) in zip(prompts, free_running, strict=True)
    ]
    _, plain = _run(model, tokenizer, requests, pipelined=False)
    engine, pipelined = _run(model, tokenizer, requests, pipelined=True)
    assert pipelined == plain
    assert all(reason is FinishReason.STOP for _, reason in pipelined)
    assert engine.pipelined_steps > 0
    assert engine.stats().used_blocks == 0


def test_seeded_sampling_draws_the_same_tokens(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = _prompts(5, model.cfg.vocab_size, seed=3)
    requests = [
        (p, SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, ignore_eos=True, seed=50 + i))
        for i, p in enumerate(prompts)
    ]
    _, plain = _run(model, tokenizer, requests, pipelined=False)
    engine, pipelined = _run(model, tokenizer, requests, pipelined=True)
    assert pipelined == plain
    assert engine.pipelined_steps > 0


def test_a_pool_too_small_for_everyone_still_gives_the_plain_tokens(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = _prompts(8, model.cfg.vocab_size, seed=4, low=20, high=50)
    requests = [(p, greedy(20)) for p in prompts]
    settings = {"num_blocks": 10, "max_model_len": 160, "max_num_seqs": 8}
    _, plain = _run(model, tokenizer, requests, pipelined=False, **settings)
    engine, pipelined = _run(model, tokenizer, requests, pipelined=True, **settings)
    assert pipelined == plain
    stats = engine.stats()
    assert stats.preemptions > 0 and engine.pipelined_steps > 0
    assert stats.used_blocks == 0


def test_arrivals_and_aborts_while_a_step_runs(smollm2) -> None:
    """Requests arrive and are aborted between steps (so while one is in flight); the pool ends where it began
    and every request that was not aborted has the tokens it has alone."""
    model, tokenizer = smollm2
    vocab = model.cfg.vocab_size
    rng = random.Random(5)
    prompts = [random_prompt(rng.randint(3, 40), vocab, seed=500 + i) for i in range(30)]
    lengths = [rng.randint(2, 14) for _ in prompts]
    engine = make_engine(model, tokenizer, num_blocks=96, max_num_seqs=8, pipeline_steps=True)
    baseline = engine.stats()
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    aborted: set[str] = set()

    def take(outputs) -> None:
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)

    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(EngineRequest(f"a{i}", prompt, greedy(n)))
        for _ in range(rng.randint(1, 4)):
            take(engine.step())
        live = sorted(set(engine.requests) - finished)
        if live and rng.random() < 0.3:
            victim = rng.choice(live)
            assert engine.abort_request(victim) is not None
            aborted.add(victim)
    while engine.has_unfinished():
        take(engine.step())
    assert engine.pipelined_steps > 0
    stats = engine.stats()
    assert stats.used_blocks == baseline.used_blocks == 0 and stats.free_blocks == baseline.free_blocks
    alone = make_engine(model, tokenizer)
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        if f"a{i}" in aborted:
            continue
        alone.add_request(EngineRequest(f"a{i}", prompt, greedy(n)))
        expected = run_to_completion(alone)[f"a{i}"].new_token_ids
        assert tokens[f"a{i}"] == expected, f"a{i}"


def test_a_draw_that_fails_in_a_pipelined_step_fails_its_request_alone(smollm2) -> None:
    """The successor runs already, so the step is not retried: the other requests' tokens of that step come
    with the next call, and the failed request is the only one that ends."""
    requests, plain, engine = _beside_plain(smollm2, count=4, seed=6, max_tokens=8)
    launch = engine.runner.launch
    broken: list[str] = []

    def failing_once(batch, carried=None) -> LaunchedStep:
        launched = launch(batch, carried)
        seqs = launched.seqs
        if carried is not None and not broken:
            broken.append(seqs[0].request_id)
            read = launched.read

            def read_with_a_failure():
                drawn, failed = read()
                drawn.pop(seqs[0])
                return drawn, {seqs[0]: FloatingPointError("NaN scores"), **failed}

            launched.read = read_with_a_failure  # type: ignore[method-assign]
        return launched

    engine.runner.launch = failing_once  # type: ignore[method-assign]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(EngineRequest(f"q{i}", prompt, params))
    tokens: dict[str, list[int]] = {}
    failures: list[list[str]] = []
    ended: set[str] = set()
    while engine.has_unfinished():
        try:
            outputs = engine.step()
        except RequestsFailedError as exc:  # what the engine loop does: abort those, go on
            failures.append(exc.request_ids)
            for request_id in exc.request_ids:
                engine.abort_request(request_id)
                ended.add(request_id)
            continue
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert failures == [broken]
    for i, (expected, _) in enumerate(plain):
        if f"q{i}" not in ended:
            assert tokens[f"q{i}"] == expected
    assert engine.stats().used_blocks == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_step_cost_model_hears_every_step(smollm2, pipelined: bool) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer, pipeline_steps=pipelined)
    engine.add_request(EngineRequest("r", random_prompt(20, model.cfg.vocab_size, seed=7), greedy(6)))
    run_to_completion(engine)
    assert engine.scheduler.step_cost.steps == 6  # the prefill (with the first token), then 5 decodes


def test_padded_decode_steps_take_their_input_ids_on_the_device(smollm2) -> None:
    """The decode-graph path (run eagerly here: capture=False) pads the step and copies the in-flight tokens
    into the graph's input buffer: the same tokens as the plain engine."""
    from rank_worker.engine.decode_graphs import DecodeGraphs

    model, tokenizer = smollm2
    prompts = _prompts(7, model.cfg.vocab_size, seed=8)
    requests = [(p, greedy(4 + i % 5)) for i, p in enumerate(prompts)]  # 7 rows pad to 8; the batch shrinks
    _, plain = _run(model, tokenizer, requests, pipelined=False, max_num_seqs=8)
    engine = make_engine(model, tokenizer, pipeline_steps=True, max_num_seqs=8)
    runner = engine.runner
    runner.decode_graphs = DecodeGraphs(model, engine.kv_cache, runner.inputs, 8, capture=False)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(EngineRequest(f"q{i}", prompt, params))
    outputs = run_to_completion(engine)
    assert [(outputs[f"q{i}"].new_token_ids, outputs[f"q{i}"].finish_reason) for i in range(7)] == plain
    assert engine.pipelined_steps > 0 and runner.decode_graphs.steps > 0
    assert engine.stats().used_blocks == 0


def _record_launches(engine) -> list[tuple[int, int, bool]]:
    """Each launch as (decode rows, prefill chunks, whether it took input tokens on the device); one that
    raises fails the test (the engine would run the step again the ordinary way and hide the fault)."""
    launch = engine.runner.launch
    seen: list[tuple[int, int, bool]] = []

    def recording(batch, carried=None) -> LaunchedStep:
        decodes = sum(1 for _, n in batch.entries if n == 1)
        seen.append((decodes, len(batch.entries) - decodes, carried is not None))
        try:
            return launch(batch, carried)
        except Exception as exc:
            pytest.fail(f"launch {len(seen)} raised {exc!r}")

    engine.runner.launch = recording  # type: ignore[method-assign]
    return seen


def test_prefill_chunks_beside_decodes_are_pipelined_and_exact(smollm2) -> None:
    """Requests arrive while others decode and their prompts go in chunks (a 32-token step budget): the steps
    that carry a chunk beside decoding rows are launched before their predecessor is read, with the decoders'
    input ids taken on the device, and every request gets the plain engine's tokens."""
    model, tokenizer = smollm2
    vocab = model.cfg.vocab_size
    rng = random.Random(9)
    prompts = [random_prompt(rng.randint(20, 90), vocab, seed=900 + i) for i in range(10)]
    lengths = [rng.randint(3, 12) for _ in prompts]
    settings = {"max_num_batched_tokens": 32, "max_num_seqs": 8}

    def serve(pipelined: bool):
        engine = make_engine(model, tokenizer, pipeline_steps=pipelined, **settings)
        launches = _record_launches(engine)
        tokens: dict[str, list[int]] = {}

        def take(outputs) -> None:
            for out in outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

        for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
            engine.add_request(EngineRequest(f"m{i}", prompt, greedy(n)))
            for _ in range(3):  # the next one arrives while these are prefilling or decoding
                take(engine.step())
        while engine.has_unfinished():
            take(engine.step())
        return engine, tokens, launches

    _, plain, _ = serve(False)
    engine, pipelined, launches = serve(True)
    assert pipelined == plain
    assert all(len(plain[f"m{i}"]) == n for i, n in enumerate(lengths))
    mixed_pipelined = [launch for launch in launches if launch[0] and launch[1] and launch[2]]
    assert len(mixed_pipelined) >= 3, launches
    assert engine.stats().used_blocks == 0


def test_a_successor_whose_launch_fails_runs_once_its_predecessor_is_read(smollm2) -> None:
    """A pipelined launch that raises fails nobody: the step it was is launched the ordinary way by the next
    call, with its input tokens read by then."""
    requests, plain, engine = _beside_plain(smollm2, count=5, seed=10, max_tokens=7)
    launch = engine.runner.launch
    raised: list[int] = []

    def failing_once(batch, carried=None) -> LaunchedStep:
        if carried is not None and not raised:
            raised.append(len(batch.entries))
            raise RuntimeError("launch failed")
        return launch(batch, carried)

    engine.runner.launch = failing_once  # type: ignore[method-assign]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(EngineRequest(f"q{i}", prompt, params))
    outputs = run_to_completion(engine)
    assert raised == [5]
    assert [(outputs[f"q{i}"].new_token_ids, outputs[f"q{i}"].finish_reason) for i in range(5)] == plain
    assert engine.pipelined_steps > 0 and engine.stats().used_blocks == 0


def test_a_step_scheduled_while_its_predecessor_runs_preempts_nobody() -> None:
    """schedule(preempt=False): a running sequence that gets no block sits the step out and nobody is admitted;
    the ordinary schedule() preempts to make room."""
    kv = KvCacheManager(BlockPool(4, caching=True), 4, b"pipelined-schedule-test")
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    first, second, late = (Sequence(name, list(range(8)), 8, greedy(4), float(i)) for i, name in enumerate("abc"))
    scheduler.add(first)
    scheduler.add(second)
    assert [n for _, n in scheduler.schedule().entries] == [8, 8]  # two blocks each: the pool is full
    for seq in (first, second):
        seq.num_computed_tokens = 8
        seq.token_ids.append(5)  # each now needs a third block
    scheduler.add(late)
    batch = scheduler.schedule(preempt=False)
    assert batch.entries == [] and batch.skipped == [first, second] and batch.preempted == []
    assert scheduler.running == [first, second] and list(scheduler.waiting) == [late]
    assert scheduler.num_preemptions == 0
    batch = scheduler.schedule()
    assert batch.preempted == [second] and [seq for seq, _ in batch.entries] == [first]
    assert second.status is SequenceStatus.WAITING and scheduler.num_preemptions == 1


def _serve_schedule(engine, schedule: list[list[tuple[str, list[int], SamplingParams]]], aborts: dict[int, str]):
    """Submit schedule[i] before the i-th step call (and abort aborts[i] then), step until idle; each request's
    tokens and how it ended."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}

    def take(outputs) -> None:
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason

    for i, arrivals in enumerate(schedule):
        for request_id, prompt, params in arrivals:
            engine.add_request(EngineRequest(request_id, prompt, params))
        victim = aborts.get(i)
        if victim is not None and victim in engine.requests:
            take([engine.abort_request(victim)])
        take(engine.step())
    while engine.has_unfinished():
        take(engine.step())
    return tokens, reasons


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_random_traffic_gives_the_plain_engines_tokens(seed: int) -> None:
    """Random arrivals (some over a shared prefix, so the prefix cache hits), prompt lengths that need several
    chunks, stop tokens, seeded sampling, aborts, and a pool small enough to preempt (plain) or leave sequences
    out (pipelined): every request that was not aborted gets the plain engine's tokens, and the pool ends
    empty on both sides."""
    model = tiny_model()
    vocab = model.cfg.vocab_size
    rng = random.Random(seed)
    shared = random_prompt(40, vocab, seed=seed)
    schedule: list[list[tuple[str, list[int], SamplingParams]]] = []
    aborts: dict[int, str] = {}
    count = 0
    for step_index in range(40):
        arrivals = []
        for _ in range(rng.choice([0, 0, 1, 2])):
            own = random_prompt(rng.randint(3, 90), vocab, seed=seed * 100 + count)
            prompt = shared + own if rng.random() < 0.4 else own
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.0, 0.8]),
                max_tokens=rng.randint(1, 16),
                ignore_eos=True,
                seed=rng.randint(0, 1000),
                stop_token_ids=[rng.randrange(vocab)] if rng.random() < 0.3 else [],
            )
            arrivals.append((f"t{count}", prompt, params))
            count += 1
        schedule.append(arrivals)
        if count and rng.random() < 0.15:
            aborts[step_index] = f"t{rng.randrange(count)}"
    settings = {
        "num_blocks": 24,
        "block_size": 16,
        "max_model_len": 256,
        "max_num_seqs": 6,
        "max_num_batched_tokens": 48,
    }
    results = {}
    for pipelined in (False, True):
        engine = make_engine(model, None, pipeline_steps=pipelined, **settings)
        tokens, reasons = _serve_schedule(engine, schedule, aborts)
        stats = engine.stats()
        assert (stats.used_blocks, stats.running, stats.waiting) == (0, 0, 0)
        results[pipelined] = (tokens, reasons, engine)
    (plain, plain_reasons, _), (piped, piped_reasons, engine) = results[False], results[True]
    finished = {rid for rid, reason in plain_reasons.items() if reason is not FinishReason.ABORT}
    assert len(finished) >= 10
    assert results[False][2].stats().preemptions > 0  # the pool was short: the plain engine preempted
    for request_id in sorted(finished):
        if piped_reasons.get(request_id) is FinishReason.ABORT:
            continue  # the abort came at the same call, but this side had not finished it yet
        assert piped[request_id] == plain[request_id], request_id
        assert piped_reasons[request_id] == plain_reasons[request_id], request_id
    assert engine.pipelined_steps > 0
