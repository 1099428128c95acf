"""The EPP's Prometheus metrics (kvserve:epp_ names): decisions by reason, refusals by status, how long a
decision took, and per node its readiness, load as last read and the blocks its KV events put in the index."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from gateway.epp.main import Epp
    from gateway.epp.picker import Decision


class EppMetrics:
    def __init__(self, epp: Epp) -> None:
        self.registry = CollectorRegistry()
        self._epp = epp
        self.decisions = Counter(
            "kvserve:epp_decisions",
            "Requests sent to a node, by the reason of the choice.",
            ["reason"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "kvserve:epp_refusals",
            "Requests the EPP answered itself, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "kvserve:epp_decision_seconds",
            "From a request's body to its node: parsing, tokenizing, hashing, choosing.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )
        self.registry.register(self)

    def decided(self, decision: Decision | None, outcome: str, seconds: float) -> None:
        if decision is None:
            self.refusals.labels(outcome).inc()
            return
        self.decisions.labels(outcome).inc()
        self.decision_seconds.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("kvserve:epp_node_ready", "1 while the node is ready.", labels=["node"])
        queued = GaugeMetricFamily(
            "kvserve:epp_node_queued_prefill_tokens", "Prefill queued on the node as the EPP sees it.", labels=["node"]
        )
        blocks = GaugeMetricFamily(
            "kvserve:epp_node_indexed_blocks", "Blocks the node's KV events report held.", labels=["node"]
        )
        for node in self._epp.nodes:
            ready.add_metric([node.name], float(node.ready))
            queued.add_metric([node.name], float(node.queued_prefill_tokens))
            blocks.add_metric([node.name], float(self._epp.index.blocks(node.name)))
        yield ready
        yield queued
        yield blocks
        batches = CounterMetricFamily("kvserve:epp_kv_event_batches", "KV event batches applied.", labels=["source"])
        gaps = CounterMetricFamily(
            "kvserve:epp_kv_event_gaps", "Gaps in a publisher's sequence that replay did not fill.", labels=["source"]
        )
        for subscriber in self._epp.subscribers:
            batches.add_metric([subscriber.source_id], subscriber.counts.batches)
            gaps.add_metric([subscriber.source_id], subscriber.counts.gaps)
        yield batches
        yield gaps
