"""The live view of a running step (rich): calls done, in flight, errors, TTFT and cache hit so far."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live
from rich.table import Table

from loadgen.report import percentile

if TYPE_CHECKING:
    from loadgen.agent import StepContext


def step_snapshot(ctx: StepContext, agents: int, duration_s: float | None, turns: int | None) -> Table:
    """A one-row table of the step so far."""
    records = list(ctx.records)
    elapsed = time.monotonic() - ctx.started
    answered = [r for r in records if r.error is None]
    ttfts = [r.ttft_s for r in answered if r.ttft_s is not None]
    p50 = percentile(ttfts, 50)
    p95 = percentile(ttfts, 95)
    inputs = sum(r.input_tokens for r in answered)
    cached = sum(r.cached_tokens for r in answered)
    table = Table(title=f"step: {agents} agents", expand=False)
    for column in ("elapsed", "calls", "in flight", "errors", "ttft p50", "ttft p95", "cache hit"):
        table.add_column(column, justify="right")
    budget = f"/{duration_s:.0f}s" if duration_s is not None else ""
    calls_budget = f"/{turns * agents}" if turns is not None else ""
    table.add_row(
        f"{elapsed:.0f}s{budget}",
        f"{len(records)}{calls_budget}",
        str(ctx.in_flight),
        str(len(records) - len(answered)),
        "-" if p50 is None else f"{p50:.2f}s",
        "-" if p95 is None else f"{p95:.2f}s",
        f"{cached / inputs:.0%}" if inputs else "-",
    )
    return table


@contextlib.asynccontextmanager
async def live_step(
    ctx: StepContext, agents: int, duration_s: float | None, turns: int | None, enabled: bool = True
) -> AsyncIterator[None]:
    """Refresh the step's table twice a second while the body runs (nothing when not enabled)."""
    if not enabled:
        yield
        return
    console = Console(stderr=True)
    with Live(step_snapshot(ctx, agents, duration_s, turns), console=console, transient=False) as live:

        async def refresh() -> None:
            while True:
                await asyncio.sleep(0.5)
                live.update(step_snapshot(ctx, agents, duration_s, turns))

        task = asyncio.create_task(refresh())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            live.update(step_snapshot(ctx, agents, duration_s, turns))
    if not console.is_terminal:
        console.line()  # a log file gets the final table only, and it ends without a newline
