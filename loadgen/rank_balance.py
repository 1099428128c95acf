"""How a multi-rank run spread its work, read from the gateway's request lines (one per finished request,
with the rank that served it): load per rank against the mean, how sticky sessions stayed, and, around a
rank killed mid-run, how its sessions came back (time to first token and how much of their prompt came
from the shared L1 instead of a recompute).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]+)')
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


@dataclass(frozen=True)
class ServedRequest:
    at: float  # when the gateway logged it (epoch seconds; the request's end)
    session: str
    rank: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    l1_cached_tokens: int
    ttft_s: float | None
    rank_switches: int

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the rank had to prefill: the work a request put on its rank."""
        return self.prompt_tokens - self.cached_tokens


def parse_request_lines(lines: Iterable[str]) -> list[ServedRequest]:
    """The gateway's `request ...` log lines (others are skipped)."""
    served = []
    for line in lines:
        if " request id=" not in line:
            continue
        fields = {key: json.loads(value) if value.startswith('"') else value for key, value in _PAIR.findall(line)}
        stamp = _STAMP.match(line)
        at = dt.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if stamp else 0.0
        ttft = fields.get("ttft_ms", "-")
        served.append(
            ServedRequest(
                at=at,
                session=str(fields.get("session", "-")),
                rank=str(fields.get("rank", "-")),
                status=int(fields.get("status", 0)),
                prompt_tokens=int(fields.get("prompt_tokens", 0)),
                cached_tokens=int(fields.get("cached_tokens", 0)),
                l1_cached_tokens=int(fields.get("l1_cached", 0)),
                ttft_s=None if ttft == "-" else float(ttft) / 1000.0,
                rank_switches=int(fields.get("rank_switches", 0)),
            )
        )
    return served


def rank_load(requests: list[ServedRequest], ranks: list[str]) -> dict[str, object]:
    """Per rank: requests and prefill tokens computed; the busiest rank against the mean (the bar: <= 1.3)."""
    served = [r for r in requests if r.status == 200 and r.rank != "-"]
    counts = Counter(r.rank for r in served)
    computed: dict[str, int] = defaultdict(int)
    for request in served:
        computed[request.rank] += request.computed_tokens
    per_rank = {rank: {"requests": counts.get(rank, 0), "computed_tokens": computed.get(rank, 0)} for rank in ranks}
    mean_requests = statistics.fmean(counts.get(rank, 0) for rank in ranks) if ranks else 0.0
    mean_computed = statistics.fmean(computed.get(rank, 0) for rank in ranks) if ranks else 0.0
    return {
        "per_rank": per_rank,
        "max_over_mean_requests": round(max(counts.values()) / mean_requests, 3) if mean_requests else None,
        "max_over_mean_computed_tokens": round(max(computed.values()) / mean_computed, 3) if mean_computed else None,
    }


def stickiness(requests: list[ServedRequest]) -> float | None:
    """The share of requests served by their session's most used rank (1.0: every session stayed put)."""
    by_session: dict[str, Counter[str]] = defaultdict(Counter)
    for request in requests:
        if request.status == 200 and request.session not in ("", "-"):
            by_session[request.session][request.rank] += 1
    total = sum(sum(ranks.values()) for ranks in by_session.values())
    if not total:
        return None
    return round(sum(ranks.most_common(1)[0][1] for ranks in by_session.values()) / total, 4)


def failover(requests: list[ServedRequest], dead_rank: str, killed_at: float) -> dict[str, object]:
    """The sessions the dead rank served before the kill, and their first request that ended after it on
    another rank: its time to first token and the share of its prompt from L1, beside the run's cold turns
    (requests with nothing cached) as the recompute baseline."""
    orphaned = {r.session for r in requests if r.rank == dead_rank and r.at < killed_at}
    resumed: dict[str, ServedRequest] = {}
    for request in sorted(requests, key=lambda r: r.at):
        if request.session in orphaned and request.at >= killed_at and request.rank != dead_rank:
            resumed.setdefault(request.session, request)
    firsts = [r for r in resumed.values() if r.status == 200 and r.ttft_s is not None]
    colds = [r for r in requests if r.status == 200 and r.cached_tokens == 0 and r.ttft_s is not None]
    cold = [r.ttft_s for r in colds]
    prompt = sum(r.prompt_tokens for r in firsts)
    # The restarted rank's work after it re-registered: it rejoined when it serves again.
    back = [r for r in requests if r.rank == dead_rank and r.at >= killed_at and r.status == 200]
    return {
        "dead_rank": dead_rank,
        "orphaned_sessions": len(orphaned),
        "resumed_sessions": len(firsts),
        "resumed_ttft_p50_s": round(statistics.median(r.ttft_s for r in firsts), 3) if firsts else None,  # type: ignore[misc]
        "resumed_l1_share": round(sum(r.l1_cached_tokens for r in firsts) / prompt, 4) if prompt else None,
        "resumed_cache_share": round(sum(r.cached_tokens for r in firsts) / prompt, 4) if prompt else None,
        "resumed_prompt_tokens_p50": round(statistics.median(r.prompt_tokens for r in firsts)) if firsts else None,
        "cold_ttft_p50_s": round(statistics.median(cold), 3) if cold else None,  # type: ignore[type-var]
        "cold_prompt_tokens_p50": round(statistics.median(r.prompt_tokens for r in colds)) if colds else None,
        "served_by_restarted_rank": len(back),
        "restarted_rank_first_served_after_s": round(min(r.at for r in back) - killed_at, 1) if back else None,
        "failed_after_kill": sum(1 for r in requests if r.at >= killed_at and r.status != 200),
        # retried before their first token or continued mid-stream on another rank
        "switched_rank": sum(1 for r in requests if r.rank_switches > 0),
    }
