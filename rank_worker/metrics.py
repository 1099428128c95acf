"""A rank's Prometheus metrics: vLLM's names, types and units (so dashboards and autoscalers built for vLLM read a
rank as they read vLLM), labelled model_name (the served model name) and engine (the rank's id), and kvserve's own
under `kvserve:` (the L1 copy path).

Two sources, neither on the engine thread:
- at scrape time, the engine loop's stats snapshot (EngineStats, refreshed by the engine thread after every
  iteration anyway) and the L1 tier's copy counters (plain numbers the engine thread adds to): gauges, and
  counters the engine keeps cumulatively (prefix cache queries and hits, preemptions, L1 bytes and seconds);
- per request, where the servicer sees it finish (RequestTimer): the TTFT / inter-token / e2e / queue / prefill
  histograms and the prompt's tokens by source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rank_worker.engine.interface import EngineStats, RequestStats

# vLLM v1's bucket choices (vllm/v1/metrics/loggers.py), so their dashboards' quantiles mean the same here.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vllm:prompt_tokens_by_source: computed here, from L0 (the GPU prefix cache), restored from L1 (the kvstore).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class L1Copies:
    """The L1 copy path's cumulative counters (rank_worker/l1/tier.py), as one scrape reads them."""

    restored_bytes: int = 0
    restore_seconds: float = 0.0
    offloaded_bytes: int = 0
    offload_seconds: float = 0.0


def prompt_tokens_by_source(stats: RequestStats) -> dict[str, int]:
    """A finished request's prompt split the way vllm:prompt_tokens_by_source counts it."""
    l0, l1 = stats.l0_cached_tokens, stats.l1_cached_tokens
    return {
        "local_compute": max(stats.prompt_tokens - l0 - l1, 0),
        "local_cache_hit": l0,
        "external_kv_transfer": l1,
    }


def kv_cache_usage(stats: EngineStats) -> float:
    """vllm:kv_cache_usage_perc: the pool's blocks in use by requests, 0..1 (idle cached blocks count as free, as
    vLLM counts them: they are evictable)."""
    return stats.used_blocks / stats.total_blocks if stats.total_blocks else 0.0


class _EngineCollector(Collector):
    """Reads the snapshot at scrape time: no per-step work anywhere."""

    def __init__(
        self, labels: dict[str, str], stats: Callable[[], EngineStats], l1: Callable[[], L1Copies | None]
    ) -> None:
        self._labels = labels
        self._stats = stats
        self._l1 = l1

    def collect(self) -> Iterator[Any]:
        names, values = list(self._labels), list(self._labels.values())
        stats = self._stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage(stats))
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the engine's cache config.",
            labels=[*names, "block_size", "num_gpu_blocks"],
        )
        info.add_metric([*values, str(stats.block_size), str(stats.total_blocks)], 1.0)
        yield info
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_query_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hit_tokens
        )
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", stats.preemptions)
        yield gauge("kvserve:l0_cached_blocks", "Blocks of the L0 prefix cache that hold a hash.", stats.cached_blocks)
        yield gauge("kvserve:l1_attached", "1 while the rank has the kvstore's L1 arena mapped.", stats.l1_attached)
        yield gauge(
            "kvserve:l1_copies_in_flight", "Blocks being offloaded to L1, not committed yet.", stats.l1_copies_in_flight
        )
        yield counter(
            "kvserve:oom_dropped_steps",
            "Steps that ran out of GPU memory, dropped and scheduled again under a token cap.",
            stats.oom_dropped_steps,
        )
        yield counter(
            "kvserve:l1_room_waits",
            "Steps whose admission waited for room to restore a request's L1 blocks whole (not in part).",
            stats.l1_room_waits,
        )
        yield counter(
            "kvserve:l0_evicted_blocks",
            "L0 prefix-cache blocks evicted while L1 was attached.",
            stats.l0_evicted_blocks,
        )
        yield counter(
            "kvserve:l0_evicted_unsaved_blocks",
            "L0 prefix-cache blocks evicted that L1 did not hold: lost to both tiers.",
            stats.l0_evicted_unsaved_blocks,
        )
        yield counter(
            "kvserve:l0_evicted_unsaved_in_flight_blocks",
            "Of the unsaved L0 evictions, blocks on their way to L1 (offered, not copied yet).",
            stats.l0_evicted_unsaved_in_flight_blocks,
        )
        yield counter(
            "kvserve:l0_evicted_unsaved_unoffered_blocks",
            "Of the unsaved L0 evictions, blocks the eviction horizon had not offered: evicted past its reach.",
            stats.l0_evicted_unsaved_unoffered_blocks,
        )
        yield counter(
            "kvserve:l0_evicted_unsaved_past_held_blocks",
            "Of the unoffered unsaved L0 evictions, those made while blocks the horizon offered were held out of the "
            "free queue (for the kvstore's answer or their copy): allocation reached past them.",
            stats.l0_evicted_unsaved_past_held_blocks,
        )
        yield counter(
            "kvserve:l1_fetch_timeouts",
            "L1 lookups given up at their deadline (fetch_timeout_s): their blocks were computed instead.",
            stats.l1_fetch_timeouts,
        )
        yield counter(
            "kvserve:l1_restore_missing_blocks",
            "Blocks L1's event stream said it held when a lookup began that its answer lacked (evicted meanwhile).",
            stats.l1_restore_missing_blocks,
        )
        yield counter(
            "kvserve:l1_restore_room_cut_blocks",
            "Blocks an L1 lookup found with no room in the free pool by its answer (looked up again or computed).",
            stats.l1_restore_room_cut_blocks,
        )
        yield counter(
            "kvserve:l1_restore_unstarted_blocks",
            "Blocks L1 held past an admitted prompt's L0 prefix that were not looked up: no room in the free pool.",
            stats.l1_restore_unstarted_blocks,
        )
        yield counter(
            "kvserve:l0_evicted_unsaved_no_slot_blocks",
            "With l1_write_through on_evict: L0 evictions L1 lacked that found no reserved L1 slot in hand (lost).",
            stats.l0_evicted_unsaved_no_slot_blocks,
        )
        yield counter(
            "kvserve:l1_offer_refused_blocks",
            "Blocks offered to L1 that the kvstore gave no slot for while L1 was not known to hold them (every slot "
            "pinned, or another rank writing the block).",
            stats.l1_offer_refused_blocks,
        )
        yield gauge(
            "kvserve:step_token_cap",
            "Tokens a step may carry since one ran out of GPU memory; 0: no cap.",
            stats.step_token_cap,
        )
        yield gauge(
            "kvserve:waiting_prefill_tokens",
            "Uncached prompt tokens still to prefill on this rank (what it reports to the router).",
            stats.waiting_prefill_tokens,
        )
        copies = self._l1() or L1Copies()
        yield counter(
            "kvserve:l1_restore_bytes", "Bytes copied from the L1 arena into the KV pool.", copies.restored_bytes
        )
        yield counter(
            "kvserve:l1_restore_seconds",
            "Seconds L1 restores took, from issue until the engine saw them complete.",
            copies.restore_seconds,
        )
        yield counter(
            "kvserve:l1_offload_bytes", "Bytes copied from the KV pool into the L1 arena.", copies.offloaded_bytes
        )
        yield counter(
            "kvserve:l1_offload_seconds",
            "Seconds L1 offloads took, from issue until the engine saw them complete.",
            copies.offload_seconds,
        )


