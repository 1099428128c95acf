"""Decode steps padded to batch buckets over the persistent input buffers and block tables: the bucketing,
and that padding changes nothing (logits, K/V written, tokens) against the unpadded eager step. On the CPU
the padded forward runs eagerly; recorded graphs against eager steps on CUDA: test_cuda_attention.py."""

from __future__ import annotations

import torch
from engine_fixtures import generate_greedy, greedy, make_engine, random_prompt

from rank_worker.engine.decode_graphs import DecodeGraphs, bucket_for, size_buckets
from rank_worker.engine.interface import EngineRequest
from rank_worker.engine.paged_engine import PagedEngine


def test_buckets_grow_geometrically_and_end_at_the_limit() -> None:
    assert size_buckets(64) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    assert size_buckets(100) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert size_buckets(5) == [1, 2, 4, 5]
    assert size_buckets(1) == [1]
    assert bucket_for(13, size_buckets(64)) == 16
    assert bucket_for(65, size_buckets(64)) is None


def padded(engine: PagedEngine) -> DecodeGraphs:
    """The padded decode path of a CPU engine, run eagerly over its runner's persistent buffers."""
    runner = engine.runner
    return DecodeGraphs(
        engine.model, engine.kv_cache, runner.inputs, engine.settings.engine.max_num_seqs, capture=False
    )


def test_a_padded_step_takes_its_bucket_and_none_past_max_num_seqs(smollm2) -> None:
    model, tokenizer = smollm2
    engine = _decoding_engine(model, tokenizer, [5, 40, 77, 130, 17])
    graphs = padded(engine)
    seqs = list(engine.requests.values())
    for seq in seqs:
        engine.kv.allocate(seq, 1)
    assert graphs.buckets == size_buckets(16)
    assert graphs.run(seqs) is not None and graphs.steps == 1
    assert graphs.run(seqs * 4) is None  # 20 rows: more than max_num_seqs (16)
    # rows 5..7 of the bucket of 8 are padding: the scratch row of the block tables, one token each
    rows = engine.runner.inputs.dev[5, 5:8].tolist()
    assert rows == [engine.runner.tables.scratch_row] * 3
    assert engine.runner.inputs.dev[6, 5:8].tolist() == [1, 1, 1]


def _decoding_engine(model, tokenizer, lengths: list[int]) -> PagedEngine:
    """An engine whose requests have all finished prefill (every sequence's next step is a decode)."""
    engine = make_engine(
        model, tokenizer, max_num_seqs=16, max_num_batched_tokens=4096, prefix_cache=False, pipeline_steps=False
    )
    for i, length in enumerate(lengths):
        prompt = random_prompt(length, model.cfg.vocab_size, seed=40 + i)
        engine.add_request(EngineRequest(f"d{i}", prompt, greedy(8)))
    engine.step()  # all prompts fit one step's token budget
    assert all(seq.num_uncomputed_tokens == 1 for seq in engine.requests.values())
    return engine


def test_padded_decode_step_equals_the_eager_step(smollm2) -> None:
    model, tokenizer = smollm2
    engine = _decoding_engine(model, tokenizer, [5, 40, 77, 130, 17])  # 5 rows -> 8; 9 blocks -> 12
    batch = engine.scheduler.schedule()  # the decode step, its blocks allocated
    assert [n for _, n in batch.entries] == [1] * 5
    seqs = [seq for seq, _ in batch.entries]
    pool = engine.settings.num_blocks
    before = engine.kv_cache.clone()

    forward, _ = engine.runner.inputs.build(batch.entries)
    with torch.inference_mode():
        eager_logits = model(forward, engine.kv_cache).clone()
    eager_cache = engine.kv_cache[:pool].clone()

    engine.kv_cache.copy_(before)
    graphs = padded(engine)
    padded_logits = graphs.run(seqs)
    assert graphs.steps == 1 and padded_logits is not None
    torch.testing.assert_close(padded_logits, eager_logits, rtol=1e-4, atol=1e-4)
    # every pool block holds what the eager step wrote; the padded rows touched only the scratch block
    torch.testing.assert_close(engine.kv_cache[:pool], eager_cache, rtol=1e-5, atol=1e-4)
    assert not torch.equal(engine.kv_cache[pool], before[pool])


def test_engine_tokens_are_the_same_with_padded_decode_steps(smollm2) -> None:
    model, tokenizer = smollm2
    vocab = model.cfg.vocab_size
    prompts = [random_prompt(7 + 23 * i, vocab, seed=70 + i) for i in range(11)]
    lengths = [6 + 3 * (i % 4) for i in range(11)]  # rows finish at different steps: the batch shrinks
    plain = generate_greedy(
        make_engine(model, tokenizer, max_num_seqs=16, max_num_batched_tokens=256), prompts, lengths
    )
    engine = make_engine(model, tokenizer, max_num_seqs=16, max_num_batched_tokens=256)
    engine.runner.decode_graphs = padded(engine)
    assert generate_greedy(engine, prompts, lengths) == plain
    assert engine.runner.decode_graphs.steps > 10
    assert engine.stats().used_blocks == 0
