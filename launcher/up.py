"""`kvserve up`: start the whole local stack and keep it running until Ctrl-C.

The stack is the topology (launcher/topology.py) in local mode: redis-server, the kvstore, the router, N rank
workers and the gateway, started tier by tier in dependency order, each waited on until healthy. Logs (the
previous run's kept in logs.prev), the redis data, services.json (names, pids, addresses) and the secrets (the
internal plane's shared secret and Redis's password, made on the first start) go to the state dir (default
.kvserve/run), its user's alone (launcher/state_dir.py). SIGINT or SIGTERM stops everything in reverse order.
A service that exits once the stack is up is restarted, as compose's `restart: unless-stopped` would; one that
keeps crashing stops the stack. The ranks of an expert-parallel group (`--expert-parallel R`) are restarted
together when one of them exits (launcher/supervisor.py); services.json counts each group's restarts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

import grpc

from contracts import internal_auth
from contracts.config import KvServeConfig, load_config
from contracts.service_main import client_target
from launcher.claude_code_env import (
    API_KEY_PLACEHOLDER,
    OPEN_GATEWAY_KEY,
    claude_code_environment,
    claude_command,
    paste_instructions,
)
from launcher.gpus import listed_gpus
from launcher.stack_secrets import prepare_local_secrets, write_private
from launcher.state_dir import LOGS, PREVIOUS_LOGS, prepare_state_dir
from launcher.supervisor import ServiceFailedError, Supervisor
from launcher.topology import (
    INTERNAL_SECRET,
    ServiceSpec,
    StackPlan,
    build_topology,
    cpu_kv_cache_gb,
    local_secret_path,
    start_tiers,
)

DEFAULT_STATE_DIR = Path(".kvserve/run")
WATCH_INTERVAL_S = 0.5
REDIS_INSTALL_HINT = (
    "redis-server not found on PATH: the router keeps its state in Redis. Install it: "
    "`sudo apt-get install redis-server` (Debian/Ubuntu), `brew install redis` (macOS), "
    "or run `make setup` as root, which installs it"
)


class StackError(RuntimeError):
    """The stack cannot start as configured (missing redis-server, a port in use, a bad config)."""


@dataclass(frozen=True)
class UpOptions:
    config_file: str | None
    ranks: int = 1
    ready_timeout_s: float = 600.0
    state_dir: Path = DEFAULT_STATE_DIR
    gpus: tuple[str, ...] = ()  # the GPU of each rank, in order (repeats share one); empty = one visible GPU each
    expert_parallel: int | None = None  # ranks per expert-parallel group; None = the config's expert_parallel_size


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGINT and SIGTERM stop the stack the same way


def visible_gpu_ids(config: KvServeConfig) -> list[str]:
    """The GPUs local ranks may use, one each: CUDA_VISIBLE_DEVICES when set, else what nvidia-smi lists."""
    if config.device == "cpu":
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [device.strip() for device in visible.split(",") if device.strip() and device.strip() != "-1"]
    # no nvidia-smi, or a driver that does not answer: the ranks run on the CPU (and say so in their logs)
    return listed_gpus() or []


def plan_stack(options: UpOptions, config: KvServeConfig) -> list[ServiceSpec]:
    """The local topology for these options, after the checks that would otherwise fail one service deep."""
    if shutil.which("redis-server") is None:
        raise StackError(REDIS_INSTALL_HINT)
    gpu_ids = visible_gpu_ids(config)
    if options.gpus:
        if len(options.gpus) != options.ranks:
            raise StackError(f"--gpus names {len(options.gpus)} GPUs for {options.ranks} rank workers: one per rank")
        unknown = sorted(set(options.gpus) - set(gpu_ids))
        if unknown:
            raise StackError(f"--gpus {','.join(options.gpus)}: GPU {unknown[0]} is not visible ({gpu_ids})")
        gpu_ids = list(options.gpus)
    if gpu_ids and options.ranks > len(gpu_ids):
        raise StackError(f"--ranks {options.ranks} needs one GPU per rank; {len(gpu_ids)} visible ({gpu_ids})")
    plan = StackPlan(
        mode="local",
        config_file=str(Path(options.config_file).resolve()) if options.config_file else None,
        python=sys.executable,
        state_dir=options.state_dir.resolve(),
        gpu_ids=gpu_ids[: options.ranks],
        rank_startup_s=options.ready_timeout_s,
    )
    specs = build_topology(config, options.ranks, plan, options.expert_parallel)
    for spec in specs:
        _check_port_free(spec)
    return specs


def _check_port_free(spec: ServiceSpec) -> None:
    family = socket.AF_INET6 if ":" in spec.host else socket.AF_INET
    with socket.socket(family) as sock:
        # As the servers do: a port whose last connections linger in TIME_WAIT is free to listen on again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((spec.host, spec.port))
        except OSError as exc:
            key = "redis_url" if spec.role == "redis" else f"{spec.role.replace('-', '_')}_port"
            raise StackError(
                f"{spec.name} cannot listen on {spec.host}:{spec.port} ({exc.strerror}): another process uses "
                f"it. Stop it, or choose another port with the config key {key} (or KVSERVE_{key.upper()}; "
                "0 picks a free port)"
            ) from exc


def metrics_url(spec: ServiceSpec) -> str:
    """Where a gRPC service serves Prometheus /metrics (its own host, its metrics port)."""
    return f"http://{client_target(spec.host, spec.metrics_port)}/metrics"


def write_services_file(supervisor: Supervisor, path: Path) -> None:
    """services.json: what runs where, for scripts and tests (pids change when a service is restarted), its
    restarts so far, and each expert-parallel group's restarts (one per group restart) and their last cause."""
    entries = [
        {
            "name": service.spec.name,
            "role": service.spec.role,
            "pid": service.process.pid,
            "address": service.spec.address,
            "log": str(service.log_path),
            "restarts": service.restart_count,
            "recovering": service.recovering,
            **({"group": service.spec.group} if service.spec.group else {}),
            **({"metrics": metrics_url(service.spec)} if service.spec.metrics_port else {}),
        }
        for service in supervisor.services
    ]
    document: dict[str, object] = {"launcher_pid": os.getpid(), "services": entries}
    if supervisor.groups:
        document["groups"] = [group.report() for group in supervisor.groups.values()]
    write_private(path, json.dumps(document, indent=2) + "\n")


