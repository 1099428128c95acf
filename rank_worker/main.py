"""Start one rank worker: read the config, bind the port, load the engine, serve until SIGTERM/SIGINT.

The port is bound before the model loads, so a port conflict fails in a second rather than after a
long load, and the health service answers NOT_SERVING while loading, SERVING once the engine is ready.
With a kvstore configured (and l1_cache on) the engine gets the L1 host tier; with a router configured,
the rank registers once ready and heartbeats its load. Neither being away stops the rank from serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import uuid
from collections.abc import Sequence

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts import service_main
from contracts.config import EngineConfig, KvServeConfig
from contracts.internal_auth import InternalAuthError
from contracts.metrics_http import serve_metrics
from contracts.vllm_kv_events import MEDIUM_GPU, publisher_from_config
from protos import rank_worker_pb2, rank_worker_pb2_grpc
from rank_worker.engine.interface import Engine, EngineStats, ModelInfo
from rank_worker.engine_loop import EngineLoop
from rank_worker.l1.kvstore_client import KvStoreClient
from rank_worker.l1.kvstore_link import KvStoreLink
from rank_worker.metrics import L1Copies, RankMetrics
from rank_worker.model_files.source import ModelPathError
from rank_worker.router_link import RankIdentity, RouterLink, advertise_address
from rank_worker.servicer import RankWorkerServicer

log = logging.getLogger("rank_worker")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # ModelInfo carries the whole tokenizer json (~2 MB for SmolLM2)
SHUTDOWN_GRACE_S = 5.0
SERVICE_NAME = rank_worker_pb2.DESCRIPTOR.services_by_name["RankWorker"].full_name
# ModelInfo carries the whole tokenizer json; the gateway's keepalive pings notice a dead rank (a server
# that refused them would drop every stream on the connection, long prefills included).
SERVER_OPTIONS = [
    *service_main.SERVER_OPTIONS,
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = service_main.service_arg_parser(
        "kvserve rank-worker", "Run one engine rank as a gRPC server.", "rank_worker_host", "rank_worker_port"
    )
    parser.add_argument("--model", help="model path (overrides model; empty = embedded SmolLM2-135M)")
    parser.add_argument("--rank-id", help="this rank's name (overrides rank_id; default rank-<port>)")
    parser.add_argument("--kvstore", help="kvstore host:port for the L1 host cache (overrides kvstore)")
    parser.add_argument("--router", help="router host:port to register with (overrides router)")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> KvServeConfig:
    overrides = {
        "rank_worker_host": args.host,
        "rank_worker_port": args.port,
        "model": args.model,
        "rank_id": args.rank_id,
        "kvstore": args.kvstore,
        "router": args.router,
    }
    return service_main.config_with_overrides(args.config, overrides)


def build_engine(config: KvServeConfig, l1_client: KvStoreClient | None = None) -> Engine:
    """The engine; in an expert-parallel group (expert_parallel_size > 1) the group is formed first (its ranks
    meet at the rendezvous, so this rank is not ready before its group is), then its shard of the model loads."""
    # Imported here so `--help` and config errors do not pay for importing torch and the model code.
    from rank_worker.engine.factory import build_engine as factory_build_engine
    from rank_worker.engine.factory import resolve_device
    from rank_worker.expert_parallel.group import ExpertGroup, settings_from_config

    settings = settings_from_config(config)
    group = None
    if settings is not None:
        log.info(
            "joining expert-parallel group %s as rank %d of %d at %s",
            settings.name,
            settings.rank,
            settings.size,
            settings.rendezvous,
        )
        group = ExpertGroup.form(settings, resolve_device(config.device))
    return factory_build_engine(config, l1_client, group)


def apply_gil_switch_interval(config: KvServeConfig) -> None:
    """How long the engine thread may wait for the GIL the gRPC threads hold (contracts/config.py says why)."""
    if config.gil_switch_interval_ms is not None:
        sys.setswitchinterval(config.gil_switch_interval_ms / 1000.0)
        log.info("GIL switch interval %.2f ms", config.gil_switch_interval_ms)


async def serve(config: KvServeConfig) -> int:
    apply_gil_switch_interval(config)
    address = service_main.listen_address(config.rank_worker_host, config.rank_worker_port)
    health_servicer = health.aio.HealthServicer()
    servicer = RankWorkerServicer(config.max_waiting_requests)
    try:
        server = service_main.internal_server(config, config.rank_worker_host, "rank worker", SERVER_OPTIONS)
    except InternalAuthError as exc:
        log.error("%s", exc)
        return 2
    rank_worker_pb2_grpc.add_RankWorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        log.error("cannot listen on %s: %s", address, exc)
        return 1
    address = service_main.listen_address(config.rank_worker_host, port)  # the real port when 0 asked for any free one
    await server.start()
    rank_id = config.rank_id or f"rank-{port}"
    incarnation = uuid.uuid4().hex
    log.info("listening on %s as %s; loading model %r", address, rank_id, config.model or "(embedded SmolLM2-135M)")
    l1_client = None
    if config.l1_cache and config.kvstore:
        l1_client = KvStoreLink(config.kvstore, rank_id, incarnation)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    # The load runs in a thread so the health service keeps answering (NOT_SERVING) meanwhile.
    load = asyncio.ensure_future(asyncio.to_thread(build_engine, config, l1_client))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not load.done():
        log.info("stop requested while loading; waiting for the load thread to finish, then exiting")
        await server.stop(0)
        await asyncio.gather(load, return_exceptions=True)
        return 0
    stopped.cancel()
    error = load.exception()
    if error is not None:
        if isinstance(error, ModelPathError | ValueError):  # a bad path or setting: the message says it all
            log.error("failed to load the engine: %s", error)
        else:
            log.error("failed to load the engine", exc_info=error)
        await server.stop(0)
        return 1

    engine: Engine = load.result()
    try:
        vllm_events = publisher_from_config(config, MEDIUM_GPU, engine.model_info.block_size)
    except (ValueError, OSError) as exc:  # a malformed endpoint, a port taken
        log.error("cannot publish KV events in vLLM's format: %s", exc)
        await server.stop(0)
        engine.close()
        return 1
    engine_loop = EngineLoop(
        engine,
        max_step_s=config.rank_max_step_secs,
        kv_event_sink=vllm_events.publish if vllm_events is not None else None,
    )
    engine_loop.start()
    metrics = RankMetrics(engine.model_info.served_model_name, rank_id, engine_loop.stats, lambda: l1_copies(engine))
    metrics_server = serve_metrics(
        metrics.registry, config.metrics_host or config.rank_worker_host, config.rank_worker_metrics_port, rank_id
    )
    servicer.attach(engine_loop, engine.model_info, rank_id, metrics)
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    _log_ready(engine.model_info, engine_loop.stats(), config.engine, address)
    _log_l1(config, engine_loop.stats())
    router_link = None
    if config.router:
        info = engine.model_info
        identity = RankIdentity(
            rank_id=rank_id,
            address=advertise_address(config.rank_advertise_address, config.rank_worker_host, port),
            incarnation=incarnation,
            block_size=info.block_size,
            hash_namespace=info.hash_namespace,
            expert_parallel_group=_group_name(config),
            expert_parallel_rank=config.expert_parallel_rank if config.expert_parallel_size > 1 else 0,
            expert_parallel_size=config.expert_parallel_size,
        )
        router_link = RouterLink(config.router, identity, engine_loop.stats, config.heartbeat_interval_secs)
        router_link.start()

    await stop.wait()
    log.info("stopping: refusing new calls, %d requests in flight", engine_loop.in_flight())
    lockstep = getattr(engine, "lockstep", None)
    if lockstep is not None:
        lockstep.group.stop_watching()  # its peers stop too: one leaving first is no broken group
    if router_link is not None:
        await router_link.stop()  # the router notices within rank_down_after_secs
    await health_servicer.enter_graceful_shutdown()
    engine_loop.end_kv_event_subscriptions()  # event streams never end on their own; token streams get the grace
    await server.stop(SHUTDOWN_GRACE_S)  # in-flight streams get the grace period, then are cancelled
    engine_loop.stop()
    if vllm_events is not None:
        vllm_events.close()  # after the loop's last batch
    engine.close()
    if metrics_server is not None:
        metrics_server.stop()
    log.info("stopped")
    return 0


def l1_copies(engine: Engine) -> L1Copies | None:
    """The L1 tier's copy counters, read at scrape time (plain numbers the engine thread adds to)."""
    tier = getattr(engine, "l1", None)
    if tier is None:
        return None
    return L1Copies(
        *(
            getattr(tier, name, 0)
            for name in ("restored_bytes", "restore_seconds", "offloaded_bytes", "offload_seconds")
        )
    )


