"""The stack as data: every service kvserve runs, how it starts, how its health is checked, what it needs first.

`kvserve up` starts these specs as local processes and `kvserve compose` renders the same specs as
docker-compose services, so the local stack and the GPU node's compose file cannot describe different stacks.
Only addresses differ between the modes: local binds 127.0.0.1 on the configured (or free) ports; compose binds
0.0.0.0 inside an internal network and services find each other by their service name. So do the secrets'
paths: the internal plane's shared secret (every kvserve service) and Redis's password (Redis and the router)
are files in the state dir locally and compose secrets under /run/secrets in compose.

With expert parallelism (groups of R consecutive ranks: 0..R-1, R..2R-1, ...) each rank is told its group's size,
its place in it, the group's name and the rendezvous where the group's first rank listens: a free loopback port
of its own locally, COMPOSE_RENDEZVOUS_PORT of the first rank's container in compose.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from contracts.address import split_host_port
from contracts.config import KvServeConfig
from contracts.expert_parallel import COMPOSE_RENDEZVOUS_PORT, group_first_rank, group_name
from contracts.service_main import client_target, listen_address
from launcher.health_check import HealthCheck

Mode = Literal["local", "compose"]
Role = Literal["redis", "kvstore", "router", "rank-worker", "gateway"]

RESTART_POLICY = "unless-stopped"
COMPOSE_CONFIG_PATH = "/etc/kvserve/config.yaml"
COMPOSE_REDIS_DIR = "/data"
COMPOSE_BIND = "0.0.0.0"
LOCAL_BIND = "127.0.0.1"
INTERNAL_SECRET = "kvserve_internal_secret"
REDIS_PASSWORD = "kvserve_redis_password"
LOCAL_SECRET_FILES = {INTERNAL_SECRET: "internal-secret", REDIS_PASSWORD: "redis-password"}  # in the state dir
LOCAL_REDIS_CONF = "redis-auth.conf"  # in the state dir: requirepass, so the password is not in redis's argv
COMPOSE_REDIS_CONF = "/tmp/redis-auth.conf"  # written inside the redis container at its start
DEFAULT_REDIS_PORT = 6379
MAX_PORT_PICKS = 100
COMPOSE_METRICS_PORT = 9464  # compose: the router's, kvstore's and each rank's /metrics, a container each
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
    secrets: tuple[str, ...] = ()  # the secrets it reads (INTERNAL_SECRET, REDIS_PASSWORD)
    entrypoint: tuple[str, ...] = ()  # compose only: what runs before argv (redis: writes its password config)
    group: str = ""  # the expert-parallel group it lives and dies with (rank workers); empty = none
    metrics_port: int = 0  # its Prometheus /metrics port on `host` (gRPC services; the gateway serves /metrics itself)


@dataclass(frozen=True)
class StackPlan:
    """Where things live for one build: how to run python, the config file, the local state dir, the GPUs."""

    mode: Mode
    config_file: str | None = None  # local: absolute path handed to every service as KVSERVE_CONFIG
    python: str = "python"
    state_dir: Path = Path(".kvserve/run")
    gpu_ids: Sequence[str] = ()  # local: the GPUs to pin ranks to, one each; empty = CPU
    compose_gpus: bool = True  # compose: rank i reserves GPU i (a GPU node); False = a CPU node, no GPU
    rank_startup_s: float = RANK_STARTUP_S


def local_secret_path(state_dir: Path, secret: str) -> Path:
    return state_dir / LOCAL_SECRET_FILES[secret]


def compose_secret_path(secret: str) -> str:
    return f"/run/secrets/{secret}"


def free_port(host: str = LOCAL_BIND) -> int:
    """A port the OS reports free right now (for config ports set to 0)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_name(rank: int) -> str:
    return f"rank-worker-{rank}"


