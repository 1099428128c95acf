"""Starting our services as real processes in tests: free ports, a clean environment, health waits and a
clean stop. Every service test goes through here so they all share cores and deadlines the same way.

Every test process has one internal secret and one Redis password (files, mode 0600, made on import): each
service started here gets both, as `kvserve up` gives them, and this process's internal channels
(contracts.internal_auth.channel / aio_channel) send the secret, so every test runs with auth on.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SECRET_ENV = ("KVSERVE_INTERNAL_SECRET_FILE", "KVSERVE_REDIS_PASSWORD_FILE")


def export_test_secrets() -> None:
    """Make this process's internal secret and Redis password files once and name them in its environment
    (where the services' environments and this process's internal channels take them from). Through the
    environment, so the module imported under two names (service_processes, tests.service_processes) shares
    them, and so an xdist worker has its own."""
    if all(os.environ.get(name) for name in SECRET_ENV):
        return
    from contracts.internal_auth import create_secret_file

    directory = Path(tempfile.mkdtemp(prefix="kvserve-test-secrets-"))
    atexit.register(shutil.rmtree, directory, True)
    for name, file_name in zip(SECRET_ENV, ("internal-secret", "redis-password"), strict=True):
        create_secret_file(directory / file_name)
        os.environ[name] = str(directory / file_name)


export_test_secrets()


def redis_password() -> str:
    return Path(os.environ["KVSERVE_REDIS_PASSWORD_FILE"]).read_text().strip()


def redis_client(port: int, **options: Any) -> Any:
    """A redis-py client of a test's redis-server, with its password."""
    import redis

    return redis.Redis(host="127.0.0.1", port=port, password=redis_password(), **options)


def redis_url(port: int, db: int = 0) -> str:
    """The URL, password included, for in-process clients (DurableState); services get the password file."""
    return f"redis://:{redis_password()}@127.0.0.1:{port}/{db}"


def redis_server_args(port: int, data_dir: Path) -> list[str]:
    """redis-server on loopback with the test password (requirepass in a 0600 config file, as `kvserve up`
    does, not in argv), persisting append-only into data_dir."""
    data_dir.mkdir(parents=True, exist_ok=True)
    conf = data_dir / "redis-auth.conf"
    conf.touch(mode=0o600)
    conf.write_text(f'requirepass "{redis_password()}"\n')
    args = ["redis-server", str(conf), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir)]
    return [*args, "--appendonly", "yes", "--save", "", "--protected-mode", "yes"]


class PortClaims:
    """Loopback ports for test services, never one twice while its claimer lives. The OS reports a port free
    (bind to port 0, then close), so it may report the same one again before the service it went to has bound
    it: two ranks of one stack got one port that way. Each port handed out is claimed by a file named after it
    and holding the claimer's pid, made with O_EXCL, so neither this process (whose module may be imported
    under two names) nor another xdist worker or test run on the machine is given it while the claimer lives."""

    MAX_PICKS = 1000

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.claimed: set[int] = set()

    def take(self) -> int:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for _ in range(self.MAX_PICKS):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in self.claimed and self._claim(port):
                self.claimed.add(port)
                return port
        raise RuntimeError(f"no unclaimed free port after {self.MAX_PICKS} picks (claims in {self.directory})")

    def release(self) -> None:
        for port in self.claimed:
            (self.directory / str(port)).unlink(missing_ok=True)
        self.claimed.clear()

    def _claim(self, port: int) -> bool:
        path = self.directory / str(port)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if not _claimer_alive(path):
                path.unlink(missing_ok=True)  # left by a killed process: free for a later pick, not this one
            return False
        with os.fdopen(descriptor, "w") as claim:
            claim.write(str(os.getpid()))
        return True


def _claimer_alive(path: Path) -> bool:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return False
    if not text.isdigit():
        return True  # just made: its pid is being written
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    return True


PORT_CLAIMS = PortClaims(Path(tempfile.gettempdir()) / f"kvserve-test-ports-{os.getuid()}")
atexit.register(PORT_CLAIMS.release)


def free_port() -> int:
    """A loopback port free now that no other live test process or earlier call was given."""
    return PORT_CLAIMS.take()


# A whole stack on any free ports: `kvserve up` picks them and reports them in its state dir's services.json.
ANY_PORTS = {
    "KVSERVE_REDIS_URL": "redis://127.0.0.1:0/0",
    "KVSERVE_KVSTORE_PORT": "0",
    "KVSERVE_ROUTER_PORT": "0",
    "KVSERVE_RANK_WORKER_PORT": "0",
    "KVSERVE_GATEWAY_PORT": "0",
    "KVSERVE_KVSTORE_METRICS_PORT": "0",  # off: config/local.yaml's fixed ones would collide between parallel tests
    "KVSERVE_ROUTER_METRICS_PORT": "0",
    "KVSERVE_RANK_WORKER_METRICS_PORT": "0",
}


