"""What every gRPC service's entry point shares: the common flags, the config they override, the listen
address, the keepalive server options, and main()'s logging and bad-config handling."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from contracts import internal_auth
from contracts.config import KvServeConfig, load_config

# Clients keep long-lived channels and send keepalive pings to notice a dead peer; a server that refuses
# them answers "too many pings" and drops every stream on the connection. so_reuseport 0: a second server on
# the same port must fail, not silently share it.
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def internal_server(
    config: KvServeConfig, bind_host: str, service: str, options: list[tuple[str, Any]]
) -> grpc.aio.Server:
    """A grpc.aio server for an internal service: every RPC but health checks requires the internal secret,
    which also becomes what this process's own internal channels send. Raises internal_auth.InternalAuthError
    (with what to do) when the config gives no secret and does not allow running without one here."""
    secret = internal_auth.configure(config, bind_host)
    return grpc.aio.server(options=options, interceptors=internal_auth.server_interceptors(secret, service))


def service_arg_parser(prog: str, description: str, host_key: str, port_key: str) -> argparse.ArgumentParser:
    """--config, --host, --port and --log-level; a service adds its own flags to the parser it gets."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config file (default: $KVSERVE_CONFIG, then defaults)")
    parser.add_argument("--host", help=f"bind address (overrides {host_key})")
    parser.add_argument("--port", type=int, help=f"port (overrides {port_key})")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    return parser


def config_with_overrides(config_file: str | None, overrides: Mapping[str, Any]) -> KvServeConfig:
    """The config, with the flags that were given (None = not given) taking precedence."""
    return load_config(config_file, **{key: value for key, value in overrides.items() if value is not None})


def listen_address(host: str, port: int) -> str:
    """host:port for grpc's add_insecure_port, IPv6 hosts bracketed."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def client_target(host: str, port: int) -> str:
    """Where a client should connect to reach a server bound to host:port (a wildcard bind means this host)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def run_service(
    args: argparse.Namespace,
    config_of: Callable[[argparse.Namespace], KvServeConfig],
    serve: Callable[[KvServeConfig], Awaitable[int]],
    log: logging.Logger,
) -> int:
    """Log to stderr at --log-level, read the config (a bad one exits 2 with the reason), then serve."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        config = config_of(args)
    except (FileNotFoundError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        log.error("bad configuration: %s", exc)
        return 2
    return asyncio.run(serve(config))
