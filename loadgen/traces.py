"""Workload traces as agents: Claude Code sessions, the Mooncake trace, and synthetic long-context agents.

A trace holds no text, only token counts and block hash ids; equal ids mean equal content, so a replay
that maps every id to the same text reproduces the trace's reuse exactly.

Hash-id scope: the Claude Code traces number their blocks per trace (``hash_id_scope: local``, every
trace starts at id 1), so id 5 of one session is not id 5 of another. ``load_claude_code`` therefore
moves each trace's ids into its own namespace (``trace number * ID_NAMESPACE + local id``); a subagent
shares its parent's namespace, as in the trace. The Mooncake ids are global to its file and kept as is.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

# Room for the ids of one trace (the largest Claude Code trace uses ~15K); namespaces never overlap.
ID_NAMESPACE = 1_000_000_000
CLAUDE_CODE_BLOCK_TOKENS = 64
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceTurn:
    """One model call of an agent."""

    at_s: float  # seconds from the agent's start when the trace made this call
    think_s: float  # client delay before this call
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one id per block of the input; equal ids = equal content
    block_tokens: int  # tokens per hash id (64 for Claude Code traces, 512 for Mooncake)


@dataclass(frozen=True)
class AgentTrace:
    """One agent's sequence of calls."""

    name: str
    turns: tuple[TraceTurn, ...]
    start_s: float = 0.0  # offset from its parent's start (subagents), 0 for a top-level session


def _open_json(path: Path) -> object:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _trace_number(trace_id: str, fallback: int) -> int:
    digits = re.findall(r"\d+", trace_id)
    return int(digits[-1]) if digits else fallback


def _claude_code_agents(
    name: str, requests: Iterable[dict], block_tokens: int, namespace: int, start_s: float
) -> list[AgentTrace]:
    """The agent of one request list plus, recursively, its subagents (each an agent of its own)."""
    turns: list[TraceTurn] = []
    subagents: list[AgentTrace] = []
    for request in requests:
        if request.get("type") == "subagent":
            sub_name = f"{name}/{request.get('agent_id', len(subagents))}"
            sub_start = start_s + float(request.get("t", 0.0))
            subagents += _claude_code_agents(sub_name, request.get("requests", []), block_tokens, namespace, sub_start)
            continue
        turns.append(
            TraceTurn(
                at_s=float(request.get("t", 0.0)),
                think_s=float(request.get("think_time", 0.0) or 0.0),
                input_tokens=int(request["in"]),
                output_tokens=int(request["out"]),
                hash_ids=tuple(namespace + int(h) for h in request.get("hash_ids", [])),
                block_tokens=block_tokens,
            )
        )
    own = [AgentTrace(name=name, turns=tuple(turns), start_s=start_s)] if turns else []
    return own + subagents


