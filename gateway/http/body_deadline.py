"""A deadline for reading a request's body (a pure ASGI middleware): a client that declares more bytes than
it sends, or trickles them, gets a 408 in the API's own shape instead of holding a connection and a task
forever. (Unfinished headers never reach the app: gateway.http.header_deadline times those out.)"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import ApiError


class BodyDeadlineMiddleware:
    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, _DeadlineReceive(receive, self.timeout_s).receive, send)


def body_timeout_error(timeout_s: float) -> ApiError:
    return ApiError(408, "timeout_error", f"the request body did not arrive within {timeout_s:g} s")


class _DeadlineReceive:
    """receive() with one deadline for the whole body, from the app's first read; after the body's last
    chunk it passes through (a streaming response waits on it for the client's disconnect)."""

    def __init__(self, receive: Receive, timeout_s: float) -> None:
        self._receive = receive
        self._timeout_s = timeout_s
        self._deadline: float | None = None
        self._body_done = False

    async def receive(self) -> Message:
        if self._body_done:
            return await self._receive()
        if self._deadline is None:
            self._deadline = time.monotonic() + self._timeout_s
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, self._deadline - time.monotonic()))
        except TimeoutError:
            # An ApiError, so the route's own error path answers it in the API's shape and logs it.
            raise body_timeout_error(self._timeout_s) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._body_done = True
        return message