class RankMetrics:
    """One rank worker's registry: the engine collector plus the per-request series the servicer observes."""

    def __init__(
        self,
        model_name: str,
        engine: str,
        stats: Callable[[], EngineStats],
        l1: Callable[[], L1Copies | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": engine}
        names = list(self.labels)
        own: dict[str, Any] = {"registry": self.registry}
        self.registry.register(_EngineCollector(self.labels, stats, l1))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names, **own)
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*names, "source"], **own
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, **own
        )
        self.request_success = Counter(
            "vllm:request_success", "Count of finished requests.", [*names, "finished_reason"], **own
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=TTFT_BUCKETS_S,
            **own,
        )
        self.inter_token = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=INTER_TOKEN_BUCKETS_S,
            **own,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=REQUEST_LATENCY_BUCKETS_S,
            **own,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            buckets=REQUEST_LATENCY_BUCKETS_S,
            **own,
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            names,
            buckets=REQUEST_LATENCY_BUCKETS_S,
            **own,
        )
        # Children made up front: every series exported (as 0) before the first request.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.inter_token, self.e2e):
            metric.labels(**self.labels)
        for metric in (self.queue_time, self.prefill_time):
            metric.labels(**self.labels)
        for source in PROMPT_SOURCES:
            self.prompt_tokens_by_source.labels(**self.labels, source=source)
        for reason in FINISH_REASONS:
            self.request_success.labels(**self.labels, finished_reason=reason)

    def request(self, clock: Callable[[], float] = time.monotonic) -> RequestTimer:
        return RequestTimer(self, clock)


class RequestTimer:
    """One Generate call's times, observed on the servicer's event loop as its messages go out."""

    def __init__(self, metrics: RankMetrics, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock
        self._started = clock()
        self._last_token: float | None = None

    def tokens(self, count: int) -> None:
        """`count` tokens went out in one message: the first is the TTFT; the gap since the last message is
        spread over the message's tokens (a message carries what queued up while the previous one was sent)."""
        now, labels = self._clock(), self._metrics.labels
        if count <= 0:
            return
        if self._last_token is None:
            self._metrics.ttft.labels(**labels).observe(now - self._started)
            count -= 1
        elif count:
            gap = (now - self._last_token) / count
            child = self._metrics.inter_token.labels(**labels)
            for _ in range(count):
                child.observe(gap)
        self._last_token = now

    def finished(self, stats: RequestStats, reason: str) -> None:
        """The request's Finished went out: its e2e time, its queue and prefill times, its tokens."""
        metrics, labels = self._metrics, self._metrics.labels
        metrics.e2e.labels(**labels).observe(self._clock() - self._started)
        metrics.queue_time.labels(**labels).observe(stats.queue_wait_s)
        metrics.prefill_time.labels(**labels).observe(stats.prefill_s)
        metrics.prompt_tokens.labels(**labels).inc(stats.prompt_tokens)
        metrics.generation_tokens.labels(**labels).inc(stats.output_tokens)
        for source, count in prompt_tokens_by_source(stats).items():
            metrics.prompt_tokens_by_source.labels(**labels, source=source).inc(count)
        if reason in FINISH_REASONS:
            metrics.request_success.labels(**labels, finished_reason=reason).inc()
