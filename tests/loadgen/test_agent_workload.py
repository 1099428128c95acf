"""Session assignment (round-robin, fresh id namespaces), the turns a step reaches, the fitting scale."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from loadgen.agent import StepContext, ThinkTime
from loadgen.content import ContentBuilder
from loadgen.runner import assigned_sessions, replay_offset
from loadgen.traces import AgentTrace, TraceTurn, load_claude_code
from loadgen.workload import fitting_factor, load_workload, turns_replayed

DATA = Path(__file__).parent / "data"


def _session(name: str, sizes: list[int], output: int = 100) -> AgentTrace:
    turns = tuple(TraceTurn(0.0, 0.0, size, output, tuple(range(1, size // 64 + 1)), 64) for size in sizes)
    return AgentTrace(name, turns)


def test_round_robin_assignment_with_fresh_namespaces() -> None:
    sessions = [_session(name, [640]) for name in "abc"]
    take = lambda agent: list(itertools.islice(assigned_sessions(sessions, 2, agent, 0, 0), 3))  # noqa: E731
    agent0, agent1 = take(0), take(1)
    # Agent i of 2 replays positions i, i+2, i+4 of the list; the second pass over it is replica 1.
    assert [s.name for s, _ in agent0] == ["a", "c", "b#1"]
    assert [s.name for s, _ in agent1] == ["b", "a#1", "c#1"]
    # Replica 0 of step 0 keeps the ids; a second replay of "a" has its own ids and session id.
    assert agent0[0][0].turns[0].hash_ids == sessions[0].turns[0].hash_ids
    assert not set(agent1[1][0].turns[0].hash_ids) & set(agent0[0][0].turns[0].hash_ids)
    assert agent0[0][1] != agent1[1][1]
    # A later step never meets an earlier step's ids, nor does another seed.
    step1 = next(assigned_sessions(sessions, 2, 0, 1, 0))[0]
    seed1 = next(assigned_sessions(sessions, 2, 0, 0, 1))[0]
    offsets = {replay_offset(0, 0, 0), replay_offset(0, 1, 0), replay_offset(1, 0, 0), replay_offset(0, 0, 1)}
    assert len(offsets) == 4
    assert step1.turns[0].hash_ids != sessions[0].turns[0].hash_ids != seed1.turns[0].hash_ids
    with pytest.raises(ValueError):
        next(assigned_sessions([], 2, 0, 0, 0))


def test_turns_replayed_with_and_without_a_budget() -> None:
    sessions = [_session("a", [640, 1280]), _session("b", [64]), _session("c", [6400, 12800, 25600])]
    every = turns_replayed(sessions, agents=2, turns=None)
    assert len(every) == 6
    # Agent 0: a (2 turns) then c's first; agent 1: b (1 turn) then a (wraps) first 2.
    reached = turns_replayed(sessions, agents=2, turns=3)
    assert sorted(t.input_tokens for t in reached) == sorted([640, 1280, 6400, 64, 640, 1280])


def test_fitting_factor_fits_the_largest_turn() -> None:
    turns = [_session("a", [10_000, 100_000], output=200).turns[1], _session("b", [50_000], output=2000).turns[0]]
    factor = fitting_factor(turns, max_context=4096, template_tokens=30, max_output=None)
    for turn in turns:
        assert turn.input_tokens * factor + min(turn.output_tokens, 2000) + 30 <= 4096 * 0.95 + 1e-6
    assert factor == pytest.approx((4096 * 0.95 - 30 - 200) / 100_000)
    assert fitting_factor(turns, max_context=1_000_000, template_tokens=30, max_output=None) == 1.0
    # An output longer than the context only counts for half (max_tokens is clamped at send time).
    huge_output = _session("c", [100_000], output=100_000).turns
    assert fitting_factor(list(huge_output), 4096, 30, None) == pytest.approx((4096 * 0.95 - 30) / 2 / 100_000)


def test_max_tokens_follow_the_trace_within_the_context() -> None:
    ctx = StepContext(
        client=None,  # type: ignore[arg-type]
        api="anthropic",
        model="m",
        content=ContentBuilder(1.0),
        think=ThinkTime(),
        max_context=4096,
        max_output_tokens=None,
        ignore_eos=True,
        turns_per_agent=1,
        deadline=float("inf"),
        started=0.0,
    )
    turn = _session("a", [640], output=300).turns[0]
    assert ctx.max_tokens_for(turn, 640) == 300
    assert ctx.max_tokens_for(turn, 3900) == 4096 - int(3900 * 1.03) - 32 - 16
    assert ctx.max_tokens_for(turn, 4000) == 1
    ctx.max_output_tokens = 8
    assert ctx.max_tokens_for(turn, 640) == 8


def test_think_time_fixed_or_from_the_trace() -> None:
    turn = TraceTurn(0.0, 500.0, 64, 1, (1,), 64)
    assert ThinkTime(fixed=3.0).before(turn) == 3.0
    assert ThinkTime(fixed=None, cap_s=120.0).before(turn) == 120.0
    assert ThinkTime(fixed=None).before(TraceTurn(0.0, 7.0, 64, 1, (1,), 64)) == 7.0


def test_load_workload_kinds() -> None:
    claude = load_workload("claude_code", str(DATA / "claude_code"), None, 4, 5, 0)
    assert claude == load_claude_code(DATA / "claude_code")
    mooncake = load_workload("mooncake", str(DATA / "mooncake_head300.jsonl.gz"), None, 4, 5, 0)
    assert sum(len(a.turns) for a in mooncake) == 300
    synthetic = load_workload("claude_code", str(DATA / "claude_code"), "128k", 4, 5, 0)
    assert len(synthetic) == 4 and all(len(a.turns) == 5 for a in synthetic)
    with pytest.raises(ValueError):
        load_workload("claude_code", None, "2m", 4, 5, 0)
    with pytest.raises(ValueError):
        load_workload("sharegpt", None, None, 4, 5, 0)
