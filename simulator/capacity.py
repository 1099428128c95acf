"""Predicted steps of increasing N, judged as the load generator judges measured ones (loadgen/report.py), the
largest passing N, and what a million input tokens costs at that N."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from loadgen.report import Thresholds, largest_passing, step_stats
from loadgen.traces import AgentTrace
from simulator.replay import NodeSettings, ReplayResult, WorkloadSettings, replay
from simulator.step_time import StepTimeModel

SECONDS_PER_MONTH = 730 * 3600  # 365 days x 24 h / 12


def simulate_steps(
    sessions: list[AgentTrace],
    agent_counts: Sequence[int],
    workload: WorkloadSettings,
    node: NodeSettings,
    step_time: StepTimeModel,
    thresholds: Thresholds = Thresholds(),
    calls: bool = False,
) -> list[dict[str, Any]]:
    """One predicted step per agent count: the load generator's step statistics plus what the node did (and with
    calls, each call's record with its L1 tokens)."""
    steps: list[dict[str, Any]] = []
    for index, agents in enumerate(agent_counts):
        result = replay(sessions, replace(workload, agents=agents, step_index=index), node, step_time)
        steps.append(replayed_step(result, agents, thresholds, calls=calls))
    return steps


def replayed_step(result: ReplayResult, agents: int, thresholds: Thresholds, *, calls: bool = False) -> dict[str, Any]:
    """One replayed step judged as the load generator judges a measured one, with what the node's ranks did;
    calls: every call's record too (the load generator's fields, and l1_cached_tokens), to set beside a measured
    run's call by call (bench/sim_vs_gpu.py)."""
    stats = step_stats(result.records, agents, result.cached_by_tier, result.wall_s, thresholds)
    stats["input_tokens_per_s"] = round(stats["input_tokens"] / result.wall_s, 1) if result.wall_s > 0 else None
    stats["node"] = {
        "rank_busy_s": [round(s, 2) for s in result.rank_busy_s],
        "rank_steps": result.rank_steps,
        "route_reasons": result.route_reasons,
        "rank_l1_blocks": result.rank_l1_blocks,
    }
    if calls:
        stats["calls"] = [
            {**asdict(record), "l1_cached_tokens": l1}
            for record, l1 in zip(result.records, result.l1_cached_by_call, strict=True)
        ]
    return stats


def cost_per_million_input_tokens(monthly_price: float, input_tokens_per_s: float | None) -> float | None:
    """The node's monthly price over the input tokens it serves in a month at this rate (None: no rate)."""
    if not input_tokens_per_s or input_tokens_per_s <= 0:
        return None
    return monthly_price / (input_tokens_per_s * SECONDS_PER_MONTH / 1e6)


def capacity_summary(steps: Sequence[dict[str, Any]], monthly_price: float | None) -> dict[str, Any]:
    """The largest passing N and, with a price, the cost per million input tokens at that N."""
    best = largest_passing(steps)
    summary: dict[str, Any] = {"largest_passing": best, "cost_per_million_input_tokens": None}
    if best is not None:
        step = next(s for s in steps if s["agents"] == best and s.get("passed"))
        summary["input_tokens_per_s"] = step.get("input_tokens_per_s")
        if monthly_price is not None:
            cost = cost_per_million_input_tokens(monthly_price, step.get("input_tokens_per_s"))
            summary["cost_per_million_input_tokens"] = None if cost is None else round(cost, 4)
            summary["monthly_price"] = monthly_price
    return summary
