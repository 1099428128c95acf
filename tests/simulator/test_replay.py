"""Replays through the real scheduler, cache and routing code on a simulated clock: deterministic, the load
generator's records, more agents -> worse TTFT, warm-first helps warm turns through cold bursts, the L1 host
cache serves what L0 evicted, sessions stick to their rank, and the largest passing N grows with ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_workloads import cold_session, growing_session, h200_step_time, node, sessions

from loadgen.agent import ThinkTime
from loadgen.report import step_stats
from simulator.capacity import capacity_summary, simulate_steps
from simulator.replay import Replay, WorkloadSettings, replay
from simulator.routing import rank_load
from simulator.sim_rank import ReplayRank

STEP_TIME = h200_step_time()
THINK = ThinkTime(fixed=3.0)


def test_a_small_replay_is_deterministic_and_records_every_call() -> None:
    work = sessions(3, base_blocks=40, turns=5, output=16)
    workload = WorkloadSettings(agents=3, turns=5, think=THINK, stagger_s=1.0)
    first = replay(work, workload, node(1), STEP_TIME)
    second = replay(work, workload, node(1), STEP_TIME)
    assert first.records == second.records and first.wall_s == second.wall_s
    records = first.records
    assert len(records) == 15 and all(r.error is None and r.ttft_s is not None for r in records)
    assert sorted(r.agent for r in records) == [0] * 5 + [1] * 5 + [2] * 5
    assert all(r.output_tokens == 16 and r.decode_s > 0 for r in records)
    for r in records:
        assert r.warm == (r.turn > 0)  # every later turn resends the earlier one
        if r.warm:  # the whole previous prompt came from L0, 16-token blocks and the last token aside
            assert r.cached_tokens >= r.input_tokens - 2 * 64 - 16
        else:
            assert r.cached_tokens == 0
    assert first.cached_by_tier["l1"] == 0 and first.cached_by_tier["l0"] == sum(r.cached_tokens for r in records)
    starts = sorted(r.sent_s for r in records if r.turn == 0)
    assert starts == pytest.approx([0.0, 1 / 3, 2 / 3], abs=1e-4)  # --stagger 1: starts spread over a second


def test_more_agents_wait_longer_for_their_first_token() -> None:
    work = sessions(12, base_blocks=470, turns=6)  # 30K-token sessions
    workload = WorkloadSettings(agents=2, turns=6, think=THINK)
    few = step_stats(replay(work, workload, node(1), STEP_TIME).records, 2)
    many = step_stats(replay(work, replace(workload, agents=12), node(1), STEP_TIME).records, 12)
    assert many["ttft_p95"] > 2 * few["ttft_p95"]
    assert many["ttft_p50"] > few["ttft_p50"]
    assert many["tok_s_p50"] < few["tok_s_p50"]


def test_warm_first_gets_warm_turns_through_cold_bursts_sooner_than_fifo() -> None:
    warm = [growing_session(f"w{i}", (i + 1) * 1_000_000, 120, 2, 15, 20) for i in range(6)]
    cold = [cold_session(f"c{i}", (i + 101) * 1_000_000, 600, 4, 4) for i in range(6)]  # 38K-token cold calls
    work = [session for pair in zip(warm, cold, strict=True) for session in pair]
    workload = WorkloadSettings(agents=12, turns=6, think=ThinkTime(fixed=1.0))
    stats = {
        policy: step_stats(replay(work, workload, node(1, policy), STEP_TIME).records, 12)
        for policy in ("fifo", "warm_first")
    }
    fifo, warm_first = stats["fifo"], stats["warm_first"]
    assert fifo["warm_requests"] == warm_first["warm_requests"] == 30
    assert warm_first["ttft_p95_warm"] < 0.75 * fifo["ttft_p95_warm"]
    assert warm_first["ttft_p95_cold"] <= 1.1 * fifo["ttft_p95_cold"]  # and the cold ones barely notice


def test_the_l1_host_cache_serves_what_l0_evicted() -> None:
    # Four 10K-token sessions on a 32K-token pool: L0 cannot keep them all between turns.
    work = sessions(4, base_blocks=160, turns=6, output=8)
    workload = WorkloadSettings(agents=4, turns=6, think=THINK)
    without = replay(work, workload, node(1, num_blocks=2048), STEP_TIME)
    with_l1 = replay(work, workload, replace(node(1, num_blocks=2048), l1_blocks=20_000), STEP_TIME)
    hit = {
        name: step_stats(r.records, 4, r.cached_by_tier)["cache_hit"] for name, r in (("l0", without), ("l1", with_l1))
    }
    assert with_l1.cached_by_tier["l1"] > 0 and without.cached_by_tier["l1"] == 0
    assert sum(with_l1.l1_cached_by_call) == with_l1.cached_by_tier["l1"]  # per call, in the records' order
    assert hit["l1"] > hit["l0"] + 0.2


def test_paced_l1_copies_still_serve_what_l0_evicted_and_all_land() -> None:
    """Write-through paced as the real tier (its blocks pinned until they land) serves the same load from L1, and
    the replay ends with no copy left on its way (an idle rank steps on until they land)."""
    work = sessions(4, base_blocks=160, turns=6, output=8)
    workload = WorkloadSettings(agents=4, turns=6, think=THINK)
    paced = replace(node(1, num_blocks=2048, l1_paced_copies=True, l1_copy_latency_s=0.2), l1_blocks=20_000)
    assert paced.rank.offload_blocks_per_step == 256  # 512 MiB of 2 MiB blocks (llama-8b's 128 KiB a token)
    sim = Replay(work, workload, paced, STEP_TIME)
    result = sim.run()
    assert result.cached_by_tier["l1"] > 0
    assert all(not r.has_work for r in sim.ranks)
    assert len(result.records) == 24 and all(r.error is None for r in result.records)


def test_exclusive_tiers_with_a_copy_rate_take_longer_than_the_ideal_and_serve_the_same() -> None:
    """The bound from below charges the copies of what L0 evicts to the steps that evict; the bound from above
    copies for free. Both serve the load from L1 past the pool."""
    work = sessions(4, base_blocks=160, turns=6, output=8)
    workload = WorkloadSettings(agents=4, turns=6, think=THINK)
    ideal = replace(node(1, num_blocks=2048, l1_exclusive_ideal=True), l1_blocks=20_000)
    slow = replace(
        node(1, num_blocks=2048, l1_exclusive_ideal=True, l1_exclusive_copy_bytes_per_s=1e9), l1_blocks=20_000
    )
    free, charged = replay(work, workload, ideal, STEP_TIME), replay(work, workload, slow, STEP_TIME)
    assert free.cached_by_tier["l1"] > 0 and charged.cached_by_tier["l1"] > 0
    assert sum(charged.rank_busy_s) > sum(free.rank_busy_s)


def test_on_evict_serves_what_l0_evicted_from_its_saves_and_counts_them() -> None:
    """l1_write_through on_evict: L1 gets only what L0 evicts (saved into the reservation), and serves it."""
    work = sessions(4, base_blocks=160, turns=6, output=8)
    workload = WorkloadSettings(agents=4, turns=6, think=THINK)
    settings = replace(node(1, num_blocks=2048, l1_write_through="on_evict"), l1_blocks=20_000)
    result = replay(work, workload, settings, STEP_TIME)
    assert result.cached_by_tier["l1"] > 0
    (counts,) = result.rank_l1_blocks
    assert counts["eviction_copies"] > 0 and counts["unsaved_no_slot"] == 0, counts  # 4,096 slots: enough here
    written = replay(work, workload, replace(node(1, num_blocks=2048), l1_blocks=20_000), STEP_TIME)
    assert written.rank_l1_blocks[0]["eviction_copies"] == 0  # write-through: nothing copied at eviction


def test_two_ranks_share_the_agents_and_keep_each_session_on_its_rank() -> None:
    work = sessions(8, base_blocks=100, turns=4, output=8)
    result = replay(work, WorkloadSettings(agents=8, turns=4, think=THINK), node(2), STEP_TIME)
    assert all(steps > 0 for steps in result.rank_steps)
    assert result.route_reasons.get("session") == 8 * 3  # every later turn followed its session
    stats = step_stats(result.records, 8, result.cached_by_tier)
    assert stats["cache_hit"] > stats["expected_cache_hit"] - 0.02  # routing kept every prefix where it was


def test_the_router_sees_heartbeats_and_counts_what_it_routed_since() -> None:
    # Eight sessions start at once, before any heartbeat shows them: the router's own estimate of what it
    # sent spreads them; each heartbeat then replaces that estimate with the ranks' report.
    work = sessions(8, base_blocks=100, turns=2, output=8)
    run = Replay(work, WorkloadSettings(agents=8, turns=2, think=THINK), node(2), STEP_TIME)
    first_turns = []
    route = run.router.route

    def recording_route(session_id: str, lookup_hashes: list[bytes], prompt_tokens: int) -> ReplayRank:
        rank = route(session_id, lookup_hashes, prompt_tokens)
        entry = run.router.registry.get(rank.rank_id)
        assert entry is not None
        first_turns.append((rank.rank_id, entry.pending_prefill_tokens, entry.load.waiting))
        return rank

    run.router.route = recording_route  # type: ignore[method-assign]
    run.run()
    assert sorted(rank_id for rank_id, _, _ in first_turns[:8]) == ["rank-0"] * 4 + ["rank-1"] * 4
    assert all(waiting == 0 for _, _, waiting in first_turns[:8]), "no heartbeat had reported them yet"
    assert [pending for rank_id, pending, _ in first_turns[:8] if rank_id == "rank-0"] == [
        6400 * n for n in (1, 2, 3, 4)
    ]
    run.router.heartbeat()  # the ranks are idle now: their report replaces the estimate
    for rank in run.ranks:
        entry = run.router.registry.get(rank.rank_id)
        assert entry is not None and entry.queued_prefill_tokens == 0 and entry.load == rank_load(rank)


def test_the_largest_passing_n_grows_with_ranks() -> None:
    work = sessions(24, base_blocks=470, turns=12)  # 30K-token sessions: decode reads a lot of KV per step
    workload = WorkloadSettings(agents=1, turns=12, think=THINK)
    best = {}
    for ranks in (1, 2):
        # No L1: every session must stay where its prefix is. (When the router judged overload by the whole
        # queue, warm turns left ranks busy with cold first turns and 2 ranks lost the cache-hit bar.)
        steps = simulate_steps(work, [8, 16, 24], workload, node(ranks), STEP_TIME)
        best[ranks] = capacity_summary(steps, monthly_price=None)
        assert all("overloaded-session-rank" not in step["node"]["route_reasons"] for step in steps)
    assert best[1]["largest_passing"] is not None
    assert best[2]["largest_passing"] > best[1]["largest_passing"]
    assert best[2]["input_tokens_per_s"] > best[1]["input_tokens_per_s"]


def test_the_decode_step_budget_keeps_calls_decoding_beside_long_cold_prefills() -> None:
    # Agents decoding 200-token answers over 8K contexts while others send 38K-token cold prompts: with the
    # budget (the engine's default) their steps stay short; without it each 32K-token chunk holds them ~1 s.
    decoding = [growing_session(f"d{i}", (i + 1) * 1_000_000, 120, 2, 6, 200) for i in range(4)]
    cold = [cold_session(f"c{i}", (i + 101) * 1_000_000, 600, 3, 4) for i in range(4)]
    work = [session for pair in zip(decoding, cold, strict=True) for session in pair]
    workload = WorkloadSettings(agents=8, turns=3, think=ThinkTime(fixed=1.0))
    stats = {}
    for budget_ms in (0.0, 50.0):
        settings = node(1)
        # 256-token minimum chunks, as when this bar was set: the simulator's linear step cost (calibrated on
        # b10acc2) does not see what made the engine's default 1024 (a small chunk over a long prefix fills few
        # multiprocessors: bench/results/2026-12-01-h200-mixed-steps/), only that bigger chunks hold decoders longer.
        policy = settings.rank.policy.model_copy(
            update={"decode_step_budget_ms": budget_ms, "min_prefill_chunk_tokens": 256}
        )
        settings = replace(settings, rank=replace(settings.rank, policy=policy))
        stats[budget_ms] = step_stats(replay(work, workload, settings, STEP_TIME).records, 8)
    off, on = stats[0.0], stats[50.0]
    assert on["request_tok_s_p10"] > 2 * off["request_tok_s_p10"]
    assert on["request_tok_s_p10"] >= 15  # near the 20 tok/s bar even in the calls that met the cold prefills
    assert on["ttft_p95_cold"] < 2 * off["ttft_p95_cold"]  # the cold prefills take longer, not forever


def test_a_short_cold_prompt_is_not_held_behind_the_rest_of_a_long_one() -> None:
    # A 100K-token cold prompt (~12 s of prefill in 4K-token steps) starts first; 2 s later a new session sends
    # 10K tokens cold. Cold work goes shortest first (warm_first): the short one waits for the step in flight
    # and its own three chunks, not for the rest of the long prefill.
    work = [cold_session("long", 1_000_000, 1560, 1, 4), cold_session("short", 2_000_000, 156, 1, 4)]
    workload = WorkloadSettings(agents=2, turns=1, think=THINK, stagger_s=4.0)
    records = {r.session: r for r in replay(work, workload, node(1, max_num_batched_tokens=4096), STEP_TIME).records}
    alone = STEP_TIME.prefill_s(1560 * 64, chunk=4096)
    assert records["long"].ttft_s > alone > 10.0
    assert records["short"].sent_s == pytest.approx(2.0)
    assert records["short"].ttft_s < 1.5, "it would have waited for the rest of the long prefill"
    assert records["long"].ttft_s < alone + records["short"].ttft_s  # delayed by about the short one's prefill


def test_decode_payback_keeps_agents_decoding_beside_prefills_whose_minimum_chunk_overruns() -> None:
    # Agents decoding over 30K contexts while cold 100K-token prompts prefill beside them, on a GPU where the
    # minimum chunk over a long prefix already takes several budgets (the step cost of DeepSeek-V2-Lite at
    # 250-400K tokens, here made by a slow attention term). Paid back, the decoders keep their rate.
    slow = replace(STEP_TIME, gamma_s=STEP_TIME.gamma_s * 30)
    decoding = [growing_session(f"d{i}", (i + 1) * 1_000_000, 470, 2, 4, 200) for i in range(3)]
    cold = [cold_session("c", 101 * 1_000_000, 1560, 2, 4)]
    workload = WorkloadSettings(agents=4, turns=4, think=ThinkTime(fixed=1.0))
    stats = {}
    for payback in (False, True):
        settings = node(1)
        policy = settings.rank.policy.model_copy(update={"decode_step_budget_ms": 50.0, "decode_payback": payback})
        settings = replace(settings, rank=replace(settings.rank, policy=policy))
        stats[payback] = step_stats(replay([*decoding, *cold], workload, settings, slow).records, 4)
    off, on = stats[False], stats[True]
    assert on["request_tok_s_p50"] > 1.5 * off["request_tok_s_p50"]
    assert on["errors"] == off["errors"] == 0 and on["requests"] == off["requests"] == 16
