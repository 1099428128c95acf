"""One agent's replay loop: its assigned sessions' turns in order, each a streaming call, with think time
between calls, until the step's turn budget or deadline.

Warm vs cold (a documented choice): a request is warm when the trace says at least half of its input was
sent before in this step (the longest hash-id prefix shared with any earlier request, see reuse.py), cold
otherwise. That is what the serving system could reuse, independent of what it did reuse.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from loadgen.content import ContentBuilder, Prompt, turn_ends
from loadgen.reuse import SentPrefixes
from loadgen.traces import AgentTrace, TraceTurn
from loadgen.wire import Api, request_body, stream_call

WARM_REUSE = 0.5  # expected reuse at or above which a request counts as warm


@dataclass
class RequestRecord:
    """What one call measured (times in seconds; sent_s from the step's start)."""

    agent: int
    session: str
    turn: int  # the agent's n-th call in this step, from 0
    session_turn: int  # the turn's index in its trace session
    warm: bool
    expected_reuse: float
    expected_input_tokens: int  # the scaled trace size the content aimed at
    max_tokens: int
    sent_s: float
    ttft_s: float | None
    decode_s: float
    output_tokens: int
    input_tokens: int
    cached_tokens: int
    error: str | None


@dataclass
class ThinkTime:
    """Fixed seconds between an agent's calls, or the trace's think_s (capped) when fixed is None."""

    fixed: float | None = 3.0
    cap_s: float = 120.0

    def before(self, turn: TraceTurn) -> float:
        return self.fixed if self.fixed is not None else min(turn.think_s, self.cap_s)


@dataclass
class StepContext:
    """What all agents of a step share: where to send, how to build prompts, when to stop, what was sent."""

    client: httpx.AsyncClient
    api: Api
    model: str
    content: ContentBuilder
    think: ThinkTime
    max_context: int
    max_output_tokens: int | None
    ignore_eos: bool
    turns_per_agent: int | None
    deadline: float  # monotonic time after which no new call starts
    started: float
    headers: dict[str, str] = field(default_factory=dict)
    sent: SentPrefixes = field(default_factory=SentPrefixes)
    records: list[RequestRecord] = field(default_factory=list)
    in_flight: int = 0
    template_tokens: int = 32  # tokens the chat template adds around the content

    def done(self, turns_done: int) -> bool:
        out_of_turns = self.turns_per_agent is not None and turns_done >= self.turns_per_agent
        return out_of_turns or time.monotonic() >= self.deadline

    def max_tokens_for(self, turn: TraceTurn, expected_input: int) -> int:
        """The trace's output length, capped by --max-output-tokens and by what the context leaves."""
        wanted = (
            turn.output_tokens if self.max_output_tokens is None else min(turn.output_tokens, self.max_output_tokens)
        )
        # A few % of slack: the calibrated content size is an estimate.
        room = self.max_context - int(expected_input * 1.03) - self.template_tokens - 16
        return max(1, min(wanted, room))


async def _think(ctx: StepContext, seconds: float) -> None:
    """Sleep, but never past the step's deadline (a long think simply ends the agent's step)."""
    await asyncio.sleep(max(0.0, min(seconds, ctx.deadline - time.monotonic())))


async def run_agent(index: int, sessions: Iterator[tuple[AgentTrace, str]], ctx: StepContext, delay_s: float) -> None:
    """Replay sessions (each with its own session id) turn by turn until ctx says the agent is done."""
    await _think(ctx, delay_s)
    turns_done = 0
    for session, session_id in sessions:
        ends: tuple[int, ...] = ()  # where the earlier turns that this one extends ended (--messages' cuts)
        previous: tuple[int, ...] = ()
        for session_turn, turn in enumerate(session.turns):
            if ctx.done(turns_done):
                return
            if turns_done > 0:
                await _think(ctx, ctx.think.before(turn))
                if ctx.done(turns_done):
                    return
            ends, previous = turn_ends(previous, ends, turn), turn.hash_ids
            await _call(index, session, session_id, session_turn, turn, turns_done, ctx, ends)
            turns_done += 1


# Tokens an extra user/assistant pair of a --messages conversation adds besides its content: two messages' markers
# (the calibration's template tokens cover one) and the fixed reply, a generous count
PAIR_TOKENS = 24


def _build(content: ContentBuilder, turn: TraceTurn, earlier: tuple[int, ...] = ()) -> tuple[Prompt, int]:
    counts = content.words_for_turn(turn)
    prompt = content.prompt(turn, counts, earlier)
    pairs = max(0, len(prompt.user_turns) - 1)
    return prompt, content.expected_tokens(turn, counts) + pairs * PAIR_TOKENS


async def _call(
    index: int,
    session: AgentTrace,
    session_id: str,
    session_turn: int,
    turn: TraceTurn,
    n: int,
    ctx: StepContext,
    earlier: tuple[int, ...] = (),
) -> None:
    # Off the event loop: a long session's first prompt takes a while to build, and the loop times streams.
    prompt, expected_input = await asyncio.to_thread(_build, ctx.content, turn, earlier)
    reuse = ctx.sent.expected_reuse(turn)
    ctx.sent.add(turn.hash_ids)
    max_tokens = ctx.max_tokens_for(turn, expected_input)
    body = request_body(ctx.api, ctx.model, prompt, max_tokens, ctx.ignore_eos, session_id)
    sent_s = time.monotonic() - ctx.started
    ctx.in_flight += 1
    try:
        outcome = await stream_call(ctx.client, ctx.api, body, ctx.headers)
    finally:
        ctx.in_flight -= 1
    ctx.records.append(
        RequestRecord(
            agent=index,
            session=session.name,
            turn=n,
            session_turn=session_turn,
            warm=reuse >= WARM_REUSE,
            expected_reuse=round(reuse, 4),
            expected_input_tokens=expected_input,
            max_tokens=max_tokens,
            sent_s=round(sent_s, 4),
            ttft_s=outcome.ttft_s,
            decode_s=outcome.decode_s,
            output_tokens=outcome.output_tokens,
            input_tokens=outcome.input_tokens,
            cached_tokens=outcome.cached_tokens,
            error=outcome.error,
        )
    )
