"""The gateway's Prometheus metrics, kept in a registry of their own so that several apps (and tests) in one
process do not collide in the global one. The `api` label is the name each API registered (gateway.http.apis)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CacheTier = Literal["l0", "l1"]  # l0: GPU prefix cache, l1: host-memory cache

CACHE_TIERS: tuple[CacheTier, ...] = ("l0", "l1")

SESSION_REPORT_OUTCOMES = ("sent", "failed", "dropped")

TOKENIZED_SOURCES = ("cache", "encoded")

# From a short warm-cache reply (~10 ms) to a long prompt prefilled cold behind a queue (minutes).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self, apis: Iterable[str] = (), namespace: str = "kvserve_gateway") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        own: dict[str, Any] = {"namespace": namespace, "registry": self.registry}
        self.requests = Counter("requests", "Finished requests by API and HTTP status", ["api", "status"], **own)
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds",
            "Seconds from receiving a request to sending its first output token",
            ["api"],
            buckets=TTFT_BUCKETS_S,
            **own,
        )
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens, cached ones included", ["api"], **own)
        self.cached_tokens = Counter("cached_tokens", "Prompt tokens served from a KV cache tier", ["tier"], **own)
        self.output_tokens = Counter("output_tokens", "Generated tokens", ["api"], **own)
        self.tokenized_tokens = Counter(
            "tokenized_tokens",
            "Prompt tokens the gateway had to tokenize, by source: cache (the ids of a message seen before, "
            "gateway/prompt/segment_cache.py) or encoded",
            ["source"],
            **own,
        )
        self.errors = Counter("errors", "Errors by API error type", ["type"], **own)
        self.in_flight = Gauge("requests_in_flight", "Requests received and not yet finished", ["api"], **own)
        self.waiting_for_rank = Gauge(
            "requests_waiting_for_rank",
            "Requests (new ones, or streams a failed rank cut) waiting for a rank to come back",
            **own,
        )
        self.session_reports = Counter(
            "session_reports",
            "Finished requests of sessions reported to the router's per-session view, by outcome: sent, failed "
            "(the router refused or did not answer in time), dropped (the router away, or too many unanswered)",
            ["outcome"],
            **own,
        )
        # Children created up front, so every series is exported as 0 before the first request.
        for outcome in SESSION_REPORT_OUTCOMES:
            self.session_reports.labels(outcome=outcome)
        for api in apis:
            self.time_to_first_token.labels(api=api)
            self.prompt_tokens.labels(api=api)
            self.output_tokens.labels(api=api)
            self.in_flight.labels(api=api)
        for tier in CACHE_TIERS:
            self.cached_tokens.labels(tier=tier)
        for source in TOKENIZED_SOURCES:
            self.tokenized_tokens.labels(source=source)

    @contextmanager
    def track_in_flight(self, api: str) -> Iterator[None]:
        """Count a request as in flight for the duration of the block (a streaming response included)."""
        gauge = self.in_flight.labels(api=api)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    def observe_request(
        self,
        api: str,
        status: int,
        *,
        ttft_s: float | None = None,
        prompt_tokens: int = 0,
        cached_tokens: Mapping[CacheTier, int] | None = None,
        output_tokens: int = 0,
    ) -> None:
        """Record a finished request; ttft_s is None when no token was sent (an error before the first)."""
        self.requests.labels(api=api, status=str(status)).inc()
        if ttft_s is not None:
            self.time_to_first_token.labels(api=api).observe(ttft_s)
        self.prompt_tokens.labels(api=api).inc(prompt_tokens)
        for tier, count in (cached_tokens or {}).items():
            self.cached_tokens.labels(tier=tier).inc(count)
        self.output_tokens.labels(api=api).inc(output_tokens)

    def observe_error(self, error_type: str) -> None:
        """Count an error by its API error type (invalid_request_error, overloaded_error, ...): a fixed set of
        names, never free text, so the number of series stays bounded."""
        self.errors.labels(type=error_type).inc()

    def observe_session_report(self, outcome: str) -> None:
        self.session_reports.labels(outcome=outcome).inc()

    def observe_tokenized(self, from_cache: int, encoded: int) -> None:
        self.tokenized_tokens.labels(source="cache").inc(from_cache)
        self.tokenized_tokens.labels(source="encoded").inc(encoded)

    def render(self) -> tuple[bytes, str]:
        """The exposition text for GET /metrics and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
