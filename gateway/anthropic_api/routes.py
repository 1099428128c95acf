"""HTTP routes of the Anthropic Messages API: /v1/messages, /v1/messages/count_tokens, /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.anthropic_api.convert import to_chat
from gateway.anthropic_api.respond import STOP_REASONS, EventStreamWriter, MessageBuilder
from gateway.anthropic_api.schema import CountTokensRequest, MessagesRequest
from gateway.body_parse import large_body, work_for_body
from gateway.chat import ChatRequest
from gateway.chat_endpoint import ErrorWriter, EventWriter, chat_from_body, serve_chat
from gateway.generation import Finish, GenerationEvent, OpenGeneration, PreparedRequest, Usage
from gateway.memory_return import schedule_memory_return
from gateway.prompt_size import PromptCannotFit
from gateway.request_flow import ApiError, api_error_for
from gateway.route_support import (
    authenticate,
    check_model_allowed,
    gateway_state,
    not_ready,
    parse_body,
    ready_generation,
)

router = APIRouter()


class AnthropicMessages:
    name = "anthropic"
    schema = MessagesRequest
    session_header = "x-claude-code-session-id"  # Claude Code's own, exact session key

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
            prefix = b""
            if not writer.started:  # deferred until now so the cache read is known (it is once a token came)
                prefix = writer.start(Usage(prepared.prompt_tokens, opened.stream.cached_tokens))
            return prefix + writer.write(event)

        def write_error(error: ApiError) -> bytes:
            prefix = b"" if writer.started else writer.start(Usage(prepared.prompt_tokens, 0))
            return prefix + writer.error(error.kind, error.message)

        return write, write_error


MESSAGES = AnthropicMessages()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    return await serve_chat(request, MESSAGES)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    try:
        key = authenticate(request)
        body = await parse_body(request, CountTokensRequest)
        check_model_allowed(key, body.model)
        generation = ready_generation(request)
        chat = await chat_from_body(request, to_chat, body, "")
        return {"input_tokens": await work_for_body(request, generation.count_tokens, chat)}
    except PromptCannotFit as exc:  # no count for what no request could send: the work stays bounded
        raise ApiError(400, "invalid_request_error", str(exc)) from exc
    except Exception as exc:
        raise api_error_for(exc) from exc
    finally:
        if large_body(request):
            schedule_memory_return()


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
