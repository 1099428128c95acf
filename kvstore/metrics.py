"""The kvstore's Prometheus metrics (kvserve: names), read at scrape time from its slot index's counters: the L1
arena's capacity and use in bytes and slots, lookups and hits, blocks stored and evicted, pins dropped, slots
reserved and the spare copies committed into them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.l1_store import L1Store

SLOT_STATES = ("free", "stored", "writing", "pinned")


class _KvStoreCollector(Collector):
    def __init__(self, store: L1Store) -> None:
        self._store = store

    def collect(self) -> Iterator[Any]:
        store = self._store
        stats = store.stats()  # None until the first rank attaches (the layout is fixed then)
        slot_bytes = store.layout.slot_bytes if store.layout is not None else 0
        yield GaugeMetricFamily(
            "kvserve:l1_capacity_bytes", "Bytes of the L1 arena in shared memory.", value=store.arena.size_bytes
        )
        stored = stats.stored_slots if stats is not None else 0
        yield GaugeMetricFamily(
            "kvserve:l1_used_bytes", "Bytes of the L1 arena holding stored blocks.", value=stored * slot_bytes
        )
        yield GaugeMetricFamily(
            "kvserve:l1_capacity_slots",
            "Block slots of the arena (0 until a rank fixes the layout).",
            value=stats.num_slots if stats is not None else 0,
        )
        slots = GaugeMetricFamily("kvserve:l1_slots", "Arena slots by state.", labels=["state"])
        counts = (
            (stats.free_slots, stats.stored_slots, stats.writing_slots, stats.pinned_slots)
            if stats is not None
            else (0, 0, 0, 0)
        )
        for state, count in zip(SLOT_STATES, counts, strict=True):
            slots.add_metric([state], count)
        yield slots
        for name, doc, field in (
            ("kvserve:l1_lookup_blocks", "Blocks ranks looked up in L1.", "lookup_blocks"),
            ("kvserve:l1_hit_blocks", "Blocks ranks looked up and found in L1.", "hit_blocks"),
            ("kvserve:l1_stored_blocks", "Blocks written to L1 (committed).", "stored_total"),
            ("kvserve:l1_evicted_blocks", "Blocks evicted from L1 (LRU) to make room.", "evicted_total"),
            ("kvserve:l1_expired_pins", "Pins dropped after l1_pin_ttl_secs (a dead copier).", "expired_pins_total"),
            ("kvserve:l1_reserved_slots", "Slots ranks reserved for blocks named at commit.", "reserved_total"),
            (
                "kvserve:l1_duplicate_commits",
                "Reserved slots committed with a block L1 already had (freed: a spare copy).",
                "duplicate_commits_total",
            ),
        ):
            yield CounterMetricFamily(name, doc, value=getattr(stats, field) if stats is not None else 0)


def kvstore_registry(store: L1Store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_KvStoreCollector(store))
    return registry
