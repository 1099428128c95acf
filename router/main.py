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

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts import service_main
from contracts.config import KvServeConfig
from contracts.internal_auth import InternalAuthError
from contracts.metrics_http import serve_metrics
from protos import router_pb2, router_pb2_grpc
from router.durable_state import DurableState
from router.event_feeds import EventFeeds
from router.metrics import router_registry
from router.redis_password import RedisPasswordError, redis_url_with_password
from router.route_score import RoutePolicy
from router.router_state import RouterState
from router.servicer import RouterServicer

log = logging.getLogger("router")

SHUTDOWN_GRACE_S = 2.0
REDIS_LOAD_TIMEOUT_S = 10.0
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
# A Route for a 1M-token prompt carries ~1.1 MB of hashes.
SERVER_OPTIONS = [*service_main.SERVER_OPTIONS, ("grpc.max_receive_message_length", 64 * 1024 * 1024)]


def build_parser() -> argparse.ArgumentParser:
    return service_main.service_arg_parser(
        "kvserve router", "Run the router as a gRPC server.", "router_host", "router_port"
    )


def config_from_args(args: argparse.Namespace) -> KvServeConfig:
    return service_main.config_with_overrides(args.config, {"router_host": args.host, "router_port": args.port})


def build_state(config: KvServeConfig) -> RouterState:
    policy = RoutePolicy(
        l1_restore_cost=config.scheduling.l1_restore_cost,
        overload_prefill_tokens=config.overload_prefill_tokens,
        warm_prefix_fraction=config.scheduling.warm_prefix_fraction,  # what the ranks' schedulers call warm
    )
    return RouterState(policy, config.session_ttl_secs, config.rank_down_after_secs)


async def sweep_forever(state: RouterState, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        state.sweep()


async def serve(config: KvServeConfig) -> int:
    address = service_main.listen_address(config.router_host, config.router_port)
    state = build_state(config)
    feeds = EventFeeds(state, config.rank_down_after_secs)
    try:
        server = service_main.internal_server(config, config.router_host, "router", SERVER_OPTIONS)
        redis_url = redis_url_with_password(config.redis_url, config.redis_password_file)
    except (InternalAuthError, RedisPasswordError) as exc:
        log.error("%s", exc)
        return 2
    durable = DurableState(state, redis_url)
    state.follower, state.durable = feeds, durable

    health_servicer = health.aio.HealthServicer()
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(state, durable), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        log.error("cannot listen on %s: %s", address, exc)
        return 1
    address = service_main.listen_address(config.router_host, port)
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
    metrics_server = serve_metrics(
        router_registry(state, durable), config.metrics_host or config.router_host, config.router_metrics_port, "router"
    )
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
    if metrics_server is not None:
        metrics_server.stop()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return service_main.run_service(build_parser().parse_args(argv), config_from_args, serve, log)


if __name__ == "__main__":
    sys.exit(main())
