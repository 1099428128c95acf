"""host:port addresses as the config, the launcher and the services pass them around, and the loopback rule a
service applies before it serves without a secret (internal_auth off, a gateway without API keys)."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost",)


def split_host_port(address: str) -> tuple[str, int]:
    """The host (IPv6 brackets removed) and port of `address` ("host:port", "[::1]:port"); ValueError unless
    the host is there and the port is a number from 1 to 65535."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {address!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True only for a host that reaches this machine alone: "localhost" or a loopback IP (127.0.0.0/8, ::1),
    in any case, bracketed or not. Another name may resolve to anything, so it is not loopback."""
    host = host.strip().lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False
