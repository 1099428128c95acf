"""HTTP routes of the Anthropic Messages API: /v1/messages, /v1/messages/count_tokens, /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.accounting import record_end, record_failure
from gateway.anthropic_api.convert import to_chat
from gateway.anthropic_api.respond import STOP_REASONS, EventStreamWriter, MessageBuilder
from gateway.anthropic_api.schema import CountTokensRequest, MessagesRequest
from gateway.generation import Finish, GenerationEvent, Usage
from gateway.request_flow import ApiError, api_error_for, collect, stream_bytes
from gateway.request_log import RequestRecord
from gateway.route_support import authenticate, check_model_allowed, gateway_state, parse_body, ready_generation

router = APIRouter()

SESSION_HEADER = "x-claude-code-session-id"


@router.post("/v1/messages")
async def create_message(request: Request) -> Any:
    state = gateway_state(request)
    record = RequestRecord(request_id=f"msg_{uuid.uuid4().hex[:24]}", api="anthropic")
    try:
        key = authenticate(request)
        body = await parse_body(request, MessagesRequest)
        record.model = body.model
        check_model_allowed(key, body.model)
        generation = ready_generation(request)
        chat = to_chat(body, request.headers.get(SESSION_HEADER, ""))
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
        record_end(state, record, finish, failure, STOP_REASONS[finish.reason] if finish else "")

    if not body.stream:
        try:
            events = await collect(opened, request)
        except Exception as exc:
            error = api_error_for(exc)
            finished(None, error)
            raise error from exc
        builder = MessageBuilder(record.request_id, body.model)
        for event in events:
            builder.add(event)
        finished(next((e for e in events if isinstance(e, Finish)), None), None)
        return JSONResponse(builder.result())

    writer = EventStreamWriter(record.request_id, body.model)

    def write(event: GenerationEvent) -> bytes:
        prefix = b""
        if not writer.started:  # deferred until now so the cache read is known (it is once a token came)
            prefix = writer.start(Usage(prepared.prompt_tokens, opened.stream.cached_tokens))
        return prefix + writer.write(event)

    def write_error(error: ApiError) -> bytes:
        prefix = b"" if writer.started else writer.start(Usage(prepared.prompt_tokens, 0))
        return prefix + writer.error(error.kind, error.message)

    return StreamingResponse(
        stream_bytes(opened, write, write_error, finished),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    key = authenticate(request)
    body = await parse_body(request, CountTokensRequest)
    check_model_allowed(key, body.model)
    generation = ready_generation(request)
    try:
        return {"input_tokens": generation.count_tokens(to_chat(body))}
    except Exception as exc:
        raise api_error_for(exc) from exc


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    authenticate(request)
    model = gateway_state(request).model
    if model is None:
        raise ApiError(503, "api_error", "the gateway is still waiting for a rank worker", retry_after_s=2)
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
        }
        for name in model.names
    ]
    return {"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"], "object": "list"}
