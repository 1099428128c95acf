"""Large request bodies admitted to the gateway's body budget (gateway.http.body_budget), a pure ASGI middleware.

A body of LARGE_BODY_BYTES or more takes its share when the app first reads it: before any byte of it is read
if it declares its length, or once it has all arrived if chunked (its size is known only then). It holds the
share until its parsed body has been let go of (body_parse.let_go_of_body): when the chat route has built the
prompt and opened the rank's stream (release_body), or else when the request is over. Holding it through the
answer would cap concurrent agents, whose conversations are megabytes each, at the budget over their size; once
the prompt is built, nothing of the answer needs the body's objects. A body that gets no share in time is
answered 529 overloaded in the API's own shape. Smaller bodies, most requests, never wait.

The app reads the body after authentication, so an unauthenticated request never waits; the wait comes before
the first read, so gateway.http.body_deadline's read deadline starts after it and bounds how long an admitted body
may take to arrive."""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.body_budget import BodyBudget
from gateway.http.body_limit import declared_length
from gateway.http.body_parse import LARGE_BODY_BYTES, let_go_of_body
from gateway.http.errors import ApiError, BudgetRefused

RETRY_AFTER_S = 5
ADMISSION = "body_admission"  # the request's _Admission, in its scope's state


class BodyAdmissionMiddleware:
    def __init__(self, app: ASGIApp, budget: BodyBudget, min_bytes: int = LARGE_BODY_BYTES) -> None:
        self.app = app
        self.budget = budget
        self.min_bytes = min_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admission = _Admission(self.budget, self.min_bytes, declared_length(scope), receive, send)
        state = scope.setdefault("state", {})  # the request's state, where the parsed body is kept
        state[ADMISSION] = admission
        try:
            await self.app(scope, admission.receive, admission.send)
        finally:
            await admission.done(state)


async def release_body(state: dict[str, Any]) -> None:
    """The request's body is needed no more (`state`: its scope's state): let go of it and give its share back
    now rather than when the answer ends. Once per request; nothing where no admission ran."""
    admission = state.get(ADMISSION)
    if admission is not None:
        await admission.done(state)


class _Admission:
    """One request's passage through the budget: receive() waits for the share, release() gives it back."""

    def __init__(self, budget: BodyBudget, min_bytes: int, declared: int | None, receive: Receive, send: Send) -> None:
        self._budget = budget
        self._min_bytes = min_bytes
        self._declared = declared
        self._receive = receive
        self._send = send
        self._settled = False  # admitted, refused, or too small to need a share
        self._received = 0
        self._share = 0
        self._refused_unread = False
        self._done = False

    async def done(self, state: dict[str, Any]) -> None:
        """The parsed body let go of, then the share given back (before it goes to another body); once."""
        if self._done:
            return
        self._done = True
        try:
            await let_go_of_body(state)
        finally:
            self.release()

    async def receive(self) -> Message:
        if not self._settled and self._declared is not None:
            self._settled = True
            if self._declared >= self._min_bytes:
                await self._admit(self._declared, unread=True)
        message = await self._receive()
        if not self._settled and message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self._settled = True
                if self._received >= self._min_bytes:
                    await self._admit(self._received, unread=False)
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and self._refused_unread:
            # The body was never read, so the connection cannot carry another request
            headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await self._send(message)

    def release(self) -> None:
        if self._share:
            self._budget.release(self._share)
            self._share = 0

    async def _admit(self, body_bytes: int, unread: bool) -> None:
        try:
            self._share = await self._budget.acquire(body_bytes)
        except BudgetRefused as exc:
            self._refused_unread = unread
            # An ApiError, so the route's own error path answers it in the API's shape and logs it.
            message = f"the gateway is holding as many request bodies as it may ({exc}); retry later"
            raise ApiError(529, "overloaded_error", message, retry_after_s=RETRY_AFTER_S) from None
