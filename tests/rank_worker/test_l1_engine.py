"""The engine with its L1 tier against the real kvstore process: a session evicted from a tiny L0 pool comes
back from L1 with the same tokens, a kvstore outage or restart never fails a request (and L1 is used again
once it is back), and a soak with aborts and preemptions leaves no block referenced and no slot pinned."""

from __future__ import annotations

import itertools
import random
import signal
import time
from pathlib import Path

from engine_fixtures import generate_one, greedy, make_engine, random_prompt, run_to_completion
from l1_fixtures import kvstore_settings, kvstore_stats, l1_engine, tiny_model
from service_processes import free_port, start_kvstore

from contracts.block_hash import prefix_block_hashes
from contracts.kv_events import KvEventKind
from rank_worker.engine.interface import EngineRequest, FinishReason
from rank_worker.engine.paged_engine import PagedEngine

BLOCK = 16


def assert_no_pins(port: int) -> None:
    stats = kvstore_stats(port)
    assert stats.pinned_slots == 0, stats
    assert stats.writing_slots == 0, stats


def assert_pool_idle(engine: PagedEngine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished()
    assert stats.free_blocks == stats.total_blocks and stats.used_blocks == 0
    assert all(block.ref_count == 0 for block in engine.pool.blocks)
    assert stats.l1_copies_in_flight == 0


def test_session_evicted_from_l0_is_restored_from_l1_with_the_same_tokens(engine_model, tmp_path: Path) -> None:
    model, tokenizer = engine_model  # each family: Llama's K/V blocks and DeepSeek's latent blocks
    vocab = model.cfg.vocab_size
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        # 20 blocks of 16 tokens: session B cannot run without evicting most of session A.
        engine = l1_engine(model, tokenizer, port, num_blocks=20, max_model_len=320)
        assert engine.stats().l1_attached
        a1_prompt = random_prompt(8 * BLOCK + 5, vocab, seed=21)
        a1 = generate_one(engine, a1_prompt, greedy(8), "a1")
        assert a1.stats.l1_cached_tokens == 0
        assert engine.stats().l1_offloaded_blocks == 8  # A's 8 full blocks, written through

        generate_one(engine, random_prompt(300, vocab, seed=22), greedy(2), "b")
        assert_pool_idle(engine)
        engine.drain_kv_events()

        a2_prompt = a1_prompt + a1.new_token_ids + random_prompt(20, vocab, seed=23)
        a2 = generate_one(engine, a2_prompt, greedy(8), "a2")
        l0, l1 = a2.stats.l0_cached_tokens, a2.stats.l1_cached_tokens
        # A's first turn left 8 full blocks (128 tokens); B evicted all but at most the first two from L0.
        assert l0 + l1 == 8 * BLOCK
        assert l1 >= 6 * BLOCK and l0 <= 2 * BLOCK
        assert engine.stats().l1_restored_tokens == l1
        # Restored blocks are ordinary L0 entries now: announced as STORED like computed ones.
        stored = {h for e in engine.drain_kv_events() if e.kind is KvEventKind.STORED for h in e.block_hashes}
        assert set(engine.kv.pool.cached_hashes()) >= stored and len(stored) >= l1 // BLOCK

        cold = generate_one(make_engine(model, tokenizer, prefix_cache=False), a2_prompt, greedy(8), "cold")
        assert a2.new_token_ids == cold.new_token_ids  # float32 on the CPU: bit-identical KV, same tokens
        assert_pool_idle(engine)
        assert_no_pins(port)
        assert kvstore_stats(port).hit_blocks >= l1 // BLOCK
        engine.close()


def _restores(engine: PagedEngine, seed: int) -> int:
    """Run a session turn, push it out of L0 with another prompt, run it again: tokens restored from L1."""
    prompt = random_prompt(5 * BLOCK + 3, 128, seed=seed)
    generate_one(engine, prompt, greedy(4), f"s{seed}-1")
    generate_one(engine, random_prompt(14 * BLOCK, 128, seed=seed + 1), greedy(2), f"s{seed}-evict")
    again = generate_one(engine, prompt, greedy(4), f"s{seed}-2")
    return again.stats.l1_cached_tokens


def wait_attached(engine: PagedEngine, timeout_s: float = 15) -> None:
    """Attaching runs in the background; poll until the engine has adopted the new mapping."""
    assert engine.l1 is not None
    deadline = time.monotonic() + timeout_s
    while not engine.l1.try_attach():
        assert time.monotonic() < deadline, f"L1 not attached after {timeout_s}s: {engine.l1.last_error}"
        time.sleep(0.05)


def test_kvstore_outage_and_restart_never_fail_a_request(tmp_path: Path) -> None:
    model = tiny_model()
    port = free_port()
    settings = kvstore_settings(tmp_path)
    # No kvstore yet: the rank serves from L0 and keeps trying to attach.
    engine = l1_engine(model, None, port, retry_interval_s=0.5, num_blocks=16, max_model_len=256)
    assert engine.l1 is not None and not engine.stats().l1_attached
    prompt = random_prompt(40, 128, seed=1)
    expected = generate_one(make_engine(model, None), prompt, greedy(6), "ref").new_token_ids
    assert generate_one(engine, prompt, greedy(6), "early").new_token_ids == expected

    with start_kvstore(tmp_path / "kvstore-1.log", port, **settings):
        wait_attached(engine)
        assert _restores(engine, seed=10) > 0
        assert engine.stats().l1_attached
        first_arena = engine.l1.arena.layout.arena_id

    # Restarted while the rank was idle: the next call names a stale arena, and the rank attaches again at
    # once, not after the retry interval (made long here to tell the two apart).
    engine.l1.retry_interval_s = 60
    with start_kvstore(tmp_path / "kvstore-2.log", port, **settings) as kvstore:
        stale_prompt = random_prompt(40, 128, seed=29)  # not in L0: admission asks L1 about it
        stale_expected = generate_one(make_engine(model, None), stale_prompt, greedy(6), "ref").new_token_ids
        out = generate_one(engine, stale_prompt, greedy(6), "finds-stale-arena")
        assert out.new_token_ids == stale_expected
        wait_attached(engine, timeout_s=10)
        assert engine.l1.arena.layout.arena_id != first_arena
        offloaded = engine.stats().l1_offloaded_blocks
        generate_one(engine, random_prompt(3 * BLOCK + 1, 128, seed=30), greedy(2), "after-restart")
        assert engine.stats().l1_offloaded_blocks == offloaded + 3
        assert_no_pins(port)

        engine.l1.retry_interval_s = 0.5
        kvstore.send_signal(signal.SIGKILL)
        kvstore.wait(timeout=10)
        fresh = random_prompt(40, 128, seed=31)  # not in L0: admission asks L1, which is gone
        fresh_expected = generate_one(make_engine(model, None), fresh, greedy(6), "ref").new_token_ids
        started = time.monotonic()
        out = generate_one(engine, fresh, greedy(6), "during-outage")
        assert out.finish_reason is FinishReason.LENGTH and out.new_token_ids == fresh_expected
        assert time.monotonic() - started < 5
        assert not engine.stats().l1_attached

    with start_kvstore(tmp_path / "kvstore-3.log", port, **settings) as kvstore:
        wait_attached(engine)
        assert _restores(engine, seed=40) > 0  # L1 comes back empty and is used again
        assert engine.stats().l1_attached

        # Hung (SIGSTOP): one call waits out its 1 s deadline, then the rank serves from L0 without waiting.
        prompts = [random_prompt(40, 128, seed=50 + i) for i in range(3)]
        reference = make_engine(model, None)
        expected_hung = [generate_one(reference, p, greedy(4), f"ref{i}").new_token_ids for i, p in enumerate(prompts)]
        kvstore.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            outs = [generate_one(engine, p, greedy(4), f"hung{i}").new_token_ids for i, p in enumerate(prompts)]
            assert time.monotonic() - started < 4
            assert outs == expected_hung and not engine.stats().l1_attached
        finally:
            kvstore.send_signal(signal.SIGCONT)
        # Attached again as a new incarnation: pins a late-served call took for the old one are dropped.
        wait_attached(engine)
        deadline = time.monotonic() + 5
        while kvstore_stats(port).pinned_slots and time.monotonic() < deadline:
            time.sleep(0.1)
        assert_pool_idle(engine)
        assert_no_pins(port)
        engine.close()


def test_soak_with_aborts_and_preemptions_leaves_nothing_held(tmp_path: Path) -> None:
    model = tiny_model()
    port = free_port()
    rng = random.Random(5)
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        engine = l1_engine(
            model, None, port, num_blocks=24, max_model_len=256, max_num_seqs=6, max_num_batched_tokens=96
        )
        sessions = [random_prompt(rng.randint(40, 120), 128, seed=100 + i) for i in range(12)]
        total, added, aborted, finished = 300, 0, 0, 0
        in_flight: set[str] = set()
        for _ in range(100_000):
            while added < total and len(in_flight) < 10:
                prompt = sessions[rng.randrange(len(sessions))] + random_prompt(rng.randint(1, 30), 128, seed=added)
                request_id = f"q{added}"
                engine.add_request(EngineRequest(request_id, prompt, greedy(rng.randint(1, 24))))
                in_flight.add(request_id)
                added += 1
            if in_flight and rng.random() < 0.05:
                victim = rng.choice(sorted(in_flight))
                assert engine.abort_request(victim) is not None
                in_flight.discard(victim)
                aborted += 1
            for out in engine.step():
                if out.finished:
                    in_flight.discard(out.request_id)
                    finished += 1
            if added == total and not engine.has_unfinished():
                break
        run_to_completion(engine)
        assert finished + aborted == total and aborted > 5
        stats = engine.stats()
        assert stats.preemptions > 0
        assert stats.l1_restored_tokens > 0 and stats.l1_offloaded_blocks > 0
        assert_pool_idle(engine)
        assert_no_pins(port)
        engine.close()


def test_write_through_is_paced_per_step_and_lands_whole(tmp_path: Path) -> None:
    """L1 copies go out at most offload_bytes_per_step per engine step (here one block), behind the step's own
    work; a prompt's eight blocks still all land in L1, and its session is restored from there intact."""
    model = tiny_model()
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        probe = l1_engine(model, None, port, num_blocks=20, max_model_len=320)
        slot_bytes = probe.l1.slot_bytes
        probe.close()
        engine = l1_engine(
            model, None, port, num_blocks=20, max_model_len=320, l1_offload_mb_per_step=slot_bytes / (1 << 20)
        )
        assert engine.l1 is not None and engine.l1.offload_blocks_per_step == 1
        prompt = random_prompt(8 * BLOCK + 5, 128, seed=31)
        engine.add_request(EngineRequest("a", prompt, greedy(2)))
        issued = [0]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            assert steps < 10_000, "the write-through never finished"
            issued.append(engine.l1.issued_blocks)
        per_step = [b - a for a, b in itertools.pairwise(issued)]
        assert max(per_step) == 1  # never more than the budget in one step
        assert engine.l1.issued_blocks == 8 and engine.stats().l1_offloaded_blocks == 8
        assert_pool_idle(engine)
        assert_no_pins(port)

        # Push the session out of L0; it comes back from the paced copies with the unpaced engine's tokens.
        generate_one(engine, random_prompt(17 * BLOCK, 128, seed=32), greedy(2), "evict")
        again = generate_one(engine, prompt, greedy(6), "a2")
        l0, l1 = again.stats.l0_cached_tokens, again.stats.l1_cached_tokens
        assert l0 + l1 == 8 * BLOCK and l1 >= 4 * BLOCK
        expected = generate_one(make_engine(model, None, prefix_cache=False), prompt, greedy(6), "cold")
        assert again.new_token_ids == expected.new_token_ids
        assert_pool_idle(engine)
        assert_no_pins(port)
        engine.close()


def test_a_session_in_l1_waits_beside_a_decoder_for_room_and_comes_back_whole(tmp_path: Path) -> None:
    """Restored whole or not yet (scheduler._waits_for_room): beside a decoder holding most of the pool, a session
    whose blocks are in L1 waits for the decoder to end instead of having part restored and the rest recomputed."""
    model = tiny_model()
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        # 32 tokens a step: a prompt is prefilled in chunks, so part of A's blocks plus one chunk would fit
        engine = l1_engine(model, None, port, num_blocks=20, max_model_len=320, max_num_batched_tokens=32)
        a1_prompt = random_prompt(8 * BLOCK + 5, 128, seed=31)
        a1 = generate_one(engine, a1_prompt, greedy(8), "a1")
        generate_one(engine, random_prompt(300, 128, seed=32), greedy(2), "evict")  # A leaves L0 for L1
        engine.add_request(EngineRequest("runner", random_prompt(11 * BLOCK, 128, seed=33), greedy(100)))
        outputs: dict[str, list[int]] = {}
        while not outputs.get("runner"):  # the runner decodes: 12 of the 20 blocks are its own, 18 at its end
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        a2_prompt = a1_prompt + a1.new_token_ids + random_prompt(20, 128, seed=34)
        engine.add_request(EngineRequest("a2", a2_prompt, greedy(8)))
        a2 = run_to_completion(engine)["a2"]
        l0, l1 = a2.stats.l0_cached_tokens, a2.stats.l1_cached_tokens
        assert l0 + l1 == 8 * BLOCK, "every block of A's first turn came back: none computed again"
        assert l1 >= 6 * BLOCK
        assert engine.stats().l1_room_waits >= 1, "it waited for room beside the runner"
        cold = generate_one(make_engine(model, None, prefix_cache=False), a2_prompt, greedy(8), "cold")
        assert a2.new_token_ids == cold.new_token_ids
        assert_pool_idle(engine)
        assert_no_pins(port)
        engine.close()


def _written_through_then_evicted(engine: PagedEngine, seed: int) -> tuple[list[int], list[int], list[bytes]]:
    """Session A's first turn (8 full blocks, written through to L1), then a prompt that takes all 20 blocks of the
    pool: (A's prompt, its output, the hashes of its 8 blocks)."""
    a1_prompt = random_prompt(8 * BLOCK + 5, 128, seed=seed)
    a1 = generate_one(engine, a1_prompt, greedy(4), "a1")
    generate_one(engine, random_prompt(19 * BLOCK + 8, 128, seed=seed + 1), greedy(1), "evict")
    return a1_prompt, a1.new_token_ids, prefix_block_hashes(engine.kv.namespace, a1_prompt[: 8 * BLOCK], BLOCK, None)


def _next_turn_beside_a_cold_prompt(
    engine: PagedEngine, port: int, a2_prompt: list[int], b_blocks: int, b_tokens: int, seed: int
) -> tuple[int, int]:
    """A's next turn queued first, then B (b_blocks full blocks, b_tokens to generate), run to the end: A's
    (tokens from L0, from L1), once its output matched a cold engine's and nothing is left held or pinned."""
    engine.add_request(EngineRequest("a2", a2_prompt, greedy(4)))
    engine.add_request(EngineRequest("b", random_prompt(b_blocks * BLOCK, 128, seed=seed), greedy(b_tokens)))
    outputs = run_to_completion(engine)
    cold = generate_one(make_engine(engine.model, None, prefix_cache=False), a2_prompt, greedy(4), "cold")
    assert outputs["a2"].new_token_ids == cold.new_token_ids
    assert len(outputs["b"].new_token_ids) == b_tokens
    assert_pool_idle(engine)
    assert_no_pins(port)
    return outputs["a2"].stats.l0_cached_tokens, outputs["a2"].stats.l1_cached_tokens


def test_the_l0_prefix_a_restore_extends_is_held_while_its_lookup_is_under_way(tmp_path: Path) -> None:
    """A session whose head is in L0 and whose tail is in L1 only: the L1 lookup is answered a step or more
    after it starts, and a request admitted in that step takes idle blocks, here one of that head. The head is
    held from the lookup's start (HostFetch.held), so the tail's restore still extends it. Without that, on the
    H100 (llama-8b, 32 agents, 2026-12-06) heads went, nothing was restored and whole contexts were computed
    again (cache hit 76.8% against an optimum of 88.7%; a CPU probe of 24 agents: 92% of it, 99.6% now)."""
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        engine = l1_engine(tiny_model(), None, port, num_blocks=20, max_model_len=320, max_num_batched_tokens=256)
        a1_prompt, a1_output, a_hashes = _written_through_then_evicted(engine, seed=41)
        # A's first 6 blocks back in L0 (from L1), now the most recently used idle entries; its last 2 in L1 only
        head = generate_one(engine, [*a1_prompt[: 6 * BLOCK], 1, 2, 3], greedy(1), "head")
        assert head.stats.l1_cached_tokens == 6 * BLOCK
        assert len(engine.pool.cached_run(a_hashes)) == 6
        # A2 first: its L1 lookup starts; B, admitted in the same step, would take 15 blocks of the 20: all the
        # other idle ones and one of A's head. B ends after one step, so A2 is admitted as soon as its lookup
        # is answered, with whatever that restored
        a2_prompt = a1_prompt + a1_output + random_prompt(20, 128, seed=43)
        l0_l1 = _next_turn_beside_a_cold_prompt(engine, port, a2_prompt, b_blocks=15, b_tokens=1, seed=44)
        assert l0_l1 == (6 * BLOCK, 2 * BLOCK), "A's head from L0, its tail from L1: none computed again"
        engine.close()


def test_a_cold_prompt_behind_a_lookup_under_way_leaves_it_the_room_it_counted_on(tmp_path: Path) -> None:
    """A session whose blocks are in L1 only, and a cold prompt B behind it that would take most of the pool: A's
    lookup starts first and is answered a step or more later. B is not admitted into the blocks A's answer will take
    (KvCacheManager.reserved_blocks), so the first answer restores all 8 and no block is cut for room. Before,
    B took them in that step, the answer found no room, and A waited and looked them up again (a cut that restores
    some blocks computes the rest: 82K-234K tokens a step on the H100 at 40-48 agents)."""
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        engine = l1_engine(tiny_model(), None, port, num_blocks=20, max_model_len=320, max_num_batched_tokens=256)
        a1_prompt, a1_output, a_hashes = _written_through_then_evicted(engine, seed=51)
        assert engine.pool.cached_run(a_hashes) == [], "A is in L1 only"
        a2_prompt = a1_prompt + a1_output + random_prompt(20, 128, seed=53)
        l0_l1 = _next_turn_beside_a_cold_prompt(engine, port, a2_prompt, b_blocks=14, b_tokens=2, seed=54)
        assert l0_l1 == (0, 8 * BLOCK), "A's 8 blocks restored whole from L1, none computed again"
        stats = engine.stats()
        assert stats.l1_restore_room_cut_blocks == 0, "the first answer found room for all 8 (the rank's counter)"
        assert (stats.l1_restore_missing_blocks, stats.l1_fetch_timeouts) == (0, 0)
        engine.close()


def test_a_lookup_past_its_deadline_is_given_up_counted_and_its_blocks_computed(tmp_path: Path) -> None:
    """A hung kvstore (SIGSTOP) holds A's lookup past the tier's deadline (made 0.05 s here, under the 1 s of
    the call itself): A computes its blocks, with a cold engine's output, and the rank counts the timeout
    (kvserve:l1_fetch_timeouts): on the H100 bursts of restores came short, and nothing said whether this was why."""
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)) as kvstore:
        engine = l1_engine(tiny_model(), None, port, num_blocks=20, max_model_len=320, max_num_batched_tokens=256)
        a1_prompt, a1_output, _ = _written_through_then_evicted(engine, seed=61)
        a2_prompt = a1_prompt + a1_output + random_prompt(20, 128, seed=63)
        cold = generate_one(make_engine(engine.model, None, prefix_cache=False), a2_prompt, greedy(4), "cold")
        assert engine.stats().l1_fetch_timeouts == 0
        engine.l1.fetch_timeout_s = 0.05
        kvstore.send_signal(signal.SIGSTOP)
        try:
            a2 = generate_one(engine, a2_prompt, greedy(4), "a2")
        finally:
            kvstore.send_signal(signal.SIGCONT)
        assert a2.new_token_ids == cold.new_token_ids
        assert a2.stats.l1_cached_tokens == 0
        assert engine.stats().l1_fetch_timeouts == 1
        engine.close()