def run_up(options: UpOptions, out: TextIO = sys.stdout) -> int:
    def say(text: str) -> None:
        out.write(text)
        out.flush()

    try:
        config = load_config(options.config_file)
        specs = plan_stack(options, config)
    except (StackError, FileNotFoundError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        say(f"error: {exc}\n")
        return 1
    log_dir = prepare_state_dir(options.state_dir)
    prepare_local_secrets(options.state_dir)
    # Its own calls to the stack (the rank's ModelInfo) carry the secret the services check.
    internal_auth.use_secret(internal_auth.read_secret_file(local_secret_path(options.state_dir, INTERNAL_SECRET)))
    tiers = start_tiers(specs)
    supervisor = Supervisor(log_dir, say)
    services_file = options.state_dir / "services.json"
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    # Explicitly, not Python's default: a launcher started in the background of a script inherits SIGINT
    # ignored, and `kill -INT` must still stop the stack.
    previous_sigint = signal.signal(signal.SIGINT, _raise_interrupt)
    say(f"starting {len(specs)} services; logs in {supervisor.log_dir}\n")
    try:
        for tier in tiers:
            started = [supervisor.start(spec) for spec in tier]
            write_services_file(supervisor, services_file)
            supervisor.wait_healthy(started)
        gateway = next(spec for spec in specs if spec.role == "gateway")
        ranks = [spec for spec in specs if spec.role == "rank-worker"]
        ready = _gateway_ready(gateway)
        _print_ready(specs, str(ready["model"]), _max_model_len(ranks[0].address), config, options, out)
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if supervisor.watch():
                write_services_file(supervisor, services_file)
    except (ServiceFailedError, OSError, grpc.RpcError) as exc:  # OSError: the gateway's /ready went away
        say(f"error: {exc}\nstopping...\n")
        return 1
    except KeyboardInterrupt:
        say("stopping...\n")
        return 0
    finally:
        # A second Ctrl-C must not cut the stop short and leave services running in their own sessions.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        supervisor.stop_all(tiers)
        say("stopped\n")
        signal.signal(signal.SIGINT, previous_sigint)
        signal.signal(signal.SIGTERM, previous_sigterm)


def _gateway_ready(gateway: ServiceSpec) -> dict[str, object]:
    with urllib.request.urlopen(gateway.health.target, timeout=10) as response:
        return dict(json.loads(response.read()))


def _max_model_len(rank_target: str) -> int:
    from protos import rank_worker_pb2 as pb
    from protos import rank_worker_pb2_grpc as pb_grpc

    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with internal_auth.channel(rank_target, options=options) as channel:
        return pb_grpc.RankWorkerStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10).max_model_len


