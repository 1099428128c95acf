"""/metrics over HTTP for the gRPC services (router, kvstore, rank workers): each keeps one CollectorRegistry of
its own and serves it with prometheus_client's HTTP server, on a daemon thread, at its `*_metrics_port` (0: off).
A scrape reads counters the service keeps anyway (the engine's stats snapshot, plain integers): it never waits
for, or runs code on, a rank's engine thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from contracts.service_main import client_target

log = logging.getLogger(__name__)


@dataclass
class MetricsServer:
    """A running /metrics server; stop() closes its socket."""

    port: int
    _server: Any

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int, service: str) -> MetricsServer | None:
    """Serve `registry` at http://host:port/metrics; None when port is 0 (off) or the port cannot be bound (the
    service runs on without metrics: a metrics port is never a reason to stop serving)."""
    if not port:
        return None
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.error(
            "%s: cannot serve /metrics on %s: %s; running without metrics", service, client_target(host, port), exc
        )
        return None
    bound = int(server.server_address[1])
    log.info("%s: Prometheus /metrics on http://%s/metrics", service, client_target(host, bound))
    return MetricsServer(bound, server)
