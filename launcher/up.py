"""`kvserve up`: start the local stack and keep it running until Ctrl-C.

For now the stack is rank worker processes (one per rank, on consecutive ports from rank_worker_port);
the router, kvstore and gateway join it in later issues.
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
        _print_ready(services, out)
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


def _print_ready(services: list[ServiceProcess], out: TextIO) -> None:
    out.write("\nkvserve is up:\n")
    for service in services:
        out.write(f"  {service.name}: {service.target} (gRPC)\n")
    out.write(
        "\nTry it:\n"
        f'  {_kvserve_command()} complete "Write a haiku about caches." --max-tokens 48 --target {services[0].target}\n'
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
