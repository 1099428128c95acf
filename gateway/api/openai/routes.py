"""HTTP routes of the OpenAI Chat Completions API: /v1/chat/completions; registered with its metrics label and
its error shape."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.openai.convert import to_chat
from gateway.api.openai.respond import (
    FINISH_REASONS,
    ChunkStreamWriter,
    CompletionBuilder,
    error_document,
    too_large_document,
)
from gateway.api.openai.schema import ChatCompletionRequest
from gateway.flow import ErrorWriter, EventWriter, serve_chat
from gateway.http.apis import RegisteredApi
from gateway.prompt.chat import ChatRequest
from gateway.ranks.generation import Finish, GenerationEvent, OpenGeneration, PreparedRequest

router = APIRouter()
API = RegisteredApi(
    name="openai",
    router=router,
    path_prefix="/v1/chat/",
    chat_path="/v1/chat/completions",
    error_document=error_document,
    too_large_document=too_large_document,
)


class OpenAiChatCompletions:
    name = API.name
    schema = ChatCompletionRequest
    session_header = "x-session-id"
    id_header = "x-request-id"  # as OpenAI's; here it is the completion id

    def new_id(self) -> str:
        return f"chatcmpl-{uuid.uuid4().hex[:24]}"

    def to_chat(self, body: ChatCompletionRequest, session: str) -> ChatRequest:
        return to_chat(body, session)

    def finish_reason(self, finish: Finish) -> str:
        return FINISH_REASONS[finish.reason]

    def whole_response(
        self, request_id: str, body: ChatCompletionRequest, events: list[GenerationEvent]
    ) -> dict[str, Any]:
        builder = CompletionBuilder(request_id, body.model)
        for event in events:
            builder.add(event)
        return builder.result()

    def stream_writers(
        self, request_id: str, body: ChatCompletionRequest, prepared: PreparedRequest, opened: OpenGeneration
    ) -> tuple[EventWriter, ErrorWriter]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = ChunkStreamWriter(request_id, body.model, include_usage)
        return writer.write, lambda error: writer.error(error.message, error.kind)


CHAT_COMPLETIONS = OpenAiChatCompletions()


@router.post(API.chat_path)
async def create_chat_completion(request: Request) -> Response:
    return await serve_chat(request, CHAT_COMPLETIONS)