@dataclass(frozen=True)
class _Stack:
    """What every service builder needs: the config, the plan, and how this mode binds and addresses."""

    config: KvServeConfig
    plan: StackPlan
    ranks: int
    gpu_ids: tuple[str, ...]
    expert_parallel: int = 1  # ranks per expert-parallel group
    configured_ports: frozenset[int] = frozenset()  # ports the config names for this build: never picked
    given_ports: set[int] = field(default_factory=set)  # picked for port 0 in this build
    rendezvous: dict[int, str] = field(default_factory=dict)  # expert-parallel group's first rank -> host:port

    @property
    def compose(self) -> bool:
        return self.plan.mode == "compose"

    @property
    def internal_host(self) -> str:
        return COMPOSE_BIND if self.compose else LOCAL_BIND  # internal services: loopback only when local

    def port(self, configured: int) -> int:
        return configured if self.compose or configured != 0 else self.free_port()

    def metrics_port(self, configured: int) -> int:
        """A gRPC service's /metrics port: the configured one, else COMPOSE_METRICS_PORT in compose (a container
        each); locally 0 stays off (config/local.yaml names ports for `make up`)."""
        return configured or (COMPOSE_METRICS_PORT if self.compose else 0)

    def metrics_environment(self, variable: str, port: int) -> dict[str, str]:
        return {variable: str(port)}  # in both modes, 0 included: the same variables locally and in compose

    def free_port(self) -> int:
        """A free port no other service of this build was given: the OS may report one port free twice."""
        for _ in range(MAX_PORT_PICKS):
            port = free_port()
            if port not in self.given_ports and port not in self.configured_ports:
                self.given_ports.add(port)
                return port
        raise RuntimeError(f"no free port unlike {sorted(self.given_ports)} after {MAX_PORT_PICKS} picks")

    def group_rendezvous(self, first_rank: int) -> str:
        """Where the group led by `first_rank` meets: that rank's container in compose, a port of its own locally."""
        if first_rank not in self.rendezvous:
            if self.compose:
                self.rendezvous[first_rank] = f"{rank_name(first_rank)}:{COMPOSE_RENDEZVOUS_PORT}"
            else:
                self.rendezvous[first_rank] = client_target(LOCAL_BIND, self.free_port())
        return self.rendezvous[first_rank]

    def address(self, name: str, host: str, port: int) -> str:
        return f"{name}:{port}" if self.compose else client_target(host, port)

    def probe_target(self, host: str, port: int) -> str:
        return client_target(LOCAL_BIND if self.compose else host, port)  # compose: inside its own container

    def secret_path(self, secret: str) -> str:
        return compose_secret_path(secret) if self.compose else str(local_secret_path(self.plan.state_dir, secret))

    def environment(self, **values: str) -> dict[str, str]:
        """A kvserve service's: KVSERVE_CONFIG (the one config file), the internal secret, the given variables."""
        config_file = COMPOSE_CONFIG_PATH if self.compose else self.plan.config_file
        internal = {"KVSERVE_INTERNAL_SECRET_FILE": self.secret_path(INTERNAL_SECRET)}
        return ({"KVSERVE_CONFIG": config_file} if config_file else {}) | internal | values

    def python_service(self, name: str, host: str, port: int) -> tuple[str, ...]:
        module = name.replace("-", "_")
        return (self.plan.python, "-m", module, "--host", host, "--port", str(port))


def build_topology(
    config: KvServeConfig, ranks: int, plan: StackPlan, expert_parallel: int | None = None
) -> list[ServiceSpec]:
    """The services of a stack with `ranks` rank workers, in start order: redis, kvstore, router, ranks, gateway.
    `expert_parallel` ranks form each expert-parallel group (default: the config's expert_parallel_size)."""
    if ranks < 1:
        raise ValueError("a stack needs at least one rank worker")
    group_size = config.expert_parallel_size if expert_parallel is None else expert_parallel
    if group_size < 1:
        raise ValueError("an expert-parallel group needs at least one rank (--expert-parallel 1: none)")
    if ranks % group_size:
        raise ValueError(
            f"{ranks} rank workers do not split into expert-parallel groups of {group_size}: the group size must "
            f"divide the number of ranks (--ranks {ranks} --expert-parallel {group_size})"
        )
    if plan.mode == "compose":
        gpu_ids = tuple(str(rank) for rank in range(ranks)) if plan.compose_gpus else ()
    else:
        gpu_ids = tuple(plan.gpu_ids)
    if gpu_ids and len(gpu_ids) < ranks:
        raise ValueError(f"{ranks} rank workers need {ranks} GPUs, one each; {len(gpu_ids)} visible: {list(gpu_ids)}")
    stack = _Stack(config, plan, ranks, gpu_ids, group_size, _configured_ports(config, ranks))
    redis = _redis(stack)
    kvstore = _kvstore(stack)
    router = _router(stack, redis, kvstore)
    rank_workers = [_rank_worker(stack, rank, kvstore, router) for rank in range(ranks)]
    return [redis, kvstore, router, *rank_workers, _gateway(stack, router, rank_workers)]


