"""A pure ASGI middleware that answers 413 to request bodies over max_request_bytes without reading them whole:
a too-large Content-Length is refused before the app runs, and a chunked body is counted as it streams in. The
413 is in the error shape of the API the path belongs to (gateway.http.apis).

Pure ASGI rather than BaseHTTPMiddleware: that one buffers, and it would put a task between the app and
streaming responses."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.apis import Apis
from gateway.http.errors import BodyTooLarge


def too_large_error(apis: Apis, path: str, max_bytes: int) -> dict[str, Any]:
    """The 413 body in the error shape of the API that `path` belongs to."""
    message = f"request body is larger than this server's limit of {max_bytes} bytes"
    return apis.for_path(path).too_large_document(message)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, apis: Apis) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.app = app
        self.max_bytes = max_bytes
        self.apis = apis

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._send_too_large(scope, send)
            return
        guard = _BodyGuard(receive, send, self.max_bytes)
        try:
            await self.app(scope, guard.receive, guard.send)
        except Exception:
            # The app may let the receive() error out, or turn it into one of its own: either way it is a 413.
            if not guard.too_large or guard.response_started:
                raise
        if guard.too_large and not guard.response_started:
            await self._send_too_large(scope, send)

    async def _send_too_large(self, scope: Scope, send: Send) -> None:
        body = json.dumps(too_large_error(self.apis, scope.get("path", ""), self.max_bytes)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            # The rest of the body is never read, so the connection cannot carry another request.
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _BodyGuard:
    """Counts body bytes as the app receives them; past the limit, receive() raises and whatever response
    the app then tries to send is held back, so that the middleware can answer 413 instead."""

    def __init__(self, receive: Receive, send: Send, max_bytes: int) -> None:
        self._receive = receive
        self._send = send
        self._max_bytes = max_bytes
        self._received = 0
        self.too_large = False
        self.response_started = False

    async def receive(self) -> Message:
        if self.too_large:
            raise BodyTooLarge()
        message = await self._receive()
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._max_bytes:
                self.too_large = True
                raise BodyTooLarge()
        return message

    async def send(self, message: Message) -> None:
        if self.too_large and not self.response_started:
            return  # the app's own answer to the failed read (a 400 or 500): the middleware sends the 413
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)


def declared_length(scope: Scope) -> int | None:
    """The body size the Content-Length header declares; None without one (a chunked body) or a malformed one."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed length; the streamed bytes are still counted
    return None
