"""Prompt block hashes sent with a request (the gateway computes them once): the rank uses them instead of
hashing the prompt again, only when they are in its namespace and one per full prompt block, and its cache
behaves exactly as when it hashes itself: the same blocks registered (KV events), the same prefix hits, the
same tokens, through preemption and recompute and through restores from the host tier."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
from engine_fixtures import greedy, make_engine, random_prompt
from l1_fixtures import tiny_model

import rank_worker.engine.kv_cache_manager as kv_cache_manager
from contracts.block_hash import prefix_block_hashes
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.interface import EngineRequest
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.paged_engine import PagedEngine
from rank_worker.engine.sequence import Sequence
from simulator.host_cache import NodeHostCache, RankHostTier

BLOCK = 16
VOCAB = 128  # the tiny model's


class HashCounter:
    """Tokens the cache manager runs through the block hash (both of its hash functions)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tokens = 0
        chain, prefix = kv_cache_manager.chain_block_hash, kv_cache_manager.prefix_block_hashes

        def counted_chain(parent: bytes, block_tokens: list[int]) -> bytes:
            self.tokens += len(block_tokens)
            return chain(parent, block_tokens)

        def counted_prefix(namespace: bytes, token_ids: list[int], block_size: int, start: bytes | None = None):
            self.tokens += len(token_ids) // block_size * block_size
            return prefix(namespace, token_ids, block_size, start)

        monkeypatch.setattr(kv_cache_manager, "chain_block_hash", counted_chain)
        monkeypatch.setattr(kv_cache_manager, "prefix_block_hashes", counted_prefix)


@dataclass
class Trace:
    """What a run showed of the cache: per request (tokens, L0 hits, L1 restores, preemptions), every KV event
    in order, and the tokens the rank hashed."""

    results: dict[str, tuple[list[int], int, int, int]] = field(default_factory=dict)
    events: list[tuple[str, tuple[bytes, ...]]] = field(default_factory=list)
    hashed_tokens: int = 0


def request(engine: PagedEngine, request_id: str, prompt: list[int], max_tokens: int, send: str) -> EngineRequest:
    """A request as a client sends it: no hashes, the right ones, or hashes the rank must not use."""
    made = EngineRequest(request_id, list(prompt), greedy(max_tokens))
    if send == "none":
        return made
    made.prompt_block_hashes = prefix_block_hashes(engine.namespace, prompt, BLOCK)
    made.block_hash_namespace = engine.namespace
    if send == "other-namespace":
        made.block_hash_namespace = b"\x01" * 16
    elif send == "one-short":
        made.prompt_block_hashes = made.prompt_block_hashes[:-1]
    return made


def run(engine: PagedEngine, counter: HashCounter, waves: list[list[tuple[str, list[int], int]]], send: str) -> Trace:
    """Each wave's requests added at once, run until idle, then the next wave."""
    trace = Trace()
    start = counter.tokens
    outputs: dict[str, list[int]] = {}
    for wave in waves:
        for request_id, prompt, max_tokens in wave:
            engine.add_request(request(engine, request_id, prompt, max_tokens, send))
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    stats = out.stats
                    assert stats is not None
                    trace.results[out.request_id] = (
                        outputs[out.request_id],
                        stats.l0_cached_tokens,
                        stats.l1_cached_tokens,
                        stats.preemptions,
                    )
            trace.events.extend((event.kind.name, tuple(event.block_hashes)) for event in engine.drain_kv_events())
    trace.hashed_tokens = counter.tokens - start
    return trace


def turns() -> list[list[tuple[str, list[int], int]]]:
    """A session: a prompt, the same again, the next turn over it and its output; a prompt of whole blocks."""
    first = random_prompt(10 * BLOCK + 5, VOCAB, seed=1)
    whole = random_prompt(8 * BLOCK, VOCAB, seed=2)
    return [
        [("t1", first, 20)],
        [("t1-again", first, 20)],
        [("whole", whole, 3)],
        [("whole-again", whole, 3)],
    ]


