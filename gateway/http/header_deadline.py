"""uvicorn's h11 protocol with a deadline for each request's headers. uvicorn times out only idle keep-alive
connections: a client that opens a connection and sends nothing, or half a request line, or headers without
their blank line, holds the connection forever (a handful of such clients exhaust the file descriptors).
The body's deadline is the app's (gateway.http.body_deadline), so that it can answer in the API's own shape."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = b"request headers not received in time"
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    + f"content-length: {len(_TIMEOUT_BODY)}\r\nconnection: close\r\n\r\n".encode()
    + _TIMEOUT_BODY
)


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """The protocol class to give uvicorn (`http=`): each request's headers must be complete within timeout_s
    of its first byte (of the connection's opening, for its first request)."""
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    return type("HeaderDeadlineH11Protocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": timeout_s})


class _HeaderDeadlineProtocol(H11Protocol):
    header_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # a pipelined request may have started meanwhile

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the headers are in; the app reads the body under its own deadline
        elif self.conn.trailing_data[0]:
            self._arm()  # part of the next request's head is buffered
        # else: an idle keep-alive connection, which uvicorn's keep-alive timeout closes

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()
