"""The gRPC services' Prometheus metrics without processes: each registry's names, types and labels as a scrape
parses them, the values they read, the rank's per-request series, the router's decision counters, and the Grafana
dashboard (deploy/grafana/kvserve.json) querying only series a service exports. tests/e2e/test_routing_e2e.py
scrapes the real services."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from contracts.metrics_http import serve_metrics
from gateway.epp.fleet_config import FleetConfig, NodeSpec
from kvstore.l1_store import ArenaInfo, L1Store
from protos import rank_worker_pb2 as pb
from rank_worker.engine.interface import EngineStats, RequestStats
from rank_worker.metrics import L1Copies, RankMetrics, prompt_tokens_by_source
from router.durable_state import DurableState
from router.metrics import router_registry
from router.rank_registry import RankIdentity, RankLoad
from router.route_score import RoutePolicy
from router.router_state import RouteQuery, RouterState, session_turn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "router"))
from router_prompts import lookup_hashes, prompt_tokens  # noqa: E402

DASHBOARD = ROOT / "deploy" / "grafana" / "kvserve.json"


def engine_stats(**changes: int) -> EngineStats:
    values = dict(
        total_blocks=100, free_blocks=75, cached_blocks=40, used_blocks=25, running=2, waiting=3,
        prefix_query_tokens=1000, prefix_hit_tokens=640, finished_requests=7, preemptions=1, block_size=16,
        waiting_prefill_tokens=50,
    )  # fmt: skip
    values.update(changes)
    return EngineStats(**values)  # type: ignore[arg-type]


def scrape(registry: CollectorRegistry) -> dict[str, tuple[str, list]]:
    """family name -> (type, samples), as Prometheus reads the exposition text."""
    text = generate_latest(registry).decode()
    return {family.name: (family.type, family.samples) for family in text_string_to_metric_families(text)}


def value(families: dict, family: str, sample: str | None = None, **labels: str) -> float:
    _, samples = families[family]
    name = sample or family
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (family, sample, labels, samples)
    return found[0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rank_metrics(clock: Clock | None = None) -> RankMetrics:
    copies = L1Copies(restored_bytes=4096, restore_seconds=0.5, offloaded_bytes=8192, offload_seconds=0.25)
    return RankMetrics("smol", "rank-0", engine_stats, lambda: copies)


def router_state() -> tuple[RouterState, DurableState]:
    state = RouterState(RoutePolicy(0.05, 10_000), session_ttl_s=60, rank_down_after_s=5)
    for rank_id in ("a", "b"):
        state.register_rank(RankIdentity(rank_id, f"{rank_id}:1", "i1", 16, b"\0" * 16), RankLoad())
    durable = DurableState(state, "redis://127.0.0.1:1/0")
    state.durable = durable
    return state, durable


def test_a_rank_exports_vllms_names_types_and_labels() -> None:
    families = scrape(rank_metrics().registry)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:prompt_tokens_by_source": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "kvserve:l1_restore_bytes": "counter",
        "kvserve:l1_restore_seconds": "counter",
        "kvserve:l1_offload_bytes": "counter",
        "kvserve:l1_offload_seconds": "counter",
        "kvserve:oom_dropped_steps": "counter",
        "kvserve:step_token_cap": "gauge",
        "kvserve:l1_room_waits": "counter",
        "kvserve:l0_evicted_blocks": "counter",
        "kvserve:l0_evicted_unsaved_blocks": "counter",
        "kvserve:l0_evicted_unsaved_in_flight_blocks": "counter",
        "kvserve:l0_evicted_unsaved_unoffered_blocks": "counter",
        "kvserve:l0_evicted_unsaved_past_held_blocks": "counter",
        "kvserve:l0_evicted_unsaved_no_slot_blocks": "counter",
        "kvserve:l1_fetch_timeouts": "counter",
        "kvserve:l1_restore_missing_blocks": "counter",
        "kvserve:l1_restore_room_cut_blocks": "counter",
        "kvserve:l1_restore_unstarted_blocks": "counter",
        "kvserve:l1_offer_refused_blocks": "counter",
    }
    for name, kind in expected.items():
        assert families[name][0] == kind, name
        for sample in families[name][1]:
            assert sample.labels["model_name"] == "smol" and sample.labels["engine"] == "rank-0", sample
    assert value(families, "vllm:num_requests_running") == 2
    assert value(families, "vllm:kv_cache_usage_perc") == 0.25  # 0..1, as vLLM's
    assert value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 640
    assert value(families, "vllm:cache_config_info", block_size="16", num_gpu_blocks="100") == 1
    assert value(families, "kvserve:l1_restore_bytes", "kvserve:l1_restore_bytes_total") == 4096
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):  # 0 before the first request
        assert value(families, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total", source=source) == 0
    shrunk = scrape(
        RankMetrics(
            "smol",
            "rank-0",
            lambda: engine_stats(
                oom_dropped_steps=3,
                step_token_cap=2048,
                l1_room_waits=5,
                l0_evicted_blocks=40,
                l0_evicted_unsaved_blocks=7,
                l0_evicted_unsaved_in_flight_blocks=2,
                l0_evicted_unsaved_unoffered_blocks=4,
                l0_evicted_unsaved_past_held_blocks=3,
                l0_evicted_unsaved_no_slot_blocks=13,
                l1_fetch_timeouts=6,
                l1_restore_missing_blocks=8,
                l1_restore_room_cut_blocks=9,
                l1_restore_unstarted_blocks=11,
                l1_offer_refused_blocks=12,
            ),
        ).registry
    )
    assert value(shrunk, "kvserve:l1_room_waits", "kvserve:l1_room_waits_total") == 5
    assert value(shrunk, "kvserve:oom_dropped_steps", "kvserve:oom_dropped_steps_total") == 3
    assert value(shrunk, "kvserve:l0_evicted_blocks", "kvserve:l0_evicted_blocks_total") == 40
    assert value(shrunk, "kvserve:l0_evicted_unsaved_blocks", "kvserve:l0_evicted_unsaved_blocks_total") == 7
    for name, amount in (("in_flight", 2), ("unoffered", 4), ("past_held", 3), ("no_slot", 13)):
        counter = f"kvserve:l0_evicted_unsaved_{name}_blocks"
        assert value(shrunk, counter, f"{counter}_total") == amount
    for counter, amount in (
        ("kvserve:l1_fetch_timeouts", 6),
        ("kvserve:l1_restore_missing_blocks", 8),
        ("kvserve:l1_restore_room_cut_blocks", 9),
        ("kvserve:l1_restore_unstarted_blocks", 11),
        ("kvserve:l1_offer_refused_blocks", 12),
    ):
        assert value(shrunk, counter, f"{counter}_total") == amount
    assert value(shrunk, "kvserve:step_token_cap") == 2048


def test_a_finished_request_is_counted_by_source_and_timed() -> None:
    clock = Clock()
    metrics = rank_metrics()
    timer = metrics.request(clock)
    clock.now += 0.3
    timer.tokens(1)  # TTFT 0.3
    clock.now += 0.2
    timer.tokens(4)  # 4 tokens over 0.2 s: 0.05 each
    clock.now += 0.1
    stats = RequestStats(prompt_tokens=100, l0_cached_tokens=48, l1_cached_tokens=32, output_tokens=5, queue_wait_s=0.1)
    timer.finished(stats, "stop")
    families = scrape(metrics.registry)
    by_source = "vllm:prompt_tokens_by_source_total"
    assert value(families, "vllm:prompt_tokens_by_source", by_source, source="local_compute") == 20
    assert value(families, "vllm:prompt_tokens_by_source", by_source, source="local_cache_hit") == 48
    assert value(families, "vllm:prompt_tokens_by_source", by_source, source="external_kv_transfer") == 32
    assert abs(value(families, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum") - 0.3) < 1e-9
    itl = "vllm:inter_token_latency_seconds"
    assert value(families, itl, f"{itl}_count") == 4
    assert abs(value(families, itl, f"{itl}_sum") - 0.2) < 1e-9
    assert abs(value(families, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum") - 0.6) < 1e-9
    assert value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 1
    assert value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 5
    assert prompt_tokens_by_source(RequestStats(prompt_tokens=3, l0_cached_tokens=16))["local_compute"] == 0


def test_the_router_counts_decisions_by_reason_and_session_turns() -> None:
    state, durable = router_state()
    first = state.route(RouteQuery("r1", "s", lookup_hashes(prompt_tokens(1, 64)), 64)).choice
    state.route(RouteQuery("r2", "s", lookup_hashes(prompt_tokens(1, 80)), 80))  # sticky
    state.route(RouteQuery("r3", "s", lookup_hashes(prompt_tokens(1, 96)), 96, frozenset({first.rank_id})))  # moved
    families = scrape(router_registry(state, durable))
    decisions = "kvserve:router_decisions_total"
    assert value(families, "kvserve:router_decisions", decisions, reason="session") == 1
    assert value(families, "kvserve:router_decisions", decisions, reason="only-rank") == 1
    assert value(families, "kvserve:router_decisions", decisions, reason="overloaded-session-rank") == 0
    turns = "kvserve:router_session_turns_total"
    assert [value(families, "kvserve:router_session_turns", turns, outcome=o) for o in ("new", "sticky", "moved")] == [
        1,
        1,
        1,
    ]
    assert value(families, "kvserve:router_ranks", state="healthy") == 2
    assert value(families, "kvserve:redis_up") == 0  # never connected here
    assert families["kvserve:redis_errors"][0] == "counter"
    assert session_turn(None, "a") == "new" and session_turn("a", "a") == "sticky" and session_turn("a", "b") == "moved"


def test_the_kvstore_reports_its_arena() -> None:
    store = L1Store(ArenaInfo("arena", "/nonexistent", 1 << 20), pin_ttl_s=60)
    from kvstore.metrics import kvstore_registry

    families = scrape(kvstore_registry(store))
    assert value(families, "kvserve:l1_capacity_bytes") == 1 << 20
    assert value(families, "kvserve:l1_used_bytes") == 0  # no rank attached yet: no layout
    assert families["kvserve:l1_hit_blocks"][0] == "counter"
    assert value(families, "kvserve:l1_slots", state="stored") == 0


def epp_metrics():  # type: ignore[no-untyped-def]
    """The EPP's registry over one node, with a decision and a refusal counted."""
    from gateway.epp.main import Epp
    from gateway.epp.picker import Picker, ReadRequest

    epp = Epp(FleetConfig(nodes=[NodeSpec(name="a", endpoint="127.0.0.1:9")]))
    node = epp.nodes[0]
    node.ready, node.info = True, pb.ModelInfoResponse(served_model_name="m", block_size=16)
    epp.metrics.decided(Picker.choose(epp.picker, ReadRequest("", "", {}, {}), "/v1/models"), "load", 0.001)
    epp.metrics.decided(None, "503", 0.0)
    epp.zmq.term()
    return epp.metrics


