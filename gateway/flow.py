"""The flow every chat endpoint shares, whatever its wire format: find the gateway's state, authenticate, parse
the body leniently into its schema (errors as 400 in the API's shape, never FastAPI's 422), check the key's
scope, prepare (refusals before any rank work), open a rank stream (refusals before any response), then answer
in one piece or as a stream, cancelling the rank request when the client goes away, and account for the request
at the end. Each API supplies a ChatApi with its formats."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.http.auth import AuthError, KeyEntry
from gateway.http.body_admission import release_body
from gateway.http.body_parse import parse_request_body, work_for_body
from gateway.http.errors import ApiError, api_error_for
from gateway.observability.accounting import name_request, record_end, record_failure
from gateway.observability.request_log import RequestRecord
from gateway.prompt.chat import ChatRequest
from gateway.prompt.conversation_rules import check_conversation
from gateway.ranks.generation import Finish, Generation, GenerationEvent, OpenGeneration, PreparedRequest
from gateway.state import GatewayState

EventWriter = Callable[[GenerationEvent], bytes]
ErrorWriter = Callable[[ApiError], bytes]


class ChatApi(Protocol):
    name: str  # the name its API registered: metrics and log label
    schema: type[BaseModel]
    session_header: str
    id_header: str  # the response header with the request's id, where the API's own SDK reads it

    def new_id(self) -> str: ...

    def to_chat(self, body: Any, session: str) -> ChatRequest: ...

    def finish_reason(self, finish: Finish) -> str: ...

    def whole_response(self, request_id: str, body: Any, events: list[GenerationEvent]) -> dict[str, Any]: ...

    def stream_writers(
        self, request_id: str, body: Any, prepared: PreparedRequest, opened: OpenGeneration
    ) -> tuple[EventWriter, ErrorWriter]: ...


async def serve_chat(request: Request, api: ChatApi) -> Response:
    state = gateway_state(request)
    arrived = time.monotonic()
    # One id for the request: the client's (message id and id_header), the request log's, the router's, the rank's.
    record = RequestRecord(request_id=api.new_id(), api=api.name)
    name_request(record.request_id, api.id_header)
    try:
        key = authenticate(request)
        body = await parse_request_body(request, api.schema)
        record.model = body.model  # type: ignore[attr-defined]
        check_model_allowed(request, key, record.model)
        generation = ready_generation(request)
        chat = await chat_from_body(request, api.to_chat, body, request.headers.get(api.session_header, ""))
        record.session = chat.session_id
        # Off the event loop: tokenizing a long agent prompt takes tens of milliseconds (the tokenizer lets go
        # of the GIL), and the loop meanwhile streams every other request's tokens.
        tokenize_started = time.monotonic()
        prepared = await prepare_off_loop(request, generation, chat, record.request_id)
        record.tokenize_s = time.monotonic() - tokenize_started
        record.prompt_tokens = prepared.prompt_tokens
        record.prompt_text = prepared.prompt_text if state.config.log_prompts else ""
        opened = await generation.open(prepared, arrived)
        record.prepare_s = time.monotonic() - arrived
        # The prompt is built and the rank's stream open: the answer needs only the body's scalars (model,
        # stream flags), so its parsed objects are freed and its share of the body budget goes back now.
        await release_body(request.scope.setdefault("state", {}))
    except Exception as exc:
        error = api_error_for(exc, record.request_id)
        record_failure(state, record, error)
        try:
            raise error from exc
        finally:
            # This frame is on the error's traceback: holding it here would be a cycle that keeps the body,
            # conversation and prompt until a garbage collection (seconds over a large body), not until sent.
            del error

    def finished(finish: Finish | None, failure: ApiError | None) -> None:
        record_end(state, record, finish, failure, api.finish_reason(finish) if finish else "", opened)

    if not body.stream:  # type: ignore[attr-defined]
        try:
            events = await collect(opened, request)
        except Exception as exc:
            error = api_error_for(exc, record.request_id)
            finished(None, error)
            try:
                raise error from exc
            finally:
                del error  # as above: no cycle through this frame
        finished(next((e for e in events if isinstance(e, Finish)), None), None)
        return JSONResponse(api.whole_response(record.request_id, body, events))

    write, write_error = api.stream_writers(record.request_id, body, prepared, opened)
    return StreamingResponse(
        stream_bytes(opened, write, write_error, finished),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


def authenticate(request: Request) -> KeyEntry | None:
    """None in open-local mode; otherwise the caller's key, or 401."""
    keys = gateway_state(request).keys
    if keys is None:
        return None
    try:
        return keys.authenticate(request.headers.get("x-api-key"), request.headers.get("authorization"))
    except AuthError as exc:
        raise ApiError(401, "authentication_error", str(exc)) from exc


def check_model_allowed(request: Request, key: KeyEntry | None, model: str) -> None:
    """403 unless the key may use `model`, by any of the served model's names (an alias and the served name are
    one scope); 503 while no rank has said which names those are and the name alone does not decide."""
    if key is None:
        return
    served = gateway_state(request).model
    if key.allows(model, served.names if served is not None else ()):
        return
    if served is None:
        raise not_ready()
    raise ApiError(403, "permission_error", f"this API key may not use model {model!r}")


def check_metrics_allowed(key: KeyEntry | None) -> None:
    """/metrics is a scope of its own: a key for the models does not show the whole gateway's traffic."""
    if key is not None and not key.reads_metrics:
        raise ApiError(
            403,
            "permission_error",
            "this API key may not read /metrics: it needs the metrics scope "
            "(`kvserve keys create --name NAME --metrics`)",
        )


def not_ready() -> ApiError:
    return ApiError(503, "api_error", "the gateway is still waiting for a rank worker", retry_after_s=2)


def ready_generation(request: Request) -> Generation:
    generation = gateway_state(request).generation
    if generation is None:
        raise not_ready()
    return generation


async def chat_from_body(
    request: Request, to_chat: Callable[[Any, str], ChatRequest], body: Any, session: str
) -> ChatRequest:
    """The API body as a checked ChatRequest, converted off the event loop (a long conversation takes
    seconds of Python); InvalidChat for a conversation that cannot be served."""

    def convert() -> ChatRequest:
        chat = to_chat(body, session)
        check_conversation(chat)
        return chat

    return await work_for_body(request, convert)


async def prepare_off_loop(
    request: Request, generation: Generation, chat: ChatRequest, request_id: str
) -> PreparedRequest:
    """generation.prepare off the event loop (a prompt that cannot fit is a PromptTooLong: a 400)."""
    return await work_for_body(request, generation.prepare, chat, request_id)


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
    write: EventWriter,
    write_error: ErrorWriter,
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
