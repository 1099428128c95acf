"""The outermost layer of the app (a pure ASGI middleware): whatever escapes the routes and their error
handlers becomes a 500 `api_error` in the API's own shape that names no internal detail, its traceback
logged once; a client that went away is a cancellation, not an error; the request's log line and metrics
are settled with the status actually sent; a generation request's response carries its id in a header
(name_request), an error answer too; and a generation request counts as in flight until its response (a
stream included) is over.

Pure ASGI rather than an `@exception_handler(Exception)`: Starlette's ServerErrorMiddleware re-raises after
such a handler, so uvicorn logs a second traceback and closes the keep-alive connection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.apis import Apis
from gateway.http.errors import INTERNAL_ERROR_MESSAGE, ApiError, render_error
from gateway.observability.accounting import CANCELLED, PendingRecord, pending_record
from gateway.observability.metrics import GatewayMetrics

log = logging.getLogger(__name__)

INTERNAL_ERROR = ApiError(500, "api_error", INTERNAL_ERROR_MESSAGE)


class ErrorBoundary:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, apis: Apis) -> None:
        self.app = app
        self.metrics = metrics
        self.apis = apis

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = self.apis.chat_api(scope.get("path", ""))
        with pending_record() as pending, contextlib.ExitStack() as in_flight:
            exchange = _Exchange(receive, send, pending)
            if api is not None and scope.get("method") == "POST":
                in_flight.enter_context(self.metrics.track_in_flight(api.name))
            try:
                await self.app(scope, exchange.receive, exchange.send)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                # A cancel aimed at this task (shutdown) goes on; one that came out of the request's own work
                # after its client left is just the end of that request.
                if not exchange.client_gone or (task is not None and task.cancelling()):
                    raise
                exchange.error_type = CANCELLED
            except Exception as exc:
                where = f"{scope.get('method')} {scope.get('path')} request={pending.request_id or '-'}"
                if exchange.client_gone or isinstance(exc, ClientDisconnect):
                    log.info("%s: the client went away (%s)", where, type(exc).__name__)
                    exchange.error_type = CANCELLED
                else:
                    log.error("%s: internal error", where, exc_info=exc)
                    await exchange.answer_internal_error(self.apis.for_scope(scope).error_document(INTERNAL_ERROR))
            finally:
                status = exchange.status
                if status is None and exchange.error_type == CANCELLED:
                    status = 499
                pending.settle(status, exchange.error_type)


class _Exchange:
    """What passed between the app and the client: the status sent, whether the client left."""

    def __init__(self, receive: Receive, send: Send, pending: PendingRecord) -> None:
        self._receive = receive
        self._send = send
        self._pending = pending
        self.status: int | None = None
        self.error_type = ""  # set when this layer, not the app, decided the outcome
        self.client_gone = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.client_gone = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            pending = self._pending
            if pending.request_id:
                named = (pending.id_header.encode(), pending.request_id.encode())
                message = {**message, "headers": [*message.get("headers", []), named]}
        try:
            await self._send(message)
        except OSError:  # the connection is gone (the server says so as ClientDisconnected, an OSError)
            self.client_gone = True
            raise

    async def answer_internal_error(self, document: dict[str, Any]) -> None:
        self.error_type = "api_error"
        if self.status is not None:
            return  # a response (a stream) already started: the server ends the connection
        body = render_error(document)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        with contextlib.suppress(OSError):
            await self.send({"type": "http.response.start", "status": 500, "headers": headers})
            await self.send({"type": "http.response.body", "body": body})
