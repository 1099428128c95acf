"""Per-step statistics and the verdict against the pass bar: pure functions over request records.

A step passes when TTFT p95 <= 15 s, per-agent output tok/s p50 >= 20 and p10 >= 10, the cache hit is at
least 97% of the infinite-cache optimum of the same calls (the trace's own reuse, `expected_cache_hit`: a flat
bar would ask of a server what the trace does not allow) and fewer than 1% of requests failed (all thresholds
adjustable). A statistic with no samples (no answered request, no decode time) fails its criterion.

Beside the per-agent rate, which pools an agent's calls, the per-request rate (request_tok_s_p50/p10, not a
criterion) shows how each call decoded: a call whose decode was stalled by other requests' prefills is slow
there even when its agent's other calls make up for it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loadgen.agent import RequestRecord

CRITERIA = ("ttft_p95", "tok_s_p50", "tok_s_p10", "cache_hit", "errors")


@dataclass(frozen=True)
class Thresholds:
    ttft_p95_s: float = 15.0
    tok_s_p50: float = 20.0
    tok_s_p10: float = 10.0
    cache_hit_of_optimum: float = 0.97  # cache hit >= this x expected_cache_hit
    errors: float = 0.01  # the error fraction must stay below this

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Thresholds:
        """The thresholds a result file recorded; a key this version does not know (an older bar's flat
        `cache_hit`) is left out, and its criterion takes today's default."""
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in record.items() if key in known})


def add_pass_bar_arguments(parser: argparse.ArgumentParser) -> None:
    """The bar's flags, the same for the load generator and the simulator (defaults: Thresholds')."""
    bar = parser.add_argument_group("pass bar")
    bar.add_argument("--ttft-p95", type=float, default=Thresholds.ttft_p95_s, help="max TTFT p95 (s)")
    bar.add_argument("--tok-s-p50", type=float, default=Thresholds.tok_s_p50, help="min per-agent output tok/s p50")
    bar.add_argument("--tok-s-p10", type=float, default=Thresholds.tok_s_p10, help="min per-agent output tok/s p10")
    bar.add_argument(
        "--cache-hit-of-optimum",
        type=float,
        default=Thresholds.cache_hit_of_optimum,
        help="min cache hit as a fraction of the infinite-cache optimum of the same calls",
    )
    bar.add_argument("--max-errors", type=float, default=Thresholds.errors, help="error fraction must stay below this")


def thresholds_from(args: argparse.Namespace) -> Thresholds:
    return Thresholds(args.ttft_p95, args.tok_s_p50, args.tok_s_p10, args.cache_hit_of_optimum, args.max_errors)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics; None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def agent_tok_s(records: Iterable[RequestRecord]) -> dict[int, float]:
    """Per agent: output tokens after each call's first / the time spent decoding them (answered calls
    only; an agent that never decoded for a measurable time has no rate)."""
    tokens: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for record in records:
        if record.error is not None or record.ttft_s is None:
            continue
        tokens[record.agent] = tokens.get(record.agent, 0) + max(0, record.output_tokens - 1)
        seconds[record.agent] = seconds.get(record.agent, 0.0) + record.decode_s
    return {agent: tokens[agent] / seconds[agent] for agent in tokens if seconds[agent] > 0}


