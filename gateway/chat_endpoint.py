"""The flow every chat endpoint shares, whatever its wire format: authenticate, parse, prepare (refusals
before any rank work), open a rank stream (refusals before any response), then answer in one piece or
as a stream, and account for the request at the end. Each API supplies a ChatApi with its formats."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from gateway.accounting import name_request, record_end, record_failure
from gateway.body_admission import release_body
from gateway.body_parse import work_for_body
from gateway.chat import ChatRequest, InvalidChat
from gateway.conversation_rules import check_conversation
from gateway.generation import Finish, Generation, GenerationEvent, OpenGeneration, PreparedRequest
from gateway.request_flow import ApiError, api_error_for, collect, stream_bytes
from gateway.request_log import RequestRecord
from gateway.route_support import authenticate, check_model_allowed, gateway_state, parse_body, ready_generation

EventWriter = Callable[[GenerationEvent], bytes]
ErrorWriter = Callable[[ApiError], bytes]


class ChatApi(Protocol):
    name: str  # "anthropic" | "openai": metrics and log label
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
        body = await parse_body(request, api.schema)
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


async def chat_from_body(
    request: Request, to_chat: Callable[[Any, str], ChatRequest], body: Any, session: str
) -> ChatRequest:
    """The API body as a checked ChatRequest, converted off the event loop (a long conversation takes
    seconds of Python); ApiError 400 for a conversation that cannot be served."""

    def convert() -> ChatRequest:
        chat = to_chat(body, session)
        check_conversation(chat)
        return chat

    try:
        return await work_for_body(request, convert)
    except InvalidChat as exc:
        raise ApiError(400, "invalid_request_error", str(exc)) from exc


async def prepare_off_loop(
    request: Request, generation: Generation, chat: ChatRequest, request_id: str
) -> PreparedRequest:
    """generation.prepare off the event loop (a prompt that cannot fit, PromptTooLong, is api_error_for's 400)."""
    return await work_for_body(request, generation.prepare, chat, request_id)
