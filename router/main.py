"""Start the router: read the config, bind, restore state from Redis, follow the ranks' and kvstore's KV
events, serve until SIGTERM/SIGINT.

Health is SERVING once the Redis read-back was tried, whether or not Redis answered: without Redis the
router routes from memory and writes its state back when Redis returns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts.config import KvServeConfig, load_config
from protos import router_pb2, router_pb2_grpc
from router.durable_state import DurableState
from router.event_feeds import EventFeeds
from router.route_score import RoutePolicy
from router.router_state import RouterState
from router.servicer import RouterServicer

log = logging.getLogger("router")

SHUTDOWN_GRACE_S = 2.0
REDIS_LOAD_TIMEOUT_S = 10.0
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second router on the same port must fail, not silently share it
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),  # a Route for a 1M-token prompt: ~1.1 MB of hashes
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve router", description="Run the router as a gRPC server.")
    parser.add_argument("--config", help="YAML config file (default: $KVSERVE_CONFIG, then defaults)")
    parser.add_argument("--host", help="bind address (overrides router_host)")
    parser.add_argument("--port", type=int, help="port (overrides router_port)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG (one line per route decision), INFO, ...")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> KvServeConfig:
    overrides = {
        key: value for key, value in (("router_host", args.host), ("router_port", args.port)) if value is not None
    }
    return load_config(args.config, **overrides)


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def build_state(config: KvServeConfig) -> RouterState:
    policy = RoutePolicy(l1_restore_cost=config.l1_restore_cost, overload_prefill_tokens=config.overload_prefill_tokens)
    return RouterState(policy, config.session_ttl_secs, config.rank_down_after_secs)


async def sweep_forever(state: RouterState, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        state.sweep()


async def serve(config: KvServeConfig) -> int:
    address = listen_address(config.router_host, config.router_port)
    state = build_state(config)
    feeds = EventFeeds(state, config.rank_down_after_secs)
    durable = DurableState(state, config.redis_url)
    state.follower, state.durable = feeds, durable

    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(state, durable), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        log.error("cannot listen on %s: %s", address, exc)
        return 1
    address = listen_address(config.router_host, port)
    await server.start()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    try:
        await asyncio.wait_for(durable.start(), REDIS_LOAD_TIMEOUT_S)
    except TimeoutError:
        log.error("reading state back from Redis took over %.0fs; starting from memory", REDIS_LOAD_TIMEOUT_S)
    feeds.follow_kvstore(config.kvstore)
    sweep_s = max(min(config.heartbeat_interval_secs, config.rank_down_after_secs / 4, 1.0), 0.05)
    background = [
        asyncio.ensure_future(durable.run()),
        asyncio.ensure_future(sweep_forever(state, sweep_s)),
    ]
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "ready on %s: %d ranks known, %d sessions, Redis %s, kvstore %s",
        address,
        len(state.registry),
        len(state.sessions),
        "connected" if durable.connected else "DOWN",
        config.kvstore or "(none: no L1)",
    )

    await stop.wait()
    log.info("stopping")
    await health_servicer.enter_graceful_shutdown()
    await server.stop(SHUTDOWN_GRACE_S)
    for task in background:
        task.cancel()
    for task in background:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await feeds.close()
    await durable.close()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        config = config_from_args(args)
    except (FileNotFoundError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        log.error("bad configuration: %s", exc)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
