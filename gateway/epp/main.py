"""The EPP process: `python -m gateway.epp --fleet FLEET.yaml` (also `kvserve epp --fleet FLEET.yaml`).

It serves Envoy's ExternalProcessor and grpc.health.v1 on `listen` (and health alone on `health_listen`, for
Kubernetes' gRPC probes), its /metrics on `metrics_listen`, and keeps, for every node of the fleet file, a poller
of its readiness and load and a subscriber per KV event publisher. Liveness is the health service "" (SERVING
while the process runs); readiness is the ext_proc service's name, SERVING while at least one node is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence

import grpc
import httpx
import yaml
import zmq.asyncio
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from contracts.address import split_host_port
from contracts.metrics_http import serve_metrics
from contracts.service_main import SERVER_OPTIONS, client_target, listen_address
from gateway.epp.envoy_config import envoy_bootstrap
from gateway.epp.ext_proc import ExtProcServicer
from gateway.epp.fleet_config import FleetConfig, load_fleet
from gateway.epp.fleet_index import FleetIndex
from gateway.epp.kv_event_subscriber import KvEventSubscriber
from gateway.epp.metrics import EppMetrics
from gateway.epp.node_state import NodePoller, NodeState, resolved
from gateway.epp.picker import Decision, Picker

log = logging.getLogger("gateway.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _bind(server: grpc.aio.Server, address: str) -> None:
    host, port = split_host_port(address)
    if not server.add_insecure_port(listen_address(host, port)):
        raise OSError(f"cannot listen on {address}")


class Epp:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.index = FleetIndex()
        self.nodes = [NodeState(spec) for spec in config.nodes]
        self.picker = Picker(config, self.nodes, self.index)
        self.zmq = zmq.asyncio.Context()
        self.subscribers = [
            KvEventSubscriber(self.zmq, source, node.name, self.index)
            for node in config.nodes
            for source in node.kv_events
        ]
        self.metrics = EppMetrics(self)
        self.health = health_aio.HealthServicer()

    def on_decision(self, decision: Decision | None, outcome: str, seconds: float) -> None:
        self.metrics.decided(decision, outcome, seconds)
        if decision is None:
            log.info("epp refused status=%s in %.1f ms", outcome, seconds * 1e3)
            return
        choice = decision.choice
        log.info(
            "epp chose node=%s reason=%s session=%s prompt_tokens=%d cached_tokens=%d new_prefill=%d in %.1f ms",
            decision.node.name,
            choice.reason,
            decision.session or "-",
            decision.prompt_tokens,
            decision.cached_tokens,
            choice.new_prefill_tokens,
            seconds * 1e3,
        )

    async def serve(self) -> int:
        servers = [grpc.aio.server(options=SERVER_OPTIONS)]
        ep_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcServicer(self.picker, self.config.max_body_bytes, self.on_decision), servers[0]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, servers[0])
        _bind(servers[0], self.config.listen)
        if self.config.health_listen:
            servers.append(grpc.aio.server(options=SERVER_OPTIONS))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, servers[1])
            _bind(servers[1], self.config.health_listen)
        metrics_server = None
        if self.config.metrics_listen:
            host, port = split_host_port(self.config.metrics_listen)
            metrics_server = serve_metrics(self.metrics.registry, host, port, "epp")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        for server in servers:
            await server.start()
        log.info(
            "epp serving ext_proc on %s for %d nodes (policy %s)",
            self.config.listen,
            len(self.nodes),
            self.config.policy,
        )
        timeout = httpx.Timeout(self.config.node_timeout_secs)
        api_key = self.config.node_api_key()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            tasks = [
                asyncio.create_task(
                    NodePoller(node, client, self.config.refresh_secs, api_key, self._resync(node.name)).run()
                )
                for node in self.nodes
            ]
            tasks += [asyncio.create_task(subscriber.run()) for subscriber in self.subscribers]
            tasks.append(asyncio.create_task(self._readiness()))
            await stop.wait()
            log.info("epp stopping")
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for server in servers:
            await server.stop(grace=2.0)
        if metrics_server is not None:
            metrics_server.stop()
        self.zmq.term()
        return 0

    def _resync(self, node: str) -> Callable[[], None]:
        def resync() -> None:
            for subscriber in self.subscribers:
                if subscriber.node == node:
                    subscriber.resync()

        return resync

    async def _readiness(self) -> None:
        serving = None
        while True:
            ready = any(node.ready for node in self.nodes)
            if ready != serving:
                status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
                await self.health.set(EXT_PROC_SERVICE, status)
                log.info("epp %s", "ready: a node is ready" if ready else "not ready: no node is ready")
                serving = ready
            await asyncio.sleep(self.config.refresh_secs / 2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve epp", description="the fleet's endpoint picker: Envoy's ext_proc server choosing a node"
    )
    parser.add_argument("--fleet", required=True, help="the fleet file (YAML: listen addresses, policy, nodes)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    envoy = parser.add_argument_group("an Envoy in front of it (print its bootstrap and exit)")
    envoy.add_argument("--envoy-config", action="store_true", help="print Envoy's bootstrap YAML for this fleet")
    envoy.add_argument("--envoy-listen", default="0.0.0.0:8080", help="where Envoy takes the clients' requests")
    envoy.add_argument("--envoy-admin", default="127.0.0.1:9901", help="Envoy's admin address (loopback only)")
    envoy.add_argument(
        "--fail-closed", action="store_true", help="with the EPP down, answer 503 (default: round robin over nodes)"
    )
    return parser


def envoy_yaml(config: FleetConfig, listen: str, admin: str, fail_open: bool) -> str:
    """Envoy's bootstrap for this fleet: the EPP at its listen address (a wildcard bind: this host), the node
    gateways resolved to addresses (Envoy's static round-robin cluster takes addresses)."""
    host, port = split_host_port(config.listen)
    gateways = [asyncio.run(resolved(node.endpoint)) for node in config.nodes]
    bootstrap = envoy_bootstrap(listen, client_target(host, port), gateways, fail_open, admin=admin)
    return yaml.safe_dump(bootstrap, sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        config = load_fleet(args.fleet)
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        log.error("bad fleet file: %s", exc)
        return 2
    if args.envoy_config:
        try:
            print(envoy_yaml(config, args.envoy_listen, args.envoy_admin, not args.fail_closed), end="")
        except (OSError, ValueError) as exc:
            log.error("cannot render Envoy's bootstrap: %s", exc)
            return 2
        return 0
    try:
        return asyncio.run(Epp(config).serve())
    except OSError as exc:
        log.error("%s", exc)
        return 1
