"""The router's Prometheus metrics (kvserve: names), read at scrape time from the counters RouterState and
DurableState keep: routing decisions by reason, session turns sticky / moved / new, ranks, sessions, the node's
L1 as the router sees it, and Redis's health."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.durable_state import DurableState
from router.router_state import RouterState

# route_score.choose_rank's reasons, exported as 0 before the first route.
ROUTE_REASONS = ("session", "overloaded-session-rank", "prefix", "load", "only-rank")
SESSION_TURNS = ("sticky", "moved", "new")


class _RouterCollector(Collector):
    def __init__(self, state: RouterState, durable: DurableState | None) -> None:
        self._state = state
        self._durable = durable

    def collect(self) -> Iterator[Any]:
        state = self._state
        decisions = CounterMetricFamily(
            "kvserve:router_decisions", "Routing decisions by reason (the router's route log line).", labels=["reason"]
        )
        for reason in sorted(set(ROUTE_REASONS) | set(state.decisions)):
            decisions.add_metric([reason], state.decisions[reason])
        yield decisions
        turns = CounterMetricFamily(
            "kvserve:router_session_turns",
            "Routed turns of sessions: sticky (the session's last rank), moved (another rank), new (no rank known).",
            labels=["outcome"],
        )
        for outcome in SESSION_TURNS:
            turns.add_metric([outcome], state.session_turns[outcome])
        yield turns
        ranks = GaugeMetricFamily("kvserve:router_ranks", "Ranks the router knows, by health.", labels=["state"])
        healthy = len(state.registry.healthy())
        ranks.add_metric(["healthy"], healthy)
        ranks.add_metric(["down"], len(state.registry) - healthy)
        yield ranks
        yield GaugeMetricFamily("kvserve:router_sessions", "Sessions in the session table.", value=len(state.sessions))
        yield GaugeMetricFamily(
            "kvserve:router_l1_blocks",
            "Blocks the kvstore's L1 holds, as the router knows.",
            value=state.index.l1_blocks,
        )
        if self._durable is not None:
            durable = self._durable
            yield GaugeMetricFamily("kvserve:redis_up", "1 while the router's Redis answers.", value=durable.connected)
            yield CounterMetricFamily("kvserve:redis_errors", "Redis calls that failed.", value=durable.errors)
            yield GaugeMetricFamily(
                "kvserve:redis_pending_writes", "Changes in memory not yet in Redis.", value=durable.pending_writes
            )


def router_registry(state: RouterState, durable: DurableState | None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_RouterCollector(state, durable))
    return registry