def full_prompt_tokens(waves: list[list[tuple[str, list[int], int]]]) -> int:
    return sum(len(prompt) // BLOCK * BLOCK for wave in waves for _, prompt, _ in wave)


def test_sent_hashes_replace_the_rank_s_own_and_change_nothing_in_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = HashCounter(monkeypatch)
    model = tiny_model()
    waves = turns()
    # The next turn: the first prompt, its output, a new user message.
    hashed = run(make_engine(model, max_model_len=512), counter, waves, "none")
    sent = run(make_engine(model, max_model_len=512), counter, waves, "right")
    assert sent.results == hashed.results and sent.events == hashed.events
    assert hashed.results["t1-again"][1] == 10 * BLOCK and hashed.results["whole-again"][1] == 7 * BLOCK
    assert hashed.hashed_tokens >= full_prompt_tokens(waves)
    # With the hashes sent, the rank hashes only the blocks its outputs fill (20 and 3 tokens a request here).
    output_blocks = sum(-(-max_tokens // BLOCK) for wave in waves for _, _, max_tokens in wave)
    assert sent.hashed_tokens <= output_blocks * BLOCK

    # A next turn over the first one's output: the chain the rank went on with, past the sent prompt hashes.
    first, reply = waves[0][0][1], hashed.results["t1"][0]
    follow_up = [[("t2", [*first, *reply, *random_prompt(30, VOCAB, seed=3)], 4)]]
    hashed_engine, sent_engine = make_engine(model, max_model_len=512), make_engine(model, max_model_len=512)
    run(hashed_engine, counter, waves[:1], "none")
    run(sent_engine, counter, waves[:1], "right")
    assert (
        run(sent_engine, counter, follow_up, "right").results == run(hashed_engine, counter, follow_up, "none").results
    )
    assert (
        sent_engine.stats().prefix_hit_tokens == hashed_engine.stats().prefix_hit_tokens == (165 + 19) // BLOCK * BLOCK
    )


def test_preempted_sequences_resume_over_the_same_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = HashCounter(monkeypatch)
    model = tiny_model()
    prompts = [random_prompt(40 + 13 * i, VOCAB, seed=10 + i) for i in range(8)]
    waves = [[(f"p{i}", prompt, 40) for i, prompt in enumerate(prompts)]]
    settings = {"num_blocks": 20, "max_model_len": 320, "max_num_seqs": 8}
    hashed = run(make_engine(model, **settings), counter, waves, "none")
    sent = run(make_engine(model, **settings), counter, waves, "right")
    assert sum(preemptions for *_, preemptions in hashed.results.values()) > 0
    assert sent.results == hashed.results and sent.events == hashed.events
    assert sent.hashed_tokens <= len(prompts) * (40 // BLOCK + 1) * BLOCK  # output blocks only, each once


def test_blocks_restored_from_the_host_tier_are_found_by_the_sent_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = HashCounter(monkeypatch)
    model = tiny_model()
    session = random_prompt(12 * BLOCK + 3, VOCAB, seed=20)
    waves = [
        [("session", session, 4)],
        [("other", random_prompt(20 * BLOCK, VOCAB, seed=21), 4)],  # takes the small pool: L0 forgets the session
        [("session-again", session, 4)],
    ]

    def engine() -> PagedEngine:
        made = make_engine(model, num_blocks=24, max_model_len=512)
        made.kv.host_tier = RankHostTier(NodeHostCache(1000), made.pool)
        return made

    hashed = run(engine(), counter, waves, "none")
    sent = run(engine(), counter, waves, "right")
    assert hashed.results["session-again"][2] > 0  # restored from the host tier
    assert sent.results == hashed.results and sent.events == hashed.events
    assert sent.hashed_tokens <= 3 * BLOCK


@pytest.mark.parametrize("send", ["other-namespace", "one-short"])
def test_hashes_the_rank_cannot_use_are_replaced_by_its_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, send: str
) -> None:
    counter = HashCounter(monkeypatch)
    model = tiny_model()
    waves = turns()
    hashed = run(make_engine(model, max_model_len=512), counter, waves, "none")
    with caplog.at_level(logging.DEBUG, logger=kv_cache_manager.__name__):
        refused = run(make_engine(model, max_model_len=512), counter, waves, send)
    assert refused.results == hashed.results and refused.events == hashed.events
    assert refused.hashed_tokens == hashed.hashed_tokens
    notes = [record for record in caplog.records if "not used" in record.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.DEBUG  # once, for four requests


def test_a_100k_token_prompt_is_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager alone, as the engine drives it over a 100K-token prefill: lookups, then registration."""
    counter = HashCounter(monkeypatch)
    namespace = b"n" * 16
    prompt = random_prompt(100_000, 50_000, seed=30)
    sent = prefix_block_hashes(namespace, prompt, BLOCK)
    registered: dict[str, list[bytes]] = {}
    for name, hashes in (("hashed", []), ("sent", sent)):
        kv = KvCacheManager(BlockPool(len(prompt) // BLOCK + 8, caching=True), BLOCK, namespace)
        before = counter.tokens
        seq = Sequence(
            name,
            list(prompt),
            len(prompt),
            greedy(1),
            0.0,
            lookup_hashes=kv.sent_prompt_hashes(prompt, hashes, namespace),
        )
        assert kv.peek_cached_tokens(seq) == 0
        assert kv.attach_cached_prefix(seq) == (0, 0)
        assert kv.allocate(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        kv.register_full_blocks(seq)
        registered[name] = list(seq.block_hashes)
        assert counter.tokens - before == (len(prompt) if name == "hashed" else 0)
        assert kv.lookup_hashes(seq) == sent[: (len(prompt) - 1) // BLOCK]
    assert registered["sent"] == registered["hashed"] == sent
