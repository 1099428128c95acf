"""The stack as data: every service kvserve runs, how it starts, how its health is checked, what it needs first.

`kvserve up` starts these specs as local processes and `kvserve compose` renders the same specs as
docker-compose services, so the local stack and the GPU node's compose file cannot describe different stacks.
Only addresses differ between the modes: local binds 127.0.0.1 on the configured (or free) ports; compose binds
0.0.0.0 inside an internal network and services find each other by their service name.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from contracts.config import KvServeConfig
from launcher.health import client_target
from launcher.health_check import HealthCheck

Mode = Literal["local", "compose"]
Role = Literal["redis", "kvstore", "router", "rank-worker", "gateway"]

RESTART_POLICY = "unless-stopped"
COMPOSE_CONFIG_PATH = "/etc/kvserve/config.yaml"
COMPOSE_REDIS_DIR = "/data"
COMPOSE_BIND = "0.0.0.0"
LOCAL_BIND = "127.0.0.1"
DEFAULT_REDIS_PORT = 6379
RANK_STARTUP_S = 600.0  # a large model loads for minutes; the compose start_period and `up --ready-timeout`


@dataclass(frozen=True)
class ServiceSpec:
    """One service of the stack, in terms both a local process launcher and docker compose understand."""

    name: str
    role: Role
    argv: tuple[str, ...]
    host: str  # the address it binds
    port: int
    address: str  # host:port other services use to reach it
    health: HealthCheck
    environment: dict[str, str] = field(default_factory=dict)
    depends_on: tuple[str, ...] = ()
    published: bool = False  # reachable from outside the stack (the gateway only)
    gpu: str | None = None  # the GPU it is pinned to (host device id), None on the CPU
    restart: str = RESTART_POLICY
    startup_s: float = 60.0  # how long it may take to become healthy
    reads_config: bool = True  # a kvserve service reading the shared config file (not redis)
    uses_arena: bool = False  # maps the kvstore's L1 arena (the kvstore and the rank workers)


@dataclass(frozen=True)
class StackPlan:
    """Where things live for one build: how to run python, the config file, the local state dir, the GPUs."""

    mode: Mode
    config_file: str | None = None  # local: absolute path handed to every service as KVSERVE_CONFIG
    python: str = "python"
    state_dir: Path = Path(".kvserve/run")
    gpu_ids: Sequence[str] = ()  # local: the GPUs to pin ranks to, one each; empty = CPU
    rank_startup_s: float = RANK_STARTUP_S


def free_port(host: str = LOCAL_BIND) -> int:
    """A port the OS reports free right now (for config ports set to 0)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_name(rank: int) -> str:
    return f"rank-worker-{rank}"


def build_topology(config: KvServeConfig, ranks: int, plan: StackPlan) -> list[ServiceSpec]:
    """The services of a stack with `ranks` rank workers, in start order: redis, kvstore, router, ranks, gateway."""
    if ranks < 1:
        raise ValueError("a stack needs at least one rank worker")
    compose = plan.mode == "compose"
    gpu_ids = [str(rank) for rank in range(ranks)] if compose else list(plan.gpu_ids)
    if gpu_ids and len(gpu_ids) < ranks:
        raise ValueError(f"{ranks} rank workers need {ranks} GPUs, one each; {len(gpu_ids)} visible: {gpu_ids}")

    internal_host = COMPOSE_BIND if compose else LOCAL_BIND  # internal services: loopback only when local

    def port(configured: int) -> int:
        return configured if compose or configured != 0 else free_port()

    def address(name: str, host: str, port: int) -> str:
        return f"{name}:{port}" if compose else client_target(host, port)

    def probe_target(host: str, port: int) -> str:
        # Compose runs the check inside the service's own container.
        return client_target(LOCAL_BIND if compose else host, port)

    base_env = {"KVSERVE_CONFIG": COMPOSE_CONFIG_PATH} if compose else {}
    if plan.config_file and not compose:
        base_env["KVSERVE_CONFIG"] = plan.config_file
    python_module = (plan.python, "-m")

    redis_url = urlsplit(config.redis_url)
    redis_port = port(redis_url.port if redis_url.port is not None else DEFAULT_REDIS_PORT)
    redis_host = internal_host
    redis_dir = COMPOSE_REDIS_DIR if compose else str(plan.state_dir / "redis")
    redis_address = address("redis", redis_host, redis_port)
    redis_argv = ["redis-server", "--port", str(redis_port), "--bind", redis_host, "--dir", redis_dir]
    redis_argv += ["--appendonly", "yes"]
    if compose:
        redis_argv += ["--protected-mode", "no"]  # no password; only the internal network reaches it
    redis = ServiceSpec(
        name="redis",
        role="redis",
        argv=tuple(redis_argv),
        host=redis_host,
        port=redis_port,
        address=redis_address,
        health=HealthCheck("redis", probe_target(redis_host, redis_port)),
        startup_s=30.0,
        reads_config=False,
    )

    kvstore_host, kvstore_port = internal_host, port(config.kvstore_port)
    kvstore_environment = dict(base_env)
    if not compose and not gpu_ids and config.num_kv_blocks is None:
        # The kvstore sizes its arena from the RAM available when it starts, before the ranks exist: on the
        # CPU their KV pools (kv_cache_memory_gb in all) come out of the same RAM, so it must leave that too.
        headroom = config.l1_headroom_gb + config.kv_cache_memory_gb
        kvstore_environment["KVSERVE_L1_HEADROOM_GB"] = f"{headroom:g}"
    kvstore = ServiceSpec(
        name="kvstore",
        role="kvstore",
        argv=(*python_module, "kvstore", "--host", kvstore_host, "--port", str(kvstore_port)),
        host=kvstore_host,
        port=kvstore_port,
        address=address("kvstore", kvstore_host, kvstore_port),
        health=HealthCheck("grpc", probe_target(kvstore_host, kvstore_port)),
        environment=kvstore_environment,
        uses_arena=True,
    )

    router_host, router_port = internal_host, port(config.router_port)
    redis_for_router = urlunsplit((redis_url.scheme or "redis", redis_address, redis_url.path or "/0", "", ""))
    router = ServiceSpec(
        name="router",
        role="router",
        argv=(*python_module, "router", "--host", router_host, "--port", str(router_port)),
        host=router_host,
        port=router_port,
        address=address("router", router_host, router_port),
        health=HealthCheck("grpc", probe_target(router_host, router_port)),
        environment={**base_env, "KVSERVE_REDIS_URL": redis_for_router, "KVSERVE_KVSTORE": kvstore.address},
        depends_on=("redis", "kvstore"),
    )

    rank_specs = [
        _rank_spec(rank, config, ranks, plan, gpu_ids, base_env, kvstore.address, router.address)
        for rank in range(ranks)
    ]

    gateway_host = COMPOSE_BIND if compose else config.gateway_host
    gateway_port = port(config.gateway_port)
    gateway_environment = {
        **base_env,
        "KVSERVE_ROUTER": router.address,
        # The gateway's own route list for when the router is away (a restart), in rank order.
        "KVSERVE_RANK_WORKERS": json.dumps([rank.address for rank in rank_specs]),
    }
    gateway = ServiceSpec(
        name="gateway",
        role="gateway",
        argv=(*python_module, "gateway", "--host", gateway_host, "--port", str(gateway_port)),
        host=gateway_host,
        port=gateway_port,
        address=address("gateway", gateway_host, gateway_port),
        health=HealthCheck("http", f"http://{probe_target(gateway_host, gateway_port)}/ready"),
        environment=gateway_environment,
        depends_on=("router", *(rank.name for rank in rank_specs)),
        published=True,
    )
    return [redis, kvstore, router, *rank_specs, gateway]