def rank_kv_events_endpoint(endpoint: str, rank: int) -> str:
    """Rank `rank`'s vLLM-format KV events endpoint on one machine: a tcp endpoint's port plus 2 x rank (rank 0
    keeps the configured 5557 and replay 5558, rank 1 gets 5559 and 5560, ...); ipc and inproc paths get a suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = split_host_port(endpoint.removeprefix("tcp://"))
        return f"tcp://{listen_address(host, port + 2 * rank)}"
    return f"{endpoint}-rank{rank}"


def _configured_ports(config: KvServeConfig, ranks: int) -> frozenset[int]:
    """The ports the config gives the build's services; a port picked free for another must not be one of them
    (the OS reports them free until their service starts)."""
    redis_port = urlsplit(config.redis_url).port
    ports: set[int | None] = {
        DEFAULT_REDIS_PORT if redis_port is None else redis_port,
        config.kvstore_port,
        config.router_port,
        config.gateway_port,
        config.kvstore_metrics_port,
        config.router_metrics_port,
    }
    if config.rank_worker_port:
        ports.update(config.rank_worker_port + rank for rank in range(ranks))
    if config.rank_worker_metrics_port:
        ports.update(config.rank_worker_metrics_port + rank for rank in range(ranks))
    for endpoint in (config.kv_events_endpoint, config.kv_events_replay_endpoint):
        ports.update(_tcp_port(rank_kv_events_endpoint(endpoint, rank)) for rank in range(ranks))
    ports.update(map(_tcp_port, (config.kvstore_kv_events_endpoint, config.kvstore_kv_events_replay_endpoint)))
    return frozenset(ports - {0, None})


def _tcp_port(endpoint: str) -> int | None:
    """A tcp:// endpoint's port; None for an ipc or inproc one."""
    return split_host_port(endpoint.removeprefix("tcp://"))[1] if endpoint.startswith("tcp://") else None


def _redis(stack: _Stack) -> ServiceSpec:
    url = urlsplit(stack.config.redis_url)
    host, port = stack.internal_host, stack.port(url.port if url.port is not None else DEFAULT_REDIS_PORT)
    data_dir = COMPOSE_REDIS_DIR if stack.compose else str(stack.plan.state_dir / "redis")
    # The password (requirepass) comes in a config file, the first argument, so `ps` does not show it:
    # locally `kvserve up` writes it into the state dir; in compose the entrypoint writes it from the secret.
    conf = COMPOSE_REDIS_CONF if stack.compose else str(stack.plan.state_dir / LOCAL_REDIS_CONF)
    argv = ["redis-server", conf, "--port", str(port), "--bind", host, "--dir", data_dir, "--appendonly", "yes"]
    password_file = stack.secret_path(REDIS_PASSWORD)
    return ServiceSpec(
        name="redis",
        role="redis",
        argv=tuple(argv),
        host=host,
        port=port,
        address=stack.address("redis", host, port),
        health=HealthCheck("redis", stack.probe_target(host, port), password_file=password_file),
        startup_s=30.0,
        reads_config=False,
        secrets=(REDIS_PASSWORD,),
        entrypoint=_compose_redis_entrypoint(password_file) if stack.compose else (),
    )


