"""Trace parsing on real trace files (copies in tests/loadgen/data), synthetic agents, context scaling."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from loadgen.traces import (
    ID_NAMESPACE,
    load_claude_code,
    load_mooncake,
    scale_context,
    synthetic,
    with_id_offset,
)

DATA = Path(__file__).parent / "data"
CLAUDE = DATA / "claude_code"
MOONCAKE = DATA / "mooncake_head300.jsonl.gz"


def _raw(name: str) -> dict:
    with gzip.open(CLAUDE / name, "rt") as f:
        return json.load(f)


def test_claude_code_sessions_and_subagents_become_agents() -> None:
    agents = load_claude_code(CLAUDE)
    names = [agent.name for agent in agents]
    assert names == [
        "trace_0277",
        "trace_0277/agent_001",
        "trace_0277/agent_002",
        "trace_0277/agent_003",
        "trace_0277/agent_004",
        "trace_0369",
        "trace_0371",
    ]
    raw = _raw("trace_0277.json.gz")
    parent_calls = [r for r in raw["requests"] if r["type"] != "subagent"]
    subagents = [r for r in raw["requests"] if r["type"] == "subagent"]
    by_name = {agent.name: agent for agent in agents}
    parent = by_name["trace_0277"]
    assert len(parent.turns) == len(parent_calls) and parent.start_s == 0.0
    for sub in subagents:
        agent = by_name[f"trace_0277/{sub['agent_id']}"]
        assert agent.start_s == pytest.approx(sub["t"])
        assert len(agent.turns) == len(sub["requests"])
        assert [t.output_tokens for t in agent.turns] == [r["out"] for r in sub["requests"]]


def test_claude_code_turn_fields_and_id_namespace() -> None:
    raw = _raw("trace_0369.json.gz")
    (agent,) = load_claude_code(CLAUDE / "trace_0369.json.gz")
    assert len(agent.turns) == len(raw["requests"])
    for turn, request in zip(agent.turns, raw["requests"], strict=True):
        assert turn.at_s == request["t"] and turn.think_s == request["think_time"]
        assert (turn.input_tokens, turn.output_tokens, turn.block_tokens) == (request["in"], request["out"], 64)
        # Ids are local to a trace: moved into the trace's own namespace, order and equality kept.
        assert turn.hash_ids == tuple(369 * ID_NAMESPACE + h for h in request["hash_ids"])
        assert abs(len(turn.hash_ids) * 64 - turn.input_tokens) < 64


def test_claude_code_ids_of_different_traces_never_collide() -> None:
    agents = load_claude_code(CLAUDE)
    ids_369 = {h for a in agents if a.name == "trace_0369" for t in a.turns for h in t.hash_ids}
    ids_371 = {h for a in agents if a.name == "trace_0371" for t in a.turns for h in t.hash_ids}
    assert ids_369 and ids_371 and not ids_369 & ids_371


def test_claude_code_missing_files_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_claude_code(tmp_path)


def test_mooncake_sessions_by_first_block() -> None:
    with gzip.open(MOONCAKE, "rt") as f:
        raw = [json.loads(line) for line in f]
    agents = load_mooncake(MOONCAKE)
    assert sum(len(a.turns) for a in agents) == len(raw) == 300
    assert len(agents) == len({r["hash_ids"][0] for r in raw})
    for agent in agents:
        firsts = {t.hash_ids[0] for t in agent.turns}
        assert len(firsts) == 1 and agent.name == f"mooncake/{firsts.pop()}"
        assert all(t.block_tokens == 512 for t in agent.turns)
        assert agent.turns[0].at_s == 0.0 and agent.turns[0].think_s == 0.0
        times = [t.at_s for t in agent.turns]
        assert times == sorted(times)
        for previous, turn in zip(agent.turns, agent.turns[1:], strict=False):
            assert turn.think_s == pytest.approx(turn.at_s - previous.at_s)
    multi = [a for a in agents if len(a.turns) > 1]
    assert multi, "the slice holds multi-turn sessions"
    # A later turn of a conversation resends its history: it shares a prefix with the first turn.
    assert any(a.turns[1].hash_ids[:2] == a.turns[0].hash_ids[:2] for a in multi)
    first = raw[0]
    turn = next(a for a in agents if a.name == f"mooncake/{first['hash_ids'][0]}").turns[0]
    assert (turn.input_tokens, turn.output_tokens, list(turn.hash_ids)) == (
        first["input_length"],
        first["output_length"],
        first["hash_ids"],
    )


def test_synthetic_agents_reach_the_target_and_grow_by_prefix() -> None:
    sizes = load_claude_code(CLAUDE)
    agents = synthetic(128_000, agents=3, turns=6, seed=1, sizes_from=sizes)
    assert len(agents) == 3
    for agent in agents:
        assert len(agent.turns) == 6
        assert abs(agent.turns[-1].input_tokens - 128_000) <= 64
        assert agent.turns[0].input_tokens >= 64_000
        for previous, turn in zip(agent.turns, agent.turns[1:], strict=False):
            assert turn.hash_ids[: len(previous.hash_ids)] == previous.hash_ids
            assert turn.input_tokens == len(turn.hash_ids) * 64
        assert {t.output_tokens for t in agent.turns} <= {t.output_tokens for a in sizes for t in a.turns}
    # A shared prefix (the system prompt all agents have), then each agent's own blocks.
    first = [agent.turns[0].hash_ids for agent in agents]
    assert first[0][:10] == first[1][:10] == first[2][:10]
    assert first[0][-1] != first[1][-1]
    assert synthetic(128_000, 3, 6, 1, sizes) == agents
    assert synthetic(128_000, 3, 6, 2, sizes) != agents


def test_synthetic_without_source_traces_uses_defaults() -> None:
    (agent,) = synthetic(500_000, agents=1, turns=3, seed=0, sizes_from=[])
    assert abs(agent.turns[-1].input_tokens - 500_000) <= 64 and agent.turns[1].think_s == 3.0


def test_scale_context_keeps_ids_and_outputs() -> None:
    (agent,) = load_claude_code(CLAUDE / "trace_0371.json.gz")
    scaled = scale_context(agent, 0.1)
    for turn, small in zip(agent.turns, scaled.turns, strict=True):
        assert small.hash_ids == turn.hash_ids
        assert small.input_tokens == round(turn.input_tokens * 0.1)
        assert small.block_tokens == 6 and small.output_tokens == turn.output_tokens
        assert (small.at_s, small.think_s) == (turn.at_s, turn.think_s)
    with pytest.raises(ValueError):
        scale_context(agent, 0)


def test_id_offset_moves_every_id() -> None:
    (agent,) = load_claude_code(CLAUDE / "trace_0371.json.gz")
    moved = with_id_offset(agent, 10**13, "#1")
    assert moved.name == "trace_0371#1"
    for turn, other in zip(agent.turns, moved.turns, strict=True):
        assert other.hash_ids == tuple(h + 10**13 for h in turn.hash_ids)
