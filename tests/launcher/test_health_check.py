"""launcher.health_check against real servers: a gRPC health service, an HTTP endpoint, redis-server; and
`python -m launcher.health_check` exit codes, which docker compose reads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from service_processes import free_port, service_env, start_redis

from launcher.health_check import HealthCheck, probe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def grpc_health() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


class _Ready(BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:
        self.send_response(type(self).status if self.path == "/ready" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_ready() -> Iterator[tuple[str, type[_Ready]]]:
    handler = type("Ready", (_Ready,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/ready", handler
    server.shutdown()
    server.server_close()


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "launcher.health_check", *args]
    return subprocess.run(command, cwd=ROOT, env=service_env(), capture_output=True, text=True, timeout=60)


def test_grpc_probe_follows_the_serving_status(grpc_health: tuple[str, health.HealthServicer]) -> None:
    target, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert probe(HealthCheck("grpc", target)) == "NOT_SERVING"
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe(HealthCheck("grpc", target)) is None
    assert run_check("grpc", target).returncode == 0


def test_grpc_probe_of_nothing_listening() -> None:
    target = f"127.0.0.1:{free_port()}"
    assert probe(HealthCheck("grpc", target), timeout_s=1) == "gRPC UNAVAILABLE"
    result = run_check("grpc", target)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


def test_http_probe_wants_a_200(http_ready: tuple[str, type[_Ready]]) -> None:
    url, handler = http_ready
    assert probe(HealthCheck("http", url)) == "HTTP 503"
    assert run_check("http", url).returncode == 1
    handler.status = 200
    assert probe(HealthCheck("http", url)) is None
    assert run_check("http", url).returncode == 0
    assert probe(HealthCheck("http", f"http://127.0.0.1:{free_port()}/ready"), timeout_s=1).startswith("no answer")


def test_redis_probe_authenticates_and_pings_a_real_redis(tmp_path: Path) -> None:
    port = free_port()
    password_file = os.environ["KVSERVE_REDIS_PASSWORD_FILE"]  # the test Redis's password (service_processes)
    assert probe(HealthCheck("redis", f"127.0.0.1:{port}"), timeout_s=1).startswith("no answer")
    with start_redis(tmp_path / "redis.log", port, tmp_path / "data"):
        assert probe(HealthCheck("redis", f"127.0.0.1:{port}", password_file=password_file)) is None
        assert run_check("redis", f"127.0.0.1:{port}", password_file).returncode == 0
        # A Redis with a password is not healthy to a probe that cannot log in.
        assert probe(HealthCheck("redis", f"127.0.0.1:{port}")).startswith("NOAUTH")  # type: ignore[union-attr]
        wrong = tmp_path / "wrong-password"
        wrong.write_text("not-it\n")
        refused = probe(HealthCheck("redis", f"127.0.0.1:{port}", password_file=str(wrong)))
        assert refused is not None and refused.startswith("WRONGPASS")
        assert run_check("redis", f"127.0.0.1:{port}", str(wrong)).returncode == 1


def test_usage_errors_exit_2() -> None:
    assert run_check("tcp", "127.0.0.1:1").returncode == 2
    assert run_check("grpc").returncode == 2
