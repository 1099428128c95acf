"""One health probe of a service: `python -m launcher.health_check grpc|http|redis TARGET` exits 0 when healthy.

gRPC health checks (grpc.health.v1) need no internal secret: they are the one internal RPC left open. A Redis
with a password is probed with AUTH from its password file.

docker compose runs it as the healthcheck of our containers (the slim image has no curl or grpc_health_probe);
`kvserve up` calls probe() in its wait loop. Only the standard library, grpcio, grpcio-health-checking and
contracts.address (standard library only), so it works in the runtime image without the test extras.
"""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from contracts.address import split_host_port

ProbeKind = Literal["grpc", "http", "redis"]
PROBE_KINDS: tuple[ProbeKind, ...] = ("grpc", "http", "redis")


@dataclass(frozen=True)
class HealthCheck:
    """How to tell a service is ready: a grpc.health.v1 Check, an HTTP 200, or a redis PING."""

    kind: ProbeKind
    target: str  # host:port for grpc and redis, a URL for http; dialled from where the service runs
    password_file: str = ""  # redis: the file holding its password (requirepass), if it has one


def probe(check: HealthCheck, timeout_s: float = 2.0) -> str | None:
    """None when the service is healthy, else a short reason (what a log line or an error should say)."""
    if check.kind == "grpc":
        return _probe_grpc(check.target, timeout_s)
    if check.kind == "http":
        return _probe_http(check.target, timeout_s)
    return _probe_redis(check.target, timeout_s, check.password_file)


def _probe_grpc(target: str, timeout_s: float) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"gRPC {exc.code().name}"  # type: ignore[attr-defined]
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _probe_http(url: str, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return f"no answer ({getattr(exc, 'reason', exc)})"


def _resp_command(*words: bytes) -> bytes:
    """A Redis command as a RESP array (a password may hold any byte)."""
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(word), word) for word in words)


def _probe_redis(target: str, timeout_s: float, password_file: str = "") -> str | None:
    host, port = split_host_port(target)
    commands = [_resp_command(b"PING")]
    if password_file:
        try:
            password = Path(password_file).read_bytes().strip()
        except OSError as exc:
            return f"cannot read the redis password file ({exc.strerror or exc})"
        commands.insert(0, _resp_command(b"AUTH", password))
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"".join(commands))
            replies = b""
            while replies.count(b"\r\n") < len(commands):
                chunk = sock.recv(256)
                if not chunk:
                    break
                replies += chunk
    except OSError as exc:
        return f"no answer ({exc})"
    lines = replies.split(b"\r\n")[: len(commands)]
    if len(lines) < len(commands) or not lines[-1]:
        return f"no answer to {'AUTH' if password_file else 'PING'}"
    # AUTH: +OK (or -WRONGPASS); PING: +PONG when ready, -LOADING while it replays the append-only file.
    refused = next((line for line in lines if not line.startswith((b"+OK", b"+PONG"))), None)
    return None if refused is None else refused.decode(errors="replace").removeprefix("-").strip()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 3) or args[0] not in PROBE_KINDS:
        print("usage: python -m launcher.health_check grpc|http|redis TARGET [REDIS_PASSWORD_FILE]", file=sys.stderr)
        return 2
    reason = probe(HealthCheck(args[0], args[1], *args[2:]))  # type: ignore[arg-type]
    if reason is not None:
        print(f"{args[0]} {args[1]}: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
