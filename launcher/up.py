"""`kvserve up`: start the local stack and keep it running until Ctrl-C.

The stack: rank worker processes (one per rank, on consecutive ports from rank_worker_port) and the HTTP
gateway in front of them; the router and kvstore join it in a later issue.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from contracts.config import load_config
from launcher.health import ServiceExitedError, client_target, wait_for_serving

STOP_TIMEOUT_S = 20.0


@dataclass
class ServiceProcess:
    name: str
    target: str
    process: subprocess.Popen[bytes]


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM to the launcher stops the stack the same way Ctrl-C does


def start_rank_workers(config_file: str | None, ranks: int, host: str, base_port: int) -> list[ServiceProcess]:
    services: list[ServiceProcess] = []
    for rank in range(ranks):
        port = base_port + rank
        command = [sys.executable, "-m", "rank_worker", "--host", host, "--port", str(port)]
        if config_file:
            command += ["--config", config_file]
        # A session of its own: Ctrl-C reaches only the launcher, which then stops workers in order.
        process = subprocess.Popen(command, start_new_session=True)
        services.append(ServiceProcess(f"rank worker {rank}", client_target(host, port), process))
    return services


def start_gateway(config_file: str | None, ranks: list[ServiceProcess]) -> ServiceProcess:
    config = load_config(config_file)
    command = [sys.executable, "-m", "gateway"]
    if config_file:
        command += ["--config", config_file]
    for rank in ranks:
        command += ["--rank", rank.target]
    process = subprocess.Popen(command, start_new_session=True)
    base_url = f"http://{client_target(config.gateway_host, config.gateway_port)}"
    return ServiceProcess("gateway", base_url, process)


def wait_for_gateway(gateway: ServiceProcess, timeout_s: float) -> str:
    """Wait until /ready answers 200; returns the served model name."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            raise ServiceExitedError(f"the gateway exited with code {gateway.process.returncode}")
        try:
            response = httpx.get(f"{gateway.target}/ready", timeout=2)
            if response.status_code == 200:
                return str(response.json()["model"])
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the gateway at {gateway.target} was not ready after {timeout_s:.0f} s")


def stop_services(services: list[ServiceProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM (graceful stop) to each, then SIGKILL to any still running after timeout_s."""
    for service in services:
        if service.process.poll() is None:
            service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for service in services:
        try:
            service.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


def run_up(config_file: str | None, ranks: int, ready_timeout_s: float, out: TextIO = sys.stdout) -> int:
    config = load_config(config_file)
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    services: list[ServiceProcess] = []
    try:
        services = start_rank_workers(config_file, ranks, config.rank_worker_host, config.rank_worker_port)
        for service in services:
            wait_for_serving(service.target, ready_timeout_s, process=service.process)
        gateway = start_gateway(config_file, services)
        services.insert(0, gateway)  # stopped first: no new requests while ranks wind down
        model = wait_for_gateway(gateway, ready_timeout_s)
        _print_ready(services, model, _max_model_len(services[1].target), out)
        while True:
            for service in services:
                if service.process.poll() is not None:
                    out.write(f"{service.name} exited with code {service.process.returncode}; stopping\n")
                    return 1
            time.sleep(0.5)
    except (ServiceExitedError, TimeoutError) as exc:
        out.write(f"error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        out.write("stopping...\n")
        return 0
    finally:
        # A second Ctrl-C must not cut the stop short and leave workers running in their own sessions.
        previous_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_services(services)
        signal.signal(signal.SIGINT, previous_sigint)
        signal.signal(signal.SIGTERM, previous_sigterm)
        out.flush()


def _max_model_len(rank_target: str) -> int:
    import grpc

    from protos import rank_worker_pb2 as pb
    from protos import rank_worker_pb2_grpc as pb_grpc

    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(rank_target, options=options) as channel:
        return pb_grpc.RankWorkerStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10).max_model_len


def claude_code_environment(base_url: str, model: str, max_model_len: int) -> dict[str, str]:
    """What Claude Code needs to use this endpoint. It must compact before our context is full, and it
    assumes 1M tokens for a model it does not know."""
    return {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "local",  # any value: the local gateway runs without keys on loopback
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(max_model_len * 9 // 10),
        # A first prefill of ~20K tokens on a CPU takes minutes; Claude Code's defaults give up after 5.
        "API_TIMEOUT_MS": "1800000",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
    }


def _print_ready(services: list[ServiceProcess], model: str, max_model_len: int, out: TextIO) -> None:
    gateway, ranks = services[0], services[1:]
    out.write("\nkvserve is up:\n")
    out.write(f"  gateway: {gateway.target} (Anthropic /v1/messages, OpenAI /v1/chat/completions), model {model}\n")
    for service in ranks:
        out.write(f"  {service.name}: {service.target} (gRPC)\n")
    out.write("\nUse it from Claude Code:\n")
    for name, value in claude_code_environment(gateway.target, model, max_model_len).items():
        out.write(f"  export {name}={value}\n")
    out.write(
        "  claude\n"
        "\nOr from the command line:\n"
        f'  {_kvserve_command()} complete "Write a haiku about caches." --max-tokens 48 --target {ranks[0].target}\n'
        "\nCtrl-C stops everything.\n"
    )
    out.flush()


def _kvserve_command() -> str:
    """How the user can run kvserve from here: plain `kvserve` only when PATH finds this install's."""
    installed = Path(sys.executable).parent / "kvserve"
    if not installed.exists():
        return f"{sys.executable} -m launcher.cli"
    on_path = shutil.which("kvserve")
    if on_path and Path(on_path).resolve() == installed.resolve():
        return "kvserve"
    return os.path.relpath(installed)
