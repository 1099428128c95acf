"""Start the kvstore: read the config, bind the port, create the arena, serve until SIGTERM/SIGINT.

The port is bound first (a conflict fails at once) and health answers NOT_SERVING while the arena's RAM
is being reserved (seconds for tens of GB), SERVING once the arena exists. The arena file is deleted on
every way out we control; one left by a SIGKILL is removed by the next start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts import service_main
from contracts.config import KvServeConfig
from contracts.internal_auth import InternalAuthError
from contracts.metrics_http import serve_metrics
from contracts.vllm_kv_events import MEDIUM_CPU, publisher_from_config
from kvstore.arena import Arena, ArenaError, create_arena, ensure_arena_dir, remove_stale_arenas
from kvstore.l1_store import ArenaInfo, L1Store
from kvstore.metrics import kvstore_registry
from kvstore.ram_budget import RamBudget, format_bytes, plan_ram_budget, read_machine
from kvstore.servicer import KvStoreServicer
from protos import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger("kvstore")

SHUTDOWN_GRACE_S = 2.0
SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KvStore"].full_name
# Ranks and the router keep long-lived channels to it.
SERVER_OPTIONS = service_main.SERVER_OPTIONS


def build_parser() -> argparse.ArgumentParser:
    return service_main.service_arg_parser(
        "kvserve kvstore", "Run the node's L1 KV cache (gRPC).", "kvstore_host", "kvstore_port"
    )


def config_from_args(args: argparse.Namespace) -> KvServeConfig:
    return service_main.config_with_overrides(args.config, {"kvstore_host": args.host, "kvstore_port": args.port})


@dataclass(frozen=True)
class PreparedArena:
    arena: Arena
    budget: RamBudget
    reason: str  # every reason the arena is smaller than l1_host_gb, for the log and Stats


def prepare_arena(config: KvServeConfig) -> PreparedArena:
    """Make the arena dir if missing, remove stale arenas of ours, size the budget from the machine, create
    and reserve the arena."""
    if ensure_arena_dir(config.l1_arena_dir):
        log.info("created the arena dir %s (mode 0700)", config.l1_arena_dir)
    for path in remove_stale_arenas(config.l1_arena_dir):
        log.info("removed a stale arena left by a killed kvstore: %s", path)
    readings = read_machine(config.l1_arena_dir)
    budget = plan_ram_budget(config.l1_host_gb, config.l1_headroom_gb, readings, config.l1_arena_dir)
    if budget.granted_bytes <= 0:
        raise ArenaError(f"no RAM for the L1 arena: {budget.describe()}")
    arena = create_arena(config.l1_arena_dir, budget.granted_bytes)
    reason = "; ".join(text for text in (budget.reason, arena.lowered_reason) if text)
    return PreparedArena(arena, budget, reason)


async def sweep_pins(store: L1Store, interval_s: float) -> None:
    """Drop pins of copiers that died or forgot to release, every interval_s."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            dropped = store.expire_pins()
        except Exception:  # a bug here must not end the sweeping for the rest of the process's life
            log.exception("sweeping expired pins failed")
            continue
        if dropped:
            log.warning("dropped %d pins older than l1_pin_ttl_secs (a copier died or never released)", dropped)


async def serve(config: KvServeConfig) -> int:
    address = service_main.listen_address(config.kvstore_host, config.kvstore_port)
    health_servicer = health.aio.HealthServicer()
    servicer = KvStoreServicer()
    try:
        server = service_main.internal_server(config, config.kvstore_host, "kvstore", SERVER_OPTIONS)
    except InternalAuthError as exc:
        log.error("%s", exc)
        return 2
    kvstore_pb2_grpc.add_KvStoreServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        log.error("cannot listen on %s: %s", address, exc)
        return 1
    address = service_main.listen_address(config.kvstore_host, port)
    await server.start()
    log.info("listening on %s; creating the arena in %s", address, config.l1_arena_dir)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    # Reserving tens of GB takes seconds: in a thread, so health keeps answering NOT_SERVING meanwhile.
    creating = asyncio.ensure_future(asyncio.to_thread(prepare_arena, config))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({creating, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not creating.done():
        log.info("stop requested while creating the arena; waiting for it, then removing it")
        await server.stop(0)
        with contextlib.suppress(Exception):
            (await creating).arena.remove()
        return 0
    stopped.cancel()
    error = creating.exception()
    if error is not None:
        if isinstance(error, ArenaError | OSError):
            log.error("cannot create the L1 arena in %s: %s", config.l1_arena_dir, error)
        else:
            log.error("cannot create the L1 arena", exc_info=error)
        await server.stop(0)
        return 1

    prepared: PreparedArena = creating.result()
    arena = prepared.arena
    try:
        store = L1Store(
            ArenaInfo(arena.arena_id, str(arena.path), arena.size_bytes),
            config.l1_pin_ttl_secs,
            evict_restored_first=config.l1_evict_restored_first,
            evict_written_through_first=config.l1_evict_written_through_first,
        )
        try:  # the kvstore knows no token ids: its BlockStored events carry hashes alone (docs/architecture.md)
            vllm_events = publisher_from_config(config, MEDIUM_CPU, config.engine.block_size, kvstore=True)
        except (ValueError, OSError) as exc:  # a malformed endpoint, a port taken
            log.error("cannot publish KV events in vLLM's format: %s", exc)
            await server.stop(0)
            return 1
        if vllm_events is not None:
            store.kv_event_sink = vllm_events.publish
        servicer.open(store, prepared.budget.requested_bytes, prepared.reason)
        sweeper = asyncio.ensure_future(sweep_pins(store, sweep_interval_s(config.l1_pin_ttl_secs)))
        metrics_server = serve_metrics(
            kvstore_registry(store), config.metrics_host or config.kvstore_host, config.kvstore_metrics_port, "kvstore"
        )
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "ready on %s: arena %s, %s (requested %s; %s)",
            address,
            arena.path,
            format_bytes(arena.size_bytes),
            format_bytes(prepared.budget.requested_bytes),
            prepared.reason or "granted in full",
        )

        await stop.wait()
        log.info("stopping")
        sweeper.cancel()
        await health_servicer.enter_graceful_shutdown()
        store.feed.close()  # KvEvents streams end cleanly instead of being cancelled
        if vllm_events is not None:
            vllm_events.close()
        await server.stop(SHUTDOWN_GRACE_S)
        if metrics_server is not None:
            metrics_server.stop()
    finally:
        arena.remove()
    log.info("stopped; removed %s", arena.path)
    return 0


def sweep_interval_s(pin_ttl_s: float) -> float:
    """Often enough that a dead pin outlives its TTL by at most a quarter of it (and at most 10 s)."""
    return min(max(pin_ttl_s / 4, 0.1), 10.0)


def l1_disabled(config: KvServeConfig) -> bool:
    if config.l1_cache and config.l1_host_gb > 0:
        return False
    log.error(
        "L1 disabled (l1_cache=%s, l1_host_gb=%g): the kvstore has nothing to serve; "
        "enable l1_cache and set l1_host_gb > 0 to run it",
        config.l1_cache,
        config.l1_host_gb,
    )
    return True


async def serve_if_enabled(config: KvServeConfig) -> int:
    return 2 if l1_disabled(config) else await serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    return service_main.run_service(build_parser().parse_args(argv), config_from_args, serve_if_enabled, log)


if __name__ == "__main__":
    sys.exit(main())