def test_the_epp_reports_its_choices_and_nodes() -> None:
    families = scrape(epp_metrics().registry)
    assert value(families, "kvserve:epp_decisions", "kvserve:epp_decisions_total", reason="load") == 1
    assert value(families, "kvserve:epp_refusals", "kvserve:epp_refusals_total", status="503") == 1
    assert value(families, "kvserve:epp_node_ready", node="a") == 1
    assert value(families, "kvserve:epp_node_indexed_blocks", node="a") == 0


def test_the_dashboard_queries_only_exported_series() -> None:
    state, durable = router_state()
    from kvstore.metrics import kvstore_registry

    exported: set[str] = set()
    for registry in (
        rank_metrics().registry,
        router_registry(state, durable),
        kvstore_registry(L1Store(ArenaInfo("arena", "/nonexistent", 1 << 20), pin_ttl_s=60)),
        epp_metrics().registry,
    ):
        exported |= {sample.name for _, samples in scrape(registry).values() for sample in samples}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(?:vllm|kvserve):[a-z0-9_]+", target["expr"])
    }
    queried |= set(re.findall(r"\b(?:vllm|kvserve):[a-z0-9_]+", json.dumps(dashboard["templating"])))
    assert len(queried) >= 20
    assert queried <= exported, sorted(queried - exported)


def test_metrics_are_served_over_http_and_off_at_port_0() -> None:
    registry = rank_metrics().registry
    assert serve_metrics(registry, "127.0.0.1", 0, "test") is None
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = serve_metrics(registry, "127.0.0.1", port, "test")
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert "vllm:num_requests_running" in {f.name for f in text_string_to_metric_families(text)}
    finally:
        server.stop()