def _compose_redis_entrypoint(password_file: str) -> tuple[str, ...]:
    """sh -c: write requirepass from the secret into a file only redis can read, then the image's own
    entrypoint with the command (it drops to the redis user)."""
    script = (
        "umask 077 && printf 'requirepass \"%s\"\\n' "
        f'"$(cat {password_file})" > {COMPOSE_REDIS_CONF} && chown redis {COMPOSE_REDIS_CONF} && '
        'exec docker-entrypoint.sh "$@"'
    )
    return ("sh", "-c", script, "redis-entrypoint")


def _kvstore(stack: _Stack) -> ServiceSpec:
    config = stack.config
    host, port = stack.internal_host, stack.port(config.kvstore_port)
    metrics_port = stack.metrics_port(config.kvstore_metrics_port)
    environment = stack.environment(**stack.metrics_environment("KVSERVE_KVSTORE_METRICS_PORT", metrics_port))
    if not stack.gpu_ids and config.engine.num_kv_blocks is None:
        # The kvstore sizes its arena from the RAM available when it starts, before the ranks exist: on the
        # CPU their KV pools (kv_cache_memory_gb in all) come out of the same RAM, so it must leave that too.
        environment["KVSERVE_L1_HEADROOM_GB"] = f"{config.l1_headroom_gb + config.engine.kv_cache_memory_gb:g}"
    return ServiceSpec(
        name="kvstore",
        role="kvstore",
        argv=stack.python_service("kvstore", host, port),
        host=host,
        port=port,
        address=stack.address("kvstore", host, port),
        health=HealthCheck("grpc", stack.probe_target(host, port)),
        environment=environment,
        uses_arena=True,
        secrets=(INTERNAL_SECRET,),
        metrics_port=metrics_port,
    )


def _router(stack: _Stack, redis: ServiceSpec, kvstore: ServiceSpec) -> ServiceSpec:
    host, port = stack.internal_host, stack.port(stack.config.router_port)
    metrics_port = stack.metrics_port(stack.config.router_metrics_port)
    url = urlsplit(stack.config.redis_url)
    redis_url = urlunsplit((url.scheme or "redis", redis.address, url.path or "/0", "", ""))  # same db
    return ServiceSpec(
        name="router",
        role="router",
        argv=stack.python_service("router", host, port),
        host=host,
        port=port,
        address=stack.address("router", host, port),
        health=HealthCheck("grpc", stack.probe_target(host, port)),
        environment=stack.environment(
            KVSERVE_REDIS_URL=redis_url,
            KVSERVE_REDIS_PASSWORD_FILE=stack.secret_path(REDIS_PASSWORD),
            KVSERVE_KVSTORE=kvstore.address,
            **stack.metrics_environment("KVSERVE_ROUTER_METRICS_PORT", metrics_port),
        ),
        depends_on=("redis", "kvstore"),
        secrets=(INTERNAL_SECRET, REDIS_PASSWORD),
        metrics_port=metrics_port,
    )


