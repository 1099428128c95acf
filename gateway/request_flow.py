"""The steps every API layer takes for one request, apart from its wire format: prepare, open a rank
stream, then either collect or stream the events; cancel the rank request when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request

from gateway.body_limit import BodyTooLarge
from gateway.generation import (
    BadRequest,
    Finish,
    GenerationEvent,
    OpenGeneration,
    Overloaded,
    StreamBroken,
    Unavailable,
)
from gateway.prompt.chat_template import ChatTemplateError
from gateway.prompt_size import PromptTooLong
from gateway.served_model import ModelNotAvailable

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error to answer with, in the API's own shape: `kind` is the Anthropic error type.

    A plain (mutable) exception: Starlette writes to __traceback__ of exceptions it handles."""

    def __init__(self, status: int, kind: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind  # invalid_request_error | authentication_error | overloaded_error | api_error ...
        self.message = message
        self.retry_after_s = retry_after_s


def api_error_for(exc: BaseException, request_id: str = "") -> ApiError:
    """Map what the generation layer raises to an HTTP status and error type. Only the gateway's own
    validation errors are 4xx; the rest is a 500 whose message names no internal address or exception text
    (those go to the log, with the request's id)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (ModelNotAvailable, PromptTooLong, BadRequest, ChatTemplateError)) or _own_value_error(exc):
        return ApiError(400, "invalid_request_error", str(exc))
    if isinstance(exc, ClientDisconnect):
        return ApiError(499, "client_disconnected", "client went away")
    if isinstance(exc, BodyTooLarge):  # BodyLimitMiddleware sends the 413 itself; nothing to log here
        return ApiError(413, "request_too_large", "request body is too large")
    if isinstance(exc, Overloaded):
        return ApiError(529, "overloaded_error", f"{exc}; retry later", exc.retry_after_s)
    if isinstance(exc, Unavailable):
        log.warning("no rank worker could take request=%s: %s", request_id or "-", exc)
        return ApiError(503, "api_error", "no rank worker is available; retry later", 5)
    if isinstance(exc, StreamBroken):
        log.warning("generation failed mid-stream for request=%s: %s", request_id or "-", exc)
        return ApiError(500, "api_error", "generation failed mid-stream and no rank could continue it")
    log.error("unexpected error in request=%s", request_id or "-", exc_info=exc)
    return ApiError(500, "api_error", "internal server error; the gateway logged the details")


def _own_value_error(exc: BaseException) -> bool:
    """A ValueError of the gateway's own making: of a class the gateway defines (InvalidChat, PromptTooLong,
    ...), or a plain ValueError raised by gateway code (a converter refusing a request). Not a library's,
    such as UnicodeEncodeError or JSONDecodeError, whose text is no message for a client."""
    if isinstance(exc, ValueError) and type(exc).__module__.startswith("gateway."):
        return True
    if type(exc) is not ValueError or exc.__traceback__ is None:
        return False
    innermost = exc.__traceback__
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    return str(innermost.tb_frame.f_globals.get("__name__", "")).startswith("gateway.")


async def collect(opened: OpenGeneration, request: Request) -> list[GenerationEvent]:
    """All events of a non-streaming request; a client that disconnects cancels the rank request."""

    async def run() -> list[GenerationEvent]:
        return [event async for event in opened.events()]

    task = asyncio.create_task(run())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if not done and await request.is_disconnected():
                task.cancel()
                raise ClientDisconnect()  # not the CancelledError of the task: that would end this request's task
        return await task
    finally:
        if not task.done():
            task.cancel()
        await opened.aclose()


async def stream_bytes(
    opened: OpenGeneration,
    write: Callable[[GenerationEvent], bytes],
    write_error: Callable[[ApiError], bytes],
    on_finish: Callable[[Finish | None, ApiError | None], Awaitable[None] | None],
) -> AsyncIterator[bytes]:
    """SSE bytes for each event; an error after the 200 becomes an error event, never a silent end."""
    finish: Finish | None = None
    failure: ApiError | None = None
    try:
        async for event in opened.events():
            if isinstance(event, Finish):
                finish = event
            yield write(event)
    except (asyncio.CancelledError, GeneratorExit):
        failure = ApiError(499, "client_disconnected", "client went away")
        raise
    except Exception as exc:
        failure = api_error_for(exc, opened.prepared.request_id)
        yield write_error(failure)
    finally:
        await opened.aclose()
        with contextlib.suppress(Exception):
            result = on_finish(finish, failure)
            if result is not None:
                await result