def _group_name(config: KvServeConfig) -> str:
    """The expert-parallel group the router is told of ("" for a rank on its own)."""
    if config.expert_parallel_size == 1:
        return ""
    return config.expert_parallel_group or f"ep@{config.expert_parallel_rendezvous}"


def _log_l1(config: KvServeConfig, stats: EngineStats) -> None:
    if not (config.l1_cache and config.kvstore):
        log.info("L1 host cache: off (%s)", "no kvstore configured" if not config.kvstore else "l1_cache is false")
    elif not config.engine.prefix_cache:
        log.info("L1 host cache: off (it needs prefix_cache)")
    elif stats.l1_attached:
        log.info("L1 host cache: attached to the kvstore at %s", config.kvstore)
    else:
        log.warning("L1 host cache: the kvstore at %s is not attached yet; serving from L0 meanwhile", config.kvstore)


def _log_ready(info: ModelInfo, stats: EngineStats, engine: EngineConfig, address: str) -> None:
    # the step's limits too: a benchmark's side by side must be able to show both sides ran the same budget
    log.info(
        "KV pool: %d blocks x %d tokens = %d tokens; max_model_len %d; max_num_batched_tokens %d, max_num_seqs %d",
        stats.total_blocks,
        stats.block_size,
        stats.total_blocks * stats.block_size,
        info.max_model_len,
        engine.max_num_batched_tokens,
        engine.max_num_seqs,
    )
    log.info("ready: serving %s (%s) on %s", info.served_model_name, info.model_id, address)


def main(argv: Sequence[str] | None = None) -> int:
    return service_main.run_service(parse_args(argv), config_from_args, serve, log)


if __name__ == "__main__":
    sys.exit(main())