def request_tok_s(records: Iterable[RequestRecord]) -> list[float]:
    """Per answered call: its output tokens after the first / the time spent decoding them (a call that never
    decoded for a measurable time has no rate)."""
    return [
        (record.output_tokens - 1) / record.decode_s
        for record in records
        if record.error is None and record.ttft_s is not None and record.output_tokens > 1 and record.decode_s > 0
    ]


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def step_stats(
    records: Sequence[RequestRecord],
    agents: int,
    cached_by_tier: dict[str, float] | None = None,
    wall_s: float = 0.0,
    thresholds: Thresholds = Thresholds(),
) -> dict[str, Any]:
    """The step's statistics, its verdict (passed) and the criteria it failed (failed)."""
    answered = [r for r in records if r.error is None and r.ttft_s is not None]
    warm = [r for r in answered if r.warm]
    cold = [r for r in answered if not r.warm]
    ttfts = [r.ttft_s for r in answered if r.ttft_s is not None]
    warm_ttfts = [r.ttft_s for r in warm if r.ttft_s is not None]
    cold_ttfts = [r.ttft_s for r in cold if r.ttft_s is not None]
    rates = list(agent_tok_s(records).values())
    request_rates = request_tok_s(records)
    input_tokens = sum(r.input_tokens for r in answered)
    cached_tokens = sum(r.cached_tokens for r in answered)
    expected_input = sum(r.expected_input_tokens for r in answered)
    tiers = cached_by_tier or {}
    stats: dict[str, Any] = {
        "agents": agents,
        "requests": len(records),
        "answered": len(answered),
        "error_count": len(records) - len(answered),
        "errors": _rounded(_ratio(len(records) - len(answered), len(records)) if records else 0.0),
        "warm_requests": sum(1 for r in records if r.warm),
        "cold_requests": sum(1 for r in records if not r.warm),
        "ttft_p50": _rounded(percentile(ttfts, 50)),
        "ttft_p95": _rounded(percentile(ttfts, 95)),
        "ttft_p50_warm": _rounded(percentile(warm_ttfts, 50)),
        "ttft_p95_warm": _rounded(percentile(warm_ttfts, 95)),
        "ttft_p50_cold": _rounded(percentile(cold_ttfts, 50)),
        "ttft_p95_cold": _rounded(percentile(cold_ttfts, 95)),
        "tok_s_p50": _rounded(percentile(rates, 50), 2),
        "tok_s_p10": _rounded(percentile(rates, 10), 2),
        "request_tok_s_p50": _rounded(percentile(request_rates, 50), 2),
        "request_tok_s_p10": _rounded(percentile(request_rates, 10), 2),
        "input_tokens": input_tokens,
        "cached_tokens": cached_tokens,
        "output_tokens": sum(r.output_tokens for r in answered),
        # answered calls that stopped before max_tokens: a server that drops ignore_eos (vLLM's /v1/messages)
        # decodes less than it was asked to, which flatters its tok/s and TTFT under load
        "short_outputs": sum(1 for r in answered if r.output_tokens < r.max_tokens),
        "cache_hit": _rounded(_ratio(cached_tokens, input_tokens)),
        "cache_hit_warm": _rounded(_ratio(sum(r.cached_tokens for r in warm), sum(r.input_tokens for r in warm))),
        "cache_hit_cold": _rounded(_ratio(sum(r.cached_tokens for r in cold), sum(r.input_tokens for r in cold))),
        # The best an infinite cache could do on the calls cache_hit is over, the answered ones (the trace's own
        # reuse): over every call, a server's failed calls would move the bar its answered ones are held to.
        "expected_cache_hit": _rounded(
            _ratio(sum(r.expected_reuse * r.expected_input_tokens for r in answered), expected_input)
        ),
        "l0_cached_tokens": int(tiers.get("l0", 0.0)),
        "l1_cached_tokens": int(tiers.get("l1", 0.0)),
        "cache_hit_l0": _rounded(_ratio(tiers.get("l0", 0.0), input_tokens)),
        "cache_hit_l1": _rounded(_ratio(tiers.get("l1", 0.0), input_tokens)),
        "wall_s": round(wall_s, 2),
    }
    failed = failed_criteria(stats, thresholds)
    stats["passed"] = not failed
    stats["failed"] = failed
    return stats


def cache_hit_met(cache_hit: float | None, optimum: float | None, thresholds: Thresholds) -> bool:
    """The cache criterion: a hit of at least cache_hit_of_optimum x the infinite-cache optimum of the same calls
    (missing either, it is not met)."""
    return cache_hit is not None and optimum is not None and cache_hit >= thresholds.cache_hit_of_optimum * optimum


def failed_criteria(stats: dict[str, Any], thresholds: Thresholds) -> list[str]:
    """The names (of CRITERIA) the step's statistics miss; a missing statistic (or a cache hit without the
    optimum to weigh it against) misses."""
    checks = {
        "ttft_p95": lambda v: v <= thresholds.ttft_p95_s,
        "tok_s_p50": lambda v: v >= thresholds.tok_s_p50,
        "tok_s_p10": lambda v: v >= thresholds.tok_s_p10,
        "cache_hit": lambda v: cache_hit_met(v, stats.get("expected_cache_hit"), thresholds),
        "errors": lambda v: v < thresholds.errors,
    }
    failed = []
    for name in CRITERIA:
        value = stats.get(name)
        if value is None or not checks[name](value):
            failed.append(name)
    if not stats.get("requests"):
        failed.append("requests")  # nothing was measured: nothing passed
    return failed


def largest_passing(steps: Sequence[dict[str, Any]]) -> int | None:
    """The end of the run of passing steps from the smallest agent count up: the largest count below which
    every step passed (None when the smallest failed). A pass above a failure is noise, not capacity."""
    best = None
    for step in sorted(steps, key=lambda step: step["agents"]):
        if not step.get("passed"):
            break
        best = step["agents"]
    return best


def step_row(stats: dict[str, Any]) -> list[str]:
    """The step as table cells, in the order of TABLE_COLUMNS."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    return [
        str(stats["agents"]),
        str(stats["requests"]),
        seconds(stats["ttft_p50"]),
        seconds(stats["ttft_p95"]),
        f"{seconds(stats['ttft_p95_warm'])} / {seconds(stats['ttft_p95_cold'])}",
        rate(stats["tok_s_p50"]),
        rate(stats["tok_s_p10"]),
        # Older result files (and the simulator's calibration input) may not have the per-request rate.
        f"{rate(stats.get('request_tok_s_p50'))} / {rate(stats.get('request_tok_s_p10'))}",
        share(stats["cache_hit"]),
        f"{share(stats['cache_hit_l0'])} / {share(stats['cache_hit_l1'])}",
        share(stats["errors"]),
        "PASS" if stats["passed"] else "fail: " + ", ".join(stats["failed"]),
    ]


TABLE_COLUMNS = (
    "agents",
    "calls",
    "ttft p50",
    "ttft p95",
    "p95 warm / cold",
    "tok/s p50",
    "tok/s p10",
    "call tok/s p50 / p10",
    "cache hit",
    "L0 / L1",
    "errors",
    "verdict",
)
