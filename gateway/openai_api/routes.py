"""HTTP routes of the OpenAI Chat Completions API: /v1/chat/completions."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.accounting import record_end, record_failure
from gateway.generation import Finish, GenerationEvent
from gateway.openai_api.convert import to_chat
from gateway.openai_api.respond import FINISH_REASONS, ChunkStreamWriter, CompletionBuilder
from gateway.openai_api.schema import ChatCompletionRequest
from gateway.request_flow import ApiError, api_error_for, collect, stream_bytes
from gateway.request_log import RequestRecord
from gateway.route_support import authenticate, check_model_allowed, gateway_state, parse_body, ready_generation

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Any:
    state = gateway_state(request)
    record = RequestRecord(request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}", api="openai")
    try:
        key = authenticate(request)
        body = await parse_body(request, ChatCompletionRequest)
        record.model = body.model
        check_model_allowed(key, body.model)
        generation = ready_generation(request)
        chat = to_chat(body, request.headers.get("x-session-id", ""))
        record.session = chat.session_id
        prepared = generation.prepare(chat)
        record.prompt_tokens = prepared.prompt_tokens
        record.prompt_text = prepared.prompt_text if state.config.log_prompts else ""
        opened = await generation.open(prepared)
    except Exception as exc:
        error = api_error_for(exc)
        record_failure(state, record, error)
        raise error from exc

    def finished(finish: Finish | None, failure: ApiError | None) -> None:
        record_end(state, record, finish, failure, FINISH_REASONS[finish.reason] if finish else "")

    if not body.stream:
        try:
            events = await collect(opened, request)
        except Exception as exc:
            error = api_error_for(exc)
            finished(None, error)
            raise error from exc
        builder = CompletionBuilder(record.request_id, body.model)
        for event in events:
            builder.add(event)
        finished(builder.finish, None)
        return JSONResponse(builder.result())

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    writer = ChunkStreamWriter(record.request_id, body.model, include_usage)

    def write(event: GenerationEvent) -> bytes:
        return writer.write(event)

    def write_error(error: ApiError) -> bytes:
        return writer.error(error.message, error.kind)

    return StreamingResponse(
        stream_bytes(opened, write, write_error, finished),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )
