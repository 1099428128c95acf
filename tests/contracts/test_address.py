"""host:port parsing (IPv6 bracketed) and the loopback rule both auth checks share."""

from __future__ import annotations

import pytest

from contracts.address import is_loopback, split_host_port


@pytest.mark.parametrize(
    ("address", "parts"),
    [
        ("127.0.0.1:50051", ("127.0.0.1", 50051)),
        ("kvstore:7001", ("kvstore", 7001)),
        ("[::1]:8080", ("::1", 8080)),
        ("[fd00::2]:65535", ("fd00::2", 65535)),
        ("host:1", ("host", 1)),
    ],
)
def test_split_host_port(address: str, parts: tuple[str, int]) -> None:
    assert split_host_port(address) == parts


@pytest.mark.parametrize("address", ["", "host", "host:", ":80", "[]:80", "host:0", "host:65536", "host:8o", "h:-1"])
def test_split_host_port_refuses_what_is_no_address(address: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        split_host_port(address)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST", " 127.0.0.1 "])
def test_loopback(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "192.168.1.10", "example.com", "localhost.example.com", ""])
def test_not_loopback(host: str) -> None:
    assert not is_loopback(host)