def _rank_spec(
    rank: int,
    config: KvServeConfig,
    ranks: int,
    plan: StackPlan,
    gpu_ids: list[str],
    base_env: dict[str, str],
    kvstore_address: str,
    router_address: str,
) -> ServiceSpec:
    compose = plan.mode == "compose"
    name = rank_name(rank)
    host = COMPOSE_BIND if compose else LOCAL_BIND
    if compose:
        port = config.rank_worker_port  # a container each: every rank listens on the same port
    elif config.rank_worker_port == 0:
        port = free_port()
    else:
        port = config.rank_worker_port + rank  # consecutive ports on one machine
    address = f"{name}:{port}" if compose else client_target(host, port)
    environment = {
        **base_env,
        "KVSERVE_KVSTORE": kvstore_address,
        "KVSERVE_ROUTER": router_address,
        "KVSERVE_RANK_ADVERTISE_ADDRESS": address,
    }
    gpu = gpu_ids[rank] if gpu_ids else None
    if gpu is not None:
        # A container given one GPU (device_ids) sees it as device 0; a local process sees them all.
        environment["CUDA_VISIBLE_DEVICES"] = "0" if compose else gpu
    elif ranks > 1 and config.num_kv_blocks is None:
        environment["KVSERVE_KV_CACHE_MEMORY_GB"] = f"{cpu_kv_cache_gb(config, ranks):g}"
    return ServiceSpec(
        name=name,
        role="rank-worker",
        argv=(plan.python, "-m", "rank_worker", "--host", host, "--port", str(port), "--rank-id", f"rank-{rank}"),
        host=host,
        port=port,
        address=address,
        health=HealthCheck("grpc", client_target(LOCAL_BIND if compose else host, port)),
        environment=environment,
        depends_on=("kvstore", "router"),
        gpu=gpu,
        startup_s=plan.rank_startup_s,
        uses_arena=True,
    )


def cpu_kv_cache_gb(config: KvServeConfig, ranks: int) -> float:
    """KV pool size of each CPU rank: kv_cache_memory_gb is the machine's budget, split between the ranks
    (N ranks each taking the whole budget would ask N times the RAM the operator planned for)."""
    return round(config.kv_cache_memory_gb / ranks, 3)


def start_tiers(specs: Sequence[ServiceSpec]) -> list[list[ServiceSpec]]:
    """The specs grouped by dependency depth: every service's dependencies are in earlier tiers, so a tier
    can start (and be waited on) at once. Stopping goes through the tiers in reverse."""
    by_name = {spec.name: spec for spec in specs}
    for spec in specs:
        unknown = [dep for dep in spec.depends_on if dep not in by_name]
        if unknown:
            raise ValueError(f"{spec.name} depends on unknown services {unknown}")
    placed: dict[str, int] = {}
    tiers: list[list[ServiceSpec]] = []
    while len(placed) < len(specs):
        tier = [spec for spec in specs if spec.name not in placed and all(dep in placed for dep in spec.depends_on)]
        if not tier:
            raise ValueError(f"dependency cycle among {sorted(set(by_name) - set(placed))}")
        for spec in tier:
            placed[spec.name] = len(tiers)
        tiers.append(tier)
    return tiers