def load_claude_code(path: str | Path) -> list[AgentTrace]:
    """Claude Code sessions from a directory of trace_*.json.gz files (sorted by name) or from one file.

    Each session and each of its subagents becomes an AgentTrace; a subagent's start_s is the time its
    parent started it (seconds from the top-level session's start). Ids are namespaced per trace file.
    """
    path = Path(path)
    files = sorted(path.glob("trace_*.json*")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no trace_*.json.gz files in {path}")
    agents: list[AgentTrace] = []
    for index, file in enumerate(files):
        data = _open_json(file)
        if not isinstance(data, dict) or "requests" not in data:
            raise ValueError(f"{file}: not a Claude Code trace (no 'requests')")
        trace_id = str(data.get("id", file.name.split(".")[0]))
        namespace = _trace_number(trace_id, index + 1) * ID_NAMESPACE
        block_tokens = int(data.get("block_size", CLAUDE_CODE_BLOCK_TOKENS))
        agents += _claude_code_agents(trace_id, data["requests"], block_tokens, namespace, 0.0)
    return agents


def load_mooncake(path: str | Path) -> list[AgentTrace]:
    """The Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids of 512-token blocks).

    The file has no session ids; a session is inferred as the requests that share their first hash id
    (a conversation resends its own history, which starts with the same block), in file order. at_s is
    the request's time from the session's first request; think_s is the gap since the session's previous
    request (an upper bound on the client's think time: the trace does not record service time).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    sessions: dict[int, list[dict]] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            request = json.loads(line)
            hash_ids = request.get("hash_ids") or []
            # A request without blocks is a session of its own (negative keys never collide with ids).
            key = int(hash_ids[0]) if hash_ids else -line_number
            sessions.setdefault(key, []).append(request)
    agents: list[AgentTrace] = []
    for key, requests in sessions.items():
        first_ms = float(requests[0]["timestamp"])
        previous_ms = first_ms
        turns: list[TraceTurn] = []
        for request in requests:
            at_ms = float(request["timestamp"])
            turns.append(
                TraceTurn(
                    at_s=(at_ms - first_ms) / 1000.0,
                    think_s=max(0.0, (at_ms - previous_ms) / 1000.0),
                    input_tokens=int(request["input_length"]),
                    output_tokens=int(request["output_length"]),
                    hash_ids=tuple(int(h) for h in request.get("hash_ids", [])),
                    block_tokens=MOONCAKE_BLOCK_TOKENS,
                )
            )
            previous_ms = at_ms
        agents.append(AgentTrace(name=f"mooncake/{key}", turns=tuple(turns), start_s=first_ms / 1000.0))
    return agents


def synthetic(
    target_context: int, agents: int, turns: int, seed: int, sizes_from: list[AgentTrace]
) -> list[AgentTrace]:
    """Agents whose context grows to target_context tokens by their last turn.

    Turn growth (new input tokens between consecutive calls), output tokens and think times are drawn
    from the given traces. Every agent starts with the same shared prefix (as Claude Code's tool
    definitions and system prompt are shared by sessions) of min(16K, target/4) tokens; the first turn
    holds the rest of the context the later turns' growth leaves, so the last turn reaches the target.
    Block size is that of the source traces (64 when drawn from Claude Code).
    """
    if target_context <= 0 or agents <= 0 or turns <= 0:
        raise ValueError("target_context, agents and turns must be positive")
    growths, outputs, thinks = _turn_statistics(sizes_from)
    block_tokens = sizes_from[0].turns[0].block_tokens if sizes_from and sizes_from[0].turns else 64
    target_blocks = max(1, target_context // block_tokens)
    shared_blocks = min(16_384 // block_tokens, target_blocks // 4)
    rng = random.Random(seed)
    result: list[AgentTrace] = []
    for agent_index in range(agents):
        namespace = (agent_index + 1) * ID_NAMESPACE
        grow = [max(1, round(rng.choice(growths) / block_tokens)) for _ in range(turns - 1)]
        # Growth never eats more than half the context: the first turn keeps at least half the target.
        while sum(grow) > target_blocks // 2 and any(g > 1 for g in grow):
            grow = [max(1, g // 2) for g in grow]
        first_blocks = max(shared_blocks + 1, target_blocks - sum(grow))
        ids = list(range(1, shared_blocks + 1))
        ids += [namespace + i for i in range(1, first_blocks - shared_blocks + 1)]
        next_id = namespace + first_blocks - shared_blocks + 1
        agent_turns: list[TraceTurn] = []
        at_s = 0.0
        for turn_index in range(turns):
            if turn_index > 0:
                ids += list(range(next_id, next_id + grow[turn_index - 1]))
                next_id += grow[turn_index - 1]
            think_s = 0.0 if turn_index == 0 else rng.choice(thinks)
            at_s += think_s
            agent_turns.append(
                TraceTurn(
                    at_s=at_s,
                    think_s=think_s,
                    input_tokens=len(ids) * block_tokens,
                    output_tokens=rng.choice(outputs),
                    hash_ids=tuple(ids),
                    block_tokens=block_tokens,
                )
            )
        result.append(AgentTrace(name=f"synthetic-{target_context}/{agent_index}", turns=tuple(agent_turns)))
    return result


def _turn_statistics(sizes_from: list[AgentTrace]) -> tuple[list[int], list[int], list[float]]:
    """Positive context growths, output lengths and think times of the traces (defaults if empty)."""
    growths: list[int] = []
    outputs: list[int] = []
    thinks: list[float] = []
    for agent in sizes_from:
        for previous, turn in zip(agent.turns, agent.turns[1:], strict=False):
            if turn.input_tokens > previous.input_tokens:
                growths.append(turn.input_tokens - previous.input_tokens)
            thinks.append(turn.think_s)
        outputs += [turn.output_tokens for turn in agent.turns]
    return growths or [2_000], outputs or [200], thinks or [3.0]


def scale_context(agent: AgentTrace, factor: float) -> AgentTrace:
    """The agent with input token counts and block tokens multiplied by factor (to fit a smaller model).

    Hash ids are kept, so the reuse pattern (which blocks repeat, in which order) is unchanged; only the
    size of each block shrinks. block_tokens is rounded to an int of at least 1; input_tokens is
    len(hash_ids)-consistent only up to that rounding, so content builders that need the exact scaled
    block size use original block_tokens * factor. Output tokens and timings are not scaled: they are not
    context.
    """
    if factor <= 0:
        raise ValueError("factor must be positive")
    turns = tuple(
        replace(
            turn,
            input_tokens=max(1, round(turn.input_tokens * factor)),
            block_tokens=max(1, round(turn.block_tokens * factor)),
        )
        for turn in agent.turns
    )
    return replace(agent, turns=turns)


def with_id_offset(agent: AgentTrace, offset: int, name_suffix: str) -> AgentTrace:
    """A copy of the agent whose hash ids are shifted by offset: a second replay of the same session that
    must not reuse the first replay's blocks (two users do not send each other's conversations)."""
    turns = tuple(replace(turn, hash_ids=tuple(h + offset for h in turn.hash_ids)) for turn in agent.turns)
    return replace(agent, name=agent.name + name_suffix, turns=turns)
