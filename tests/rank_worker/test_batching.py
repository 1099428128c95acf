"""Continuous batching on the real embedded model and a tiny DeepSeek-V3 (engine_model): batched equals
one-at-a-time, chunked prefill, a pool smaller than the work, and aborts that return every block."""

from __future__ import annotations

import random

from engine_fixtures import generate_one, greedy, make_engine, random_prompt, run_to_completion

from rank_worker.engine.interface import EngineRequest, FinishReason


def _prompts(count: int, vocab: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng.randint(low, high), vocab, seed=seed * 1000 + i) for i in range(count)]


def test_32_concurrent_requests_match_one_at_a_time(engine_model) -> None:
    model, tokenizer = engine_model
    prompts = _prompts(32, model.cfg.vocab_size, 5, 90, seed=1)
    lengths = [2 + i % 7 for i in range(32)]  # finishing at 7 different steps
    alone = [
        generate_one(make_engine(model, tokenizer, prefix_cache=False), p, greedy(n)).new_token_ids
        for p, n in zip(prompts, lengths, strict=True)
    ]
    engine = make_engine(model, tokenizer, max_num_seqs=32, max_num_batched_tokens=512, prefix_cache=False)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(EngineRequest(f"q{i}", p, greedy(n)))
    together = run_to_completion(engine)
    assert [together[f"q{i}"].new_token_ids for i in range(32)] == alone
    assert engine.stats().used_blocks == 0


def test_chunked_prefill_matches_single_pass(engine_model) -> None:
    model, tokenizer = engine_model
    prompt = random_prompt(300, model.cfg.vocab_size, seed=2)
    whole = generate_one(make_engine(model, tokenizer, max_num_batched_tokens=1024), prompt, greedy(10))
    chunked = generate_one(make_engine(model, tokenizer, max_num_batched_tokens=64), prompt, greedy(10))
    assert chunked.new_token_ids == whole.new_token_ids


def test_more_work_than_blocks_preempts_and_still_finishes_correctly(engine_model) -> None:
    model, tokenizer = engine_model
    prompts = _prompts(10, model.cfg.vocab_size, 20, 60, seed=3)
    expected = [generate_one(make_engine(model, tokenizer), p, greedy(24)).new_token_ids for p in prompts]
    # 10 blocks of 16 = 160 tokens for 10 requests needing 44-84 tokens each.
    engine = make_engine(model, tokenizer, num_blocks=10, max_model_len=160, max_num_seqs=10)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", p, greedy(24)))
    outs = run_to_completion(engine)
    assert [outs[f"p{i}"].new_token_ids for i in range(10)] == expected
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks


def test_aborts_mid_stream_return_the_pool_to_baseline(engine_model) -> None:
    model, tokenizer = engine_model
    engine = make_engine(model, tokenizer, num_blocks=64, max_num_seqs=16)
    baseline = engine.stats()
    rng = random.Random(4)
    live: set[str] = set()
    for i in range(60):
        rid = f"a{i}"
        engine.add_request(EngineRequest(rid, random_prompt(rng.randint(3, 60), model.cfg.vocab_size, i), greedy(50)))
        live.add(rid)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        if rng.random() < 0.7:
            victim = rng.choice(sorted(live))
            aborted = engine.abort_request(victim)
            assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
            live.discard(victim)
    for rid in sorted(live):
        engine.abort_request(rid)
    for _ in range(3):  # a step still in flight (pipeline_steps) lands, giving nobody anything
        if engine.has_unfinished():
            assert engine.step() == []
    stats = engine.stats()
    assert not engine.has_unfinished()
    assert (stats.used_blocks, stats.running, stats.waiting) == (0, 0, 0)
    assert stats.free_blocks == baseline.free_blocks == stats.total_blocks
    assert all(block.ref_count == 0 for block in engine.pool.blocks)
