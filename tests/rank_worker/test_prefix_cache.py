"""The L0 prefix cache on the real embedded model (and a tiny DeepSeek-V3 where a test takes engine_model): what is
cached, when, and that it changes no token."""

from __future__ import annotations

import pytest
from engine_fixtures import generate_one, greedy, make_engine, random_prompt, run_to_completion

from rank_worker.engine.interface import EngineRequest

BLOCK = 16


def _chat_prompt(tokenizer, text: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.tokenizer_json)
    chat = f"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(chat, add_special_tokens=False).ids


@pytest.mark.parametrize("extra", [0, 5])  # prompt length a multiple of the block size, and not
def test_same_prompt_twice_hits_every_full_block_but_the_last_tokens(engine_model, extra: int) -> None:
    model, tokenizer = engine_model
    prompt = random_prompt(6 * BLOCK + extra, model.cfg.vocab_size, seed=11)
    engine = make_engine(model, tokenizer, block_size=BLOCK)
    first = generate_one(engine, prompt, greedy(8), "first")
    # Registered before release: the first request's blocks are cache entries the moment it returns.
    assert engine.stats().used_blocks == 0
    assert engine.stats().cached_blocks >= len(prompt) // BLOCK
    second = generate_one(engine, prompt, greedy(8), "second")
    expected_cached = (len(prompt) - 1) // BLOCK * BLOCK  # every full block but the one holding the last token
    assert first.stats.l0_cached_tokens == 0
    assert second.stats.l0_cached_tokens == expected_cached
    assert second.new_token_ids == first.new_token_ids
    stats = engine.stats()
    assert stats.prefix_hit_tokens == expected_cached
    assert stats.prefix_query_tokens == 2 * len(prompt)


def test_multi_turn_reuses_previous_prompt_and_output(smollm2) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer, block_size=BLOCK)
    conversation = _chat_prompt(tokenizer, "Name three colours.")
    previous_computed = 0
    for turn in range(3):
        out = generate_one(engine, conversation, greedy(12), f"turn{turn}")
        if turn > 0:
            # Everything computed in the previous turn (its prompt and all of its output but the last token,
            # which was sampled, never fed back) is reused, up to the last full block.
            assert out.stats.l0_cached_tokens == previous_computed // BLOCK * BLOCK
            assert out.stats.l0_cached_tokens > 0.8 * len(conversation) - BLOCK
        full = conversation + out.new_token_ids
        previous_computed = len(full) - 1
        conversation = full + _chat_prompt(tokenizer, f"And {turn + 4} more?")


def test_cold_and_warm_give_identical_greedy_tokens(smollm2) -> None:
    model, tokenizer = smollm2
    prompt = _chat_prompt(tokenizer, "Write a haiku about caches and memory.")
    cold = generate_one(make_engine(model, tokenizer, prefix_cache=False), prompt, greedy(24), "cold")
    engine = make_engine(model, tokenizer)
    generate_one(engine, prompt[: len(prompt) - 7], greedy(4), "warmup")  # caches most of the prompt
    warm = generate_one(engine, prompt, greedy(24), "warm")
    assert warm.stats.l0_cached_tokens > 0
    assert warm.new_token_ids == cold.new_token_ids


def test_prefix_cache_off_reports_no_hits(smollm2) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer, prefix_cache=False)
    prompt = random_prompt(3 * BLOCK + 3, model.cfg.vocab_size, seed=3)
    generate_one(engine, prompt, greedy(2), "a")
    again = generate_one(engine, prompt, greedy(2), "b")
    assert again.stats.l0_cached_tokens == 0
    assert engine.stats().cached_blocks == 0
    assert engine.drain_kv_events() == []


def test_kv_events_announce_stored_then_removed_blocks(smollm2) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer, num_blocks=12, block_size=BLOCK)
    first = random_prompt(8 * BLOCK + 1, model.cfg.vocab_size, seed=5)
    generate_one(engine, first, greedy(1), "a")
    events = engine.drain_kv_events()
    stored = [h for e in events if e.kind.value == "stored" for h in e.block_hashes]
    assert len(stored) == 8 and all(len(h) == 16 for h in stored)
    # A different long prompt needs the space: the idle cached blocks are evicted and announced.
    generate_one(engine, random_prompt(9 * BLOCK, model.cfg.vocab_size, seed=6), greedy(1), "b")
    removed = [h for e in engine.drain_kv_events() if e.kind.value == "removed" for h in e.block_hashes]
    assert removed and set(removed) <= set(stored)


def test_concurrent_identical_prompts_share_blocks(smollm2) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer)
    prompt = random_prompt(5 * BLOCK, model.cfg.vocab_size, seed=9)
    generate_one(engine, prompt, greedy(1), "seed")
    for i in range(4):
        engine.add_request(EngineRequest(f"c{i}", prompt, greedy(6)))
    outs = run_to_completion(engine)
    assert len({tuple(o.new_token_ids) for o in outs.values()}) == 1
    assert all(o.stats.l0_cached_tokens == 4 * BLOCK for o in outs.values())
