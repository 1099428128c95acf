"""A step of the benchmark: N agents replay their sessions concurrently against the gateway, then drain.

Sessions are assigned round-robin: agent i of N replays sessions i, i+N, i+2N, ... (wrapping around the
list). A session replayed a second time in a step, and every session of a later step, gets its hash ids
moved to a fresh namespace: a later step must not find the previous step's prompts in the cache, and two
agents on the same trace are two users, not one conversation sent twice.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from loadgen.agent import RequestRecord, StepContext, ThinkTime, run_agent
from loadgen.content import ContentBuilder
from loadgen.gateway_info import cached_tokens_by_tier
from loadgen.progress import live_step
from loadgen.traces import AgentTrace, with_id_offset
from loadgen.wire import Api

# Larger than any id a loader produces (Claude Code namespaces reach ~10^12).
REPLAY_NAMESPACE = 10**13


def replay_offset(seed: int, step_index: int, replica: int) -> int:
    """The id offset of one replay of a session: distinct per (seed, step, replica)."""
    return ((seed * 1_000 + step_index) * 1_000_000 + replica) * REPLAY_NAMESPACE


def assigned_sessions(
    sessions: list[AgentTrace], agents: int, agent_index: int, step_index: int, seed: int
) -> Iterator[tuple[AgentTrace, str]]:
    """Agent agent_index's endless round-robin share of sessions, each with its session id."""
    if not sessions:
        raise ValueError("no sessions to replay")
    for k in itertools.count():
        position = agent_index + k * agents
        session = sessions[position % len(sessions)]
        replica = position // len(sessions)
        offset = replay_offset(seed, step_index, replica)
        session_id = f"loadgen-{seed}-{step_index}-{replica}-{session.name}"
        yield with_id_offset(session, offset, f"#{replica}" if replica else ""), session_id


@dataclass(frozen=True)
class RunSettings:
    """What every step of a run shares."""

    base_url: str
    api: Api
    model: str
    content: ContentBuilder
    think: ThinkTime
    max_context: int
    max_output_tokens: int | None
    ignore_eos: bool
    seed: int
    request_timeout_s: float
    template_tokens: int
    api_key: str = ""
    live: bool = True


@dataclass(frozen=True)
class StepSettings:
    index: int
    agents: int
    duration_s: float | None  # None: only the turn budget ends the step
    turns: int | None  # per agent; None: only the duration ends the step
    stagger_s: float = 0.0  # agents start spread over this many seconds


@dataclass
class StepResult:
    agents: int
    records: list[RequestRecord]
    cached_by_tier: dict[str, float]  # the gateway's l0/l1 cached-token counters, after minus before
    wall_s: float


def _headers(api_key: str) -> dict[str, str]:
    return {"x-api-key": api_key, "authorization": f"Bearer {api_key}"} if api_key else {}


def run_step(sessions: list[AgentTrace], step: StepSettings, run: RunSettings) -> StepResult:
    """Run one step to the end (deadline or turn budget, then every call in flight finished)."""
    if step.duration_s is None and step.turns is None:
        raise ValueError("a step needs a duration or a turn budget")
    with httpx.Client(base_url=run.base_url, headers=_headers(run.api_key), timeout=30) as client:
        before = cached_tokens_by_tier(client)
        started = time.monotonic()
        records = asyncio.run(_run_agents(sessions, step, run))
        wall_s = time.monotonic() - started
        after = cached_tokens_by_tier(client)
    delta = {tier: after[tier] - before.get(tier, 0.0) for tier in after}
    return StepResult(agents=step.agents, records=records, cached_by_tier=delta, wall_s=wall_s)


async def _run_agents(sessions: list[AgentTrace], step: StepSettings, run: RunSettings) -> list[RequestRecord]:
    timeout = httpx.Timeout(run.request_timeout_s, connect=30)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=run.base_url, timeout=timeout, limits=limits) as client:
        now = time.monotonic()
        ctx = StepContext(
            client=client,
            api=run.api,
            model=run.model,
            content=run.content,
            think=run.think,
            max_context=run.max_context,
            max_output_tokens=run.max_output_tokens,
            ignore_eos=run.ignore_eos,
            turns_per_agent=step.turns,
            deadline=now + step.duration_s if step.duration_s is not None else float("inf"),
            started=now,
            headers=_headers(run.api_key),
            template_tokens=run.template_tokens,
        )
        tasks = [
            asyncio.create_task(
                run_agent(
                    index,
                    assigned_sessions(sessions, step.agents, index, step.index, run.seed),
                    ctx,
                    delay_s=step.stagger_s * index / max(1, step.agents),
                )
            )
            for index in range(step.agents)
        ]
        async with live_step(ctx, step.agents, step.duration_s, step.turns, enabled=run.live):
            await asyncio.gather(*tasks)
        return sorted(ctx.records, key=lambda record: record.sent_s)
