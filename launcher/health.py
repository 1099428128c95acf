"""Wait for a gRPC service to report SERVING on the standard health service (grpc.health.v1)."""

from __future__ import annotations

import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ServiceExitedError(RuntimeError):
    """The process we were waiting on exited before it became healthy."""


def wait_for_serving(
    target: str, timeout_s: float, *, process: subprocess.Popen[bytes] | None = None, service: str = ""
) -> None:
    """Return once `target` reports SERVING; raise TimeoutError after timeout_s, or ServiceExitedError
    as soon as `process` (the server, when we started it) has exited."""
    deadline = time.monotonic() + timeout_s
    last_seen = "no answer"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise ServiceExitedError(f"the server for {target} exited with code {process.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_seen = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last_seen = exc.code().name  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} was not SERVING after {timeout_s:.0f}s (last: {last_seen})")
            time.sleep(0.2)
