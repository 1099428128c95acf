"""The gateway's Prometheus metrics: names, labels and values in the exposition text, a registry per instance."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.app import APIS
from gateway.observability.metrics import TTFT_BUCKETS_S, GatewayMetrics

API_NAMES = APIS.names  # the labels the app's APIs registered


def samples(metrics: GatewayMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset(labels.items()))]


def test_every_series_is_exported_before_the_first_request() -> None:
    metrics = GatewayMetrics(API_NAMES)
    text = metrics.render()[0].decode()
    for name in (
        "kvserve_gateway_requests_total",
        "kvserve_gateway_time_to_first_token_seconds",
        "kvserve_gateway_prompt_tokens_total",
        "kvserve_gateway_cached_tokens_total",
        "kvserve_gateway_output_tokens_total",
        "kvserve_gateway_errors_total",
        "kvserve_gateway_requests_in_flight",
    ):
        assert f"# HELP {name}" in text
    assert value(metrics, "kvserve_gateway_cached_tokens_total", tier="l1") == 0
    assert value(metrics, "kvserve_gateway_requests_in_flight", api="openai") == 0
    assert value(metrics, "kvserve_gateway_tokenized_tokens_total", source="cache") == 0
    metrics.observe_tokenized(900, 100)
    assert value(metrics, "kvserve_gateway_tokenized_tokens_total", source="cache") == 900
    assert value(metrics, "kvserve_gateway_tokenized_tokens_total", source="encoded") == 100


def test_observations_show_up_in_the_exposition() -> None:
    metrics = GatewayMetrics(API_NAMES)
    metrics.observe_request(
        "anthropic", 200, ttft_s=0.3, prompt_tokens=1000, cached_tokens={"l0": 800, "l1": 100}, output_tokens=50
    )
    metrics.observe_request("anthropic", 200, ttft_s=45.0, prompt_tokens=20, output_tokens=7)
    metrics.observe_request("openai", 529)  # refused before any token
    metrics.observe_error("overloaded_error")
    metrics.observe_error("overloaded_error")
    metrics.observe_error("invalid_request_error")

    assert value(metrics, "kvserve_gateway_requests_total", api="anthropic", status="200") == 2
    assert value(metrics, "kvserve_gateway_requests_total", api="openai", status="529") == 1
    assert value(metrics, "kvserve_gateway_prompt_tokens_total", api="anthropic") == 1020
    assert value(metrics, "kvserve_gateway_cached_tokens_total", tier="l0") == 800
    assert value(metrics, "kvserve_gateway_cached_tokens_total", tier="l1") == 100
    assert value(metrics, "kvserve_gateway_output_tokens_total", api="anthropic") == 57
    assert value(metrics, "kvserve_gateway_output_tokens_total", api="openai") == 0
    assert value(metrics, "kvserve_gateway_errors_total", type="overloaded_error") == 2
    assert value(metrics, "kvserve_gateway_errors_total", type="invalid_request_error") == 1

    ttft = "kvserve_gateway_time_to_first_token_seconds"
    assert value(metrics, f"{ttft}_count", api="anthropic") == 2
    assert value(metrics, f"{ttft}_sum", api="anthropic") == pytest.approx(45.3)
    assert value(metrics, f"{ttft}_bucket", api="anthropic", le="0.25") == 0
    assert value(metrics, f"{ttft}_bucket", api="anthropic", le="0.5") == 1
    assert value(metrics, f"{ttft}_bucket", api="anthropic", le="60.0") == 2
    assert value(metrics, f"{ttft}_count", api="openai") == 0  # no TTFT for a request that sent no token


def test_ttft_buckets_span_10_ms_to_2_minutes() -> None:
    assert TTFT_BUCKETS_S[0] == 0.01 and TTFT_BUCKETS_S[-1] == 120.0
    assert list(TTFT_BUCKETS_S) == sorted(set(TTFT_BUCKETS_S))


def test_in_flight_gauge_follows_the_block_even_on_errors() -> None:
    metrics = GatewayMetrics(API_NAMES)
    with metrics.track_in_flight("openai"), metrics.track_in_flight("openai"):
        assert value(metrics, "kvserve_gateway_requests_in_flight", api="openai") == 2
        assert value(metrics, "kvserve_gateway_requests_in_flight", api="anthropic") == 0
    with pytest.raises(RuntimeError), metrics.track_in_flight("anthropic"):
        raise RuntimeError("client went away")
    assert value(metrics, "kvserve_gateway_requests_in_flight", api="openai") == 0
    assert value(metrics, "kvserve_gateway_requests_in_flight", api="anthropic") == 0


def test_instances_do_not_share_a_registry() -> None:
    first, second = GatewayMetrics(API_NAMES), GatewayMetrics(API_NAMES)  # the global registry would refuse the second
    first.observe_request("openai", 200, output_tokens=3)
    assert value(first, "kvserve_gateway_output_tokens_total", api="openai") == 3
    assert value(second, "kvserve_gateway_output_tokens_total", api="openai") == 0
