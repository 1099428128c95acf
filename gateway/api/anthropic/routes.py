"""HTTP routes of the Anthropic Messages API: /v1/messages, /v1/messages/count_tokens, /v1/models; registered
with its metrics label and its error shape."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.anthropic.convert import to_chat
from gateway.api.anthropic.respond import (
    STOP_REASONS,
    EventStreamWriter,
    MessageBuilder,
    error_document,
    too_large_document,
)
from gateway.api.anthropic.schema import CountTokensRequest, MessagesRequest
from gateway.flow import (
    ErrorWriter,
    EventWriter,
    authenticate,
    chat_from_body,
    check_model_allowed,
    gateway_state,
    not_ready,
    ready_generation,
    serve_chat,
)
from gateway.http.apis import RegisteredApi
from gateway.http.body_parse import parse_request_body, work_for_body
from gateway.http.errors import ApiError, api_error_for
from gateway.prompt.chat import ChatRequest
from gateway.ranks.generation import Finish, GenerationEvent, OpenGeneration, Ping, PreparedRequest

router = APIRouter()
API = RegisteredApi(
    name="anthropic",
    router=router,
    path_prefix="/v1/messages",
    chat_path="/v1/messages",
    error_document=error_document,
    too_large_document=too_large_document,
)


class AnthropicMessages:
    name = API.name
    schema = MessagesRequest
    session_header = "x-claude-code-session-id"  # Claude Code's own, exact session key
    id_header = "request-id"  # as Anthropic's; here it is the message id

    def new_id(self) -> str:
        return f"msg_{uuid.uuid4().hex[:24]}"

    def to_chat(self, body: MessagesRequest, session: str) -> ChatRequest:
        return to_chat(body, session)

    def finish_reason(self, finish: Finish) -> str:
        return STOP_REASONS[finish.reason]

    def whole_response(self, request_id: str, body: MessagesRequest, events: list[GenerationEvent]) -> dict[str, Any]:
        builder = MessageBuilder(request_id, body.model)
        for event in events:
            builder.add(event)
        return builder.result()

    def stream_writers(
        self, request_id: str, body: MessagesRequest, prepared: PreparedRequest, opened: OpenGeneration
    ) -> tuple[EventWriter, ErrorWriter]:
        writer = EventStreamWriter(request_id, body.model)

        def write(event: GenerationEvent) -> bytes:
            # message_start waits for the first token, which brings the rank's cache use: its usage is what
            # Claude Code keeps. Pings during a long prefill go out before it (clients skip them anywhere).
            if writer.started or isinstance(event, Ping):
                return writer.write(event)
            usage = event.usage if isinstance(event, Finish) else opened.prompt_usage()
            return writer.start(usage) + writer.write(event)

        def write_error(error: ApiError) -> bytes:
            prefix = b"" if writer.started else writer.start(opened.prompt_usage())
            return prefix + writer.error(error.kind, error.message)

        return write, write_error


MESSAGES = AnthropicMessages()


@router.post(API.chat_path)
async def create_message(request: Request) -> Response:
    return await serve_chat(request, MESSAGES)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    try:
        key = authenticate(request)
        body = await parse_request_body(request, CountTokensRequest)
        check_model_allowed(request, key, body.model)
        generation = ready_generation(request)
        chat = await chat_from_body(request, to_chat, body, "")
        # No count for what no request could send: refused (PromptTooLong) by the check /v1/messages makes.
        return {"input_tokens": await work_for_body(request, generation.count_tokens, chat)}
    except Exception as exc:
        raise api_error_for(exc) from exc


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    authenticate(request)
    model = gateway_state(request).model
    if model is None:
        raise not_ready()
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(model.created_at))
    data = [
        {
            "type": "model",
            "id": name,
            "display_name": name,
            "created_at": created,
            "object": "model",
            "created": model.created_at,
            "owned_by": "kvserve",
            "max_model_len": model.max_model_len,  # the context (prompt + output), as vLLM reports it
        }
        for name in model.names
    ]
    return {"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"], "object": "list"}