def _rank_worker(stack: _Stack, rank: int, kvstore: ServiceSpec, router: ServiceSpec) -> ServiceSpec:
    config, name, host = stack.config, rank_name(rank), stack.internal_host
    if stack.compose:
        port = config.rank_worker_port  # a container each: every rank listens on the same port
    elif config.rank_worker_port == 0:
        port = stack.free_port()
    else:
        port = config.rank_worker_port + rank  # consecutive ports on one machine
    address = stack.address(name, host, port)
    configured_metrics = config.rank_worker_metrics_port
    if configured_metrics and not stack.compose:
        metrics_port = configured_metrics + rank  # consecutive ports on one machine, as the gRPC ones
    else:
        metrics_port = stack.metrics_port(configured_metrics)
    environment = stack.environment(
        KVSERVE_KVSTORE=kvstore.address,
        KVSERVE_ROUTER=router.address,
        KVSERVE_RANK_ADVERTISE_ADDRESS=address,
        **stack.metrics_environment("KVSERVE_RANK_WORKER_METRICS_PORT", metrics_port),
    )
    if not stack.compose and rank:  # one machine: each rank its own KV event ports (a container each: the same)
        for key, endpoint in (
            ("KVSERVE_KV_EVENTS_ENDPOINT", config.kv_events_endpoint),
            ("KVSERVE_KV_EVENTS_REPLAY_ENDPOINT", config.kv_events_replay_endpoint),
        ):
            if endpoint:
                environment[key] = rank_kv_events_endpoint(endpoint, rank)
    gpu = stack.gpu_ids[rank] if stack.gpu_ids else None
    if gpu is not None:
        # A container given one GPU (device_ids) sees it as device 0; a local process sees them all.
        environment["CUDA_VISIBLE_DEVICES"] = "0" if stack.compose else gpu
        sharing = stack.gpu_ids[: stack.ranks].count(gpu)
        if sharing > 1:  # ranks on one GPU (tests of multi-rank paths on a small machine) split its memory
            environment["KVSERVE_GPU_MEMORY_UTILIZATION"] = f"{config.engine.gpu_memory_utilization / sharing:.4g}"
    elif stack.ranks > 1 and config.engine.num_kv_blocks is None:
        environment["KVSERVE_KV_CACHE_MEMORY_GB"] = f"{cpu_kv_cache_gb(config, stack.ranks):g}"
    group = ""
    if stack.expert_parallel > 1:
        if stack.compose and port == COMPOSE_RENDEZVOUS_PORT:
            raise ValueError(f"rank_worker_port {port} is the expert-parallel rendezvous port: choose another")
        first = group_first_rank(rank, stack.expert_parallel)
        group = group_name(first)
        environment["KVSERVE_EXPERT_PARALLEL_SIZE"] = str(stack.expert_parallel)
        environment["KVSERVE_EXPERT_PARALLEL_RANK"] = str(rank - first)
        environment["KVSERVE_EXPERT_PARALLEL_GROUP"] = group
        environment["KVSERVE_EXPERT_PARALLEL_RENDEZVOUS"] = stack.group_rendezvous(first)
    elif config.expert_parallel_size != 1:  # the config file asks for groups that --expert-parallel 1 turned off
        environment["KVSERVE_EXPERT_PARALLEL_SIZE"] = "1"
    return ServiceSpec(
        name=name,
        role="rank-worker",
        argv=(*stack.python_service("rank-worker", host, port), "--rank-id", f"rank-{rank}"),
        host=host,
        port=port,
        address=address,
        health=HealthCheck("grpc", stack.probe_target(host, port)),
        environment=environment,
        depends_on=("kvstore", "router"),
        gpu=gpu,
        startup_s=stack.plan.rank_startup_s,
        uses_arena=True,
        secrets=(INTERNAL_SECRET,),
        group=group,
        metrics_port=metrics_port,
    )


def _gateway(stack: _Stack, router: ServiceSpec, rank_workers: list[ServiceSpec]) -> ServiceSpec:
    host = COMPOSE_BIND if stack.compose else stack.config.gateway_host
    port = stack.port(stack.config.gateway_port)
    # Its own rank list serves when the router is away (a restart), in rank order.
    rank_list = json.dumps([rank.address for rank in rank_workers])
    return ServiceSpec(
        name="gateway",
        role="gateway",
        argv=stack.python_service("gateway", host, port),
        host=host,
        port=port,
        address=stack.address("gateway", host, port),
        health=HealthCheck("http", f"http://{stack.probe_target(host, port)}/ready"),
        environment=stack.environment(KVSERVE_ROUTER=router.address, KVSERVE_RANK_WORKERS=rank_list),
        depends_on=("router", *(rank.name for rank in rank_workers)),
        published=True,
        secrets=(INTERNAL_SECRET,),
    )


def cpu_kv_cache_gb(config: KvServeConfig, ranks: int) -> float:
    """KV pool size of each CPU rank: kv_cache_memory_gb is the machine's budget, split between the ranks
    (N ranks each taking the whole budget would ask N times the RAM the operator planned for)."""
    return round(config.engine.kv_cache_memory_gb / ranks, 3)


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
