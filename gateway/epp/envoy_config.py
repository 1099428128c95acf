"""Envoy in front of kvserve nodes, with the EPP as its external processor: the bootstrap, as a dict the caller
dumps to YAML (`envoy -c FILE`).

The shape is the Gateway API Inference Extension's reference Envoy (its inferencepool chart's envoy.yaml): the
ext_proc filter streams each request to the EPP (headers, the body in FULL_DUPLEX_STREAMED pieces, trailers; no
response part), the EPP answers with `x-gateway-destination-endpoint: ip:port`, and the router sends the request to
an ORIGINAL_DST cluster that connects to the address that header names. The route cache is cleared after the EPP's
answer, so the route that matches on the header applies whatever the EPP's clear_route_cache says. A client's own
`x-gateway-destination-endpoint` is removed as the request arrives: only the EPP names a destination.

Without a destination header a request reached the router without the EPP's choice: with `fail_open` (ext_proc's
failure_mode_allow) it goes round robin over every node's gateway (only those answering /ready, retried once on a
refused connection); fail-closed, ext_proc itself answers the failure (`status_on_error`, 503) at once, and a request
the EPP let through without a choice gets 503 too.

Envoy fails open in FULL_DUPLEX_STREAMED only while no body piece has gone into the ext_proc stream (it keeps no
copy of the body): a request whose stream to a dead EPP fails after that gets 503 even when fail-open. So the EPP
must be known down before a stream opens: Envoy health-checks its grpc.health.v1 (the ext_proc service, SERVING
while a node is ready) every `health_check_interval_s` and, fail-open, ejects it on its first refused connection
and never sends to it while it is ejected or failing its checks (no panic routing); such a request then fails open
at once. A request racing the EPP's death can still get 503, quickly. A hung EPP (SIGSTOPped) answers no HTTP/2
ping: Envoy closes its connection within 3 s, the requests streaming on it get 503, and its health checks mark it
down. (`message_timeout_s` alone does not bound that wait with a FULL_DUPLEX_STREAMED body: a test saw a request
held until the client gave up.)

Responses are never cut by a timeout of Envoy's: no route timeout (a CPU prefill takes minutes, and the gateway
keeps SSE streams alive with pings), only an idle stream timeout. Every request gets one JSON access log line: its
status, Envoy's response flags and details, the node it went to (`upstream`) and through which cluster
(`epp_destination`: the EPP's choice; `nodes`: round robin), the EPP's choice, the session and the gateway's
request id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contracts.address import is_loopback, split_host_port
from gateway.epp.fleet_config import DESTINATION_HEADER

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
EPP_CLUSTER = "epp"
DESTINATION_CLUSTER = "epp_destination"  # ORIGINAL_DST: the node the EPP chose
NODES_CLUSTER = "nodes"  # round robin over every node's gateway: the fail-open path
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # the EPP's grpc.health.v1 service name
FAIL_CLOSED_STATUS = 503  # the EPP down or silent, fail-closed: the service is unavailable, not broken
CIRCUIT_BREAKER_LIMIT = 40_000  # as the reference Envoy: Envoy's default (1,024 requests) is a load limit we never want
ACCESS_LOG_FIELDS = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "cluster": "%UPSTREAM_CLUSTER%",
    "upstream": "%UPSTREAM_HOST%",
    "destination": f"%REQ({DESTINATION_HEADER})%",
    "session": "%REQ(x-claude-code-session-id)%",
    "request_id": "%RESP(request-id)%",
    "duration_ms": "%DURATION%",
}


def _socket_address(address: str) -> dict[str, Any]:
    host, port = split_host_port(address)
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _static_cluster(name: str, addresses: Sequence[str], connect_timeout_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": _seconds(connect_timeout_s),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(a)}} for a in addresses]}],
        },
    }


def _health_check(interval_s: float, timeout_s: float, check: dict[str, Any]) -> dict[str, Any]:
    """Two failed checks in a row mark a host down (one slow answer on a busy machine does not), one passed check up
    again; an idle cluster is checked as often as a busy one."""
    return {
        "timeout": _seconds(max(timeout_s, interval_s)),
        "interval": _seconds(interval_s),
        "no_traffic_interval": _seconds(interval_s),
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
        **check,
    }


def _circuit_breakers() -> dict[str, Any]:
    limit = CIRCUIT_BREAKER_LIMIT
    return {"thresholds": [{"max_connections": limit, "max_pending_requests": limit, "max_requests": limit}]}


def _ext_proc_filter(fail_open: bool, message_timeout_s: float) -> dict[str, Any]:
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",  # required with FULL_DUPLEX_STREAMED: tells the EPP the body ended
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
            "failure_mode_allow": fail_open,
            "status_on_error": {"code": FAIL_CLOSED_STATUS},
            # Each message's wait for the EPP's answer (not enforced on a FULL_DUPLEX_STREAMED body in Envoy
            # 1.40: the EPP cluster's HTTP/2 pings are what bound a hung EPP).
            "message_timeout": _seconds(message_timeout_s),
            "route_cache_action": "CLEAR",
        },
    }


def _routes(fail_open: bool, retry_on: str) -> list[dict[str, Any]]:
    chosen = {
        "match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
        "route": {"cluster": DESTINATION_CLUSTER, "timeout": "0s"},
    }
    if not fail_open:
        unchosen = {
            "match": {"prefix": "/"},
            "direct_response": {"status": FAIL_CLOSED_STATUS, "body": {"inline_string": "no endpoint was chosen\n"}},
        }
        return [chosen, unchosen]
    round_robin = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": NODES_CLUSTER,
            "timeout": "0s",
            # Only failures before any byte went upstream: a request a gateway has begun is never run twice.
            "retry_policy": {
                "retry_on": retry_on,
                "num_retries": 1,
                "retry_host_predicate": [
                    {
                        "name": "envoy.retry_host_predicates.previous_hosts",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3"
                            ".PreviousHostsPredicate"
                        },
                    }
                ],
            },
        },
    }
    return [chosen, round_robin]


def envoy_bootstrap(
    listen: str,
    epp: str,
    gateways: Sequence[str],
    fail_open: bool,
    admin: str = "127.0.0.1:9901",
    message_timeout_s: float = 10.0,
    connect_timeout_s: float = 1.0,
    stream_idle_timeout_s: float = 3600.0,
    health_check_interval_s: float = 1.0,
    access_log_path: str | None = "/dev/stdout",
) -> dict[str, Any]:
    """Envoy's bootstrap for a listener at `listen` (host:port) in front of the node gateways `gateways`
    (host:port each) with the EPP's ext_proc gRPC server at `epp` (host:port). `fail_open`: when the EPP is down
    or silent past `message_timeout_s`, requests go round robin over the gateways instead of getting 503.
    `admin` (host:port) must be a loopback address: Envoy's admin interface can stop it and change its state.
    `access_log_path`: where the JSON access log goes (None: none)."""
    if not gateways:
        raise ValueError("Envoy needs at least one node gateway to send requests to")
    admin_host, _ = split_host_port(admin)
    if not is_loopback(admin_host):
        raise ValueError(f"Envoy's admin address must be loopback, not {admin!r}: anyone reaching it controls Envoy")
    retry_on = "connect-failure,refused-stream,reset-before-request"
    connection_manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "kvserve",
        "codec_type": "AUTO",
        "stream_idle_timeout": _seconds(stream_idle_timeout_s),
        "request_timeout": "0s",  # the gateway bounds how long a body may take (request_read_timeout_secs)
        "route_config": {
            "name": "kvserve",
            "virtual_hosts": [{"name": "kvserve", "domains": ["*"], "routes": _routes(fail_open, retry_on)}],
        },
        # The destination is the EPP's to name: a client's own header would pick any address Envoy can reach
        # whenever the EPP is bypassed (fail-open) or names none. Removed before any filter or route match (an
        # HTTP filter removing it would leave the route already matched on it).
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3"
                    ".HeaderMutation",
                    "mutations": [{"remove": DESTINATION_HEADER}],
                },
            }
        ],
        "http_filters": [
            _ext_proc_filter(fail_open, message_timeout_s),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                    "suppress_envoy_headers": True,
                },
            },
        ],
    }
    if access_log_path is not None:
        connection_manager["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": access_log_path,
                    "log_format": {"json_format": ACCESS_LOG_FIELDS},
                },
            }
        ]
    epp_cluster = _static_cluster(EPP_CLUSTER, [epp], connect_timeout_s)
    epp_cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            # HTTP/2 pings on the connection to the EPP: a hung EPP (its socket still taking bytes) answers none,
            # and the connection, with the requests streaming on it, is closed (then failed open or closed)
            "explicit_http_config": {
                "http2_protocol_options": {"connection_keepalive": {"interval": "1s", "timeout": "2s"}}
            },
        }
    }
    epp_cluster["health_checks"] = [
        _health_check(health_check_interval_s, 1.0, {"grpc_health_check": {"service_name": EXT_PROC_SERVICE}})
    ]
    if fail_open:
        # An EPP that is down must be known before a stream opens (see the module's docstring): ejected on its
        # first refused connection, and no panic routing to it while it is ejected or failing its health checks.
        # Fail-closed keeps Envoy's defaults: sending to a doubtful EPP anyway fails no request that skipping it
        # would not.
        epp_cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
        epp_cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "interval": _seconds(health_check_interval_s),
            "base_ejection_time": _seconds(health_check_interval_s),
            "max_ejection_time": _seconds(max(10 * health_check_interval_s, 1.0)),
            "max_ejection_percent": 100,
        }
    destination_cluster = {
        "name": DESTINATION_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _seconds(connect_timeout_s),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        "circuit_breakers": _circuit_breakers(),
    }
    nodes_cluster = _static_cluster(NODES_CLUSTER, gateways, connect_timeout_s)
    nodes_cluster["lb_policy"] = "ROUND_ROBIN"
    nodes_cluster["circuit_breakers"] = _circuit_breakers()
    nodes_cluster["health_checks"] = [
        _health_check(health_check_interval_s, 2.0, {"http_health_check": {"path": "/ready"}})
    ]
    return {
        "admin": {"address": _socket_address(admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "kvserve",
                    "address": _socket_address(listen),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": connection_manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [epp_cluster, destination_cluster, nodes_cluster],
        },
    }
