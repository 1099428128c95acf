"""A bare HTTP/1.1 client over one socket: requests sent as hand-built bytes, responses read by their own
framing, so a test sees exactly what the gateway sent and whether the keep-alive connection survived."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class RawConnection:
    def __init__(self, port: int, timeout_s: float = 120) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def post(self, path: str, body: bytes) -> RawResponse:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
        )
        self.sock.sendall(head.encode("ascii") + body)
        return self._response()

    def _response(self) -> RawResponse:
        head = self._until(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            body = self._exactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int(self._until(b"\r\n").split(b";")[0], 16)
                body += self._exactly(size)
                self._until(b"\r\n")
                if size == 0:
                    break
        else:
            raise AssertionError(f"a response without framing on a keep-alive connection: {headers}")
        return RawResponse(status, headers, body)

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the gateway closed the connection")
        self.buffer += data

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            self._fill()
        part, _, self.buffer = self.buffer.partition(marker)
        return part

    def _exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        part, self.buffer = self.buffer[:size], self.buffer[size:]
        return part