def _print_ready(
    specs: list[ServiceSpec], model: str, max_model_len: int, config: KvServeConfig, options: UpOptions, out: TextIO
) -> None:
    gateway = next(spec for spec in specs if spec.role == "gateway")
    ranks = [spec for spec in specs if spec.role == "rank-worker"]
    base_url = f"http://{gateway.address}"
    out.write("\nkvserve is up:\n")
    out.write(f"  gateway: {base_url} (Anthropic /v1/messages, OpenAI /v1/chat/completions), model {model}\n")
    for spec in specs:
        if spec.role == "gateway":
            continue
        kind = "redis" if spec.role == "redis" else "gRPC"
        device = f", GPU {spec.gpu}" if spec.gpu is not None else ""
        group = f", expert-parallel group {spec.group}" if spec.group else ""
        metrics = f", {metrics_url(spec)}" if spec.metrics_port else ""
        out.write(f"  {spec.name}: {spec.address} ({kind}{device}{group}{metrics})\n")
    if ranks[0].gpu is None and config.engine.num_kv_blocks is None:
        total = config.engine.kv_cache_memory_gb
        each = cpu_kv_cache_gb(config, len(ranks))
        split = f", split between {len(ranks)} ranks: {each:g} GB each" if len(ranks) > 1 else ""
        out.write(f"  KV pools on the CPU: kv_cache_memory_gb {total:g}{split}; the L1 arena leaves that RAM free\n")
    logs = (options.state_dir / LOGS).resolve()
    out.write(f"  logs: {logs} (the previous run's: {logs.with_name(PREVIOUS_LOGS)})\n")
    on_cpu = ranks[0].gpu is None
    api_key, keys_note = OPEN_GATEWAY_KEY, ""
    if config.api_keys_file:  # the gateway refuses any other key: the user pastes one of the file's
        keys = Path(config.api_keys_file).resolve()
        api_key = API_KEY_PLACEHOLDER
        keys_note = (
            f"API keys are on (api_keys_file {keys}): put one of its keys in place of {API_KEY_PLACEHOLDER}.\n"
            f"  {_kvserve_command()} keys create --name NAME --file {keys}\nmakes one and prints it once."
        )
    environment = claude_code_environment(
        base_url, model, max_model_len, config.request_timeout_secs, on_cpu=on_cpu, api_key=api_key
    )
    out.write(paste_instructions(environment, claude_command(Path(sys.executable).parent), keys_note))
    out.write(
        "\nOr from the command line:\n"
        f'  {_kvserve_command()} complete "Write a haiku about caches." --max-tokens 48 --target {ranks[0].address}'
        f"{_secret_flag(options.state_dir)}\n"
        "\nCtrl-C stops everything.\n"
    )
    out.flush()


def _secret_flag(state_dir: Path) -> str:
    """`kvserve complete` finds the default state dir's secret itself; another one it must be told."""
    if state_dir.resolve() == DEFAULT_STATE_DIR.resolve():
        return ""
    return f" --secret-file {local_secret_path(state_dir, INTERNAL_SECRET).resolve()}"


def _kvserve_command() -> str:
    """How the user can run kvserve from here: plain `kvserve` only when PATH finds this install's."""
    installed = Path(sys.executable).parent / "kvserve"
    if not installed.exists():
        return f"{sys.executable} -m launcher.cli"
    on_path = shutil.which("kvserve")
    if on_path and Path(on_path).resolve() == installed.resolve():
        return "kvserve"
    return os.path.relpath(installed)
