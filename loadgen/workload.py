"""Which sessions a run replays (a trace or a synthetic workload) and the context scale that fits them.

Context scale: every replayed turn's input (times the factor) plus its output must fit the served
context. The default factor is the largest that fits the largest turn of the workload (1.0 at most), so a
long-context model replays the trace as it is and a small one replays it shrunk; the reuse pattern is
the same either way (ids are kept, see content.py).
"""

from __future__ import annotations

from pathlib import Path

from loadgen.traces import AgentTrace, TraceTurn, load_claude_code, load_mooncake, synthetic

DEFAULT_TRACES = Path("/work/shared/traces")
SYNTHETIC_TARGETS = {"128k": 128_000, "500k": 500_000, "1m": 1_000_000}
CONTEXT_SLACK = 0.95  # the calibrated content size is an estimate: keep 5% of the context free


def load_workload(
    trace: str, trace_path: str | None, synthetic_target: str | None, agents: int, turns: int, seed: int
) -> list[AgentTrace]:
    """The sessions to replay, in assignment order. synthetic_target (128k/500k/1m) wins over trace; its
    turn sizes come from the Claude Code traces at trace_path (defaults when there are none)."""
    if synthetic_target is not None:
        if synthetic_target not in SYNTHETIC_TARGETS:
            raise ValueError(f"--synthetic must be one of {', '.join(SYNTHETIC_TARGETS)}")
        path = Path(trace_path) if trace_path else DEFAULT_TRACES / "claude_code"
        sizes = load_claude_code(path) if path.exists() else []
        return synthetic(SYNTHETIC_TARGETS[synthetic_target], agents, turns, seed, sizes)
    if trace == "claude_code":
        return load_claude_code(trace_path or DEFAULT_TRACES / "claude_code")
    if trace == "mooncake":
        return load_mooncake(trace_path or DEFAULT_TRACES / "mooncake_synthetic_trace.jsonl.gz")
    raise ValueError(f"unknown trace {trace!r} (claude_code or mooncake)")


def turns_replayed(sessions: list[AgentTrace], agents: int, turns: int | None) -> list[TraceTurn]:
    """The turns a step of `agents` agents can reach: with a turn budget, each agent's first `turns`
    turns of its round-robin sessions; without one, every turn (a long step may reach any of them)."""
    if turns is None:
        return [turn for session in sessions for turn in session.turns]
    reached: list[TraceTurn] = []
    for agent in range(agents):
        left = turns
        # One pass over the sessions: later passes replay the same turns (in another id namespace).
        for k in range(len(sessions)):
            if left <= 0:
                break
            taken = sessions[(agent + k * agents) % len(sessions)].turns[:left]
            reached += taken
            left -= len(taken)
    return reached


def fitting_factor(turns: list[TraceTurn], max_context: int, template_tokens: int, max_output: int | None) -> float:
    """The largest factor <= 1 with input * factor + output + template <= 95% of the context for every turn
    (a turn whose output alone would not leave half the context counts with half: max_tokens is clamped)."""
    usable = max_context * CONTEXT_SLACK - template_tokens
    factor = 1.0
    for turn in turns:
        if turn.input_tokens <= 0:
            continue
        output = turn.output_tokens if max_output is None else min(turn.output_tokens, max_output)
        room = max(usable - output, usable / 2)
        factor = min(factor, room / turn.input_tokens)
    return max(factor, 1e-6)