def service_env(**settings: str) -> dict[str, str]:
    """The environment minus any KVSERVE_* of the caller, plus the test secrets and `settings`; torch threads
    split between xdist workers as tests/conftest.py does in-process."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVSERVE_")}
    env.update({name: os.environ[name] for name in SECRET_ENV})
    env.update(settings)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    # The checkout first; then what the caller had (the GPU machine's wheels live in a PYTHONPATH site)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    return env


@contextlib.contextmanager
def running_process(
    args: list[str],
    env: dict[str, str],
    log_path: Path,
    wait_ready: Callable[[subprocess.Popen[bytes]], None],
    stop_signal: signal.Signals = signal.SIGTERM,
    stop_timeout_s: float = 30,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start `args`, wait until `wait_ready` returns (it must have its own deadline), stop with
    `stop_signal`, then SIGKILL if it is still running after stop_timeout_s."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(process)
        yield process
    except Exception:
        print(log_path.read_text(errors="replace")[-5000:])
        raise
    finally:
        if process.poll() is None:
            process.send_signal(stop_signal)
            try:
                process.wait(timeout=stop_timeout_s)
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


def wait_http_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    """Poll `url` until it answers 200, failing early if the process exits."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def request_log_line(log: Path, pattern: str, since: int = 0, timeout_s: float = 30) -> str:
    """The first gateway request line after byte offset `since` that contains `pattern`, waited for: the
    gateway logs a request once its response is out, so the client can read the log before the line is there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace")[since:].splitlines():
            if " request id=" in line and pattern in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no request line with {pattern!r} in: {log.read_text(errors='replace')[since:][-3000:]}")


def start_gateway(
    log_path: Path, port: int, rank_ports: list[int], **settings: str
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """The HTTP gateway in front of the given rank workers, ready once /ready says a model is known."""
    args = [sys.executable, "-m", "gateway", "--port", str(port)]
    for rank_port in rank_ports:
        args += ["--rank", f"127.0.0.1:{rank_port}"]
    return running_process(
        args,
        service_env(**settings),
        log_path,
        lambda process: wait_http_ready(f"http://127.0.0.1:{port}/ready", process),
    )


@contextlib.contextmanager
def gateway_stack(tmp: Path, rank_settings: dict[str, str], gateway_settings: dict[str, str]) -> Iterator[str]:
    """One rank worker and a gateway in front of it; yields the gateway's base URL."""
    rank_port, gateway_port = free_port(), free_port()
    with (
        start_rank_worker(tmp / "rank.log", rank_port, **rank_settings),
        start_gateway(tmp / "gateway.log", gateway_port, [rank_port], **gateway_settings) as gateway,
    ):
        try:
            yield f"http://127.0.0.1:{gateway_port}"
        finally:
            if gateway.poll() is not None:
                print((tmp / "gateway.log").read_text(errors="replace")[-5000:])


def wait_redis_ready(port: int, process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    import time

    import redis

    deadline = time.monotonic() + timeout_s
    client = redis_client(port, socket_timeout=1)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}")
        try:
            if client.ping():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"redis-server on {port} not ready after {timeout_s} s")


def start_redis(
    log_path: Path, port: int, data_dir: Path
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """A real redis-server on loopback with the test password, persisting (append-only) into data_dir so a
    restart keeps state."""
    args = redis_server_args(port, data_dir)
    return running_process(args, service_env(), log_path, lambda process: wait_redis_ready(port, process))


def start_kvstore(
    log_path: Path, port: int, **settings: str
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """The L1 kvstore (its arena in /dev/shm unless KVSERVE_L1_ARENA_DIR says otherwise), ready once SERVING."""
    from launcher.health import wait_for_serving

    return running_process(
        [sys.executable, "-m", "kvstore", "--port", str(port)],
        service_env(**settings),
        log_path,
        lambda process: wait_for_serving(f"127.0.0.1:{port}", timeout_s=60, process=process),
    )


def start_router(
    log_path: Path, port: int, **settings: str
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """The router (Redis from KVSERVE_REDIS_URL, kvstore from KVSERVE_KVSTORE), ready once SERVING."""
    from launcher.health import wait_for_serving

    return running_process(
        [sys.executable, "-m", "router", "--port", str(port)],
        service_env(**settings),
        log_path,
        lambda process: wait_for_serving(f"127.0.0.1:{port}", timeout_s=60, process=process),
    )
