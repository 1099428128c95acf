"""Starting our services as real processes in tests: free ports, a clean environment, health waits and a
clean stop. Every service test goes through here so they all share cores and deadlines the same way."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def service_env(**settings: str) -> dict[str, str]:
    """The environment minus any KVSERVE_* of the caller, plus `settings`; torch threads split between
    xdist workers as tests/conftest.py does in-process."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVSERVE_")}
    env.update(settings)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    env["PYTHONPATH"] = str(ROOT)
    return env


@contextlib.contextmanager
def running_process(
    args: list[str], env: dict[str, str], log_path: Path, wait_ready: Callable[[subprocess.Popen[bytes]], None]
) -> Iterator[subprocess.Popen[bytes]]:
    """Start `args`, wait until `wait_ready` returns (it must have its own deadline), stop with SIGTERM."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        wait_ready(process)
        yield process
    except Exception:
        print(log_path.read_text(errors="replace")[-5000:])
        raise
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_rank_worker(
    log_path: Path, port: int, **settings: str
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """A rank worker (embedded SmolLM2 unless settings say otherwise), ready once its health is SERVING."""
    from launcher.health import wait_for_serving

    return running_process(
        [sys.executable, "-m", "rank_worker", "--port", str(port)],
        service_env(**settings),
        log_path,
        lambda process: wait_for_serving(f"127.0.0.1:{port}", timeout_s=180, process=process),
    )
