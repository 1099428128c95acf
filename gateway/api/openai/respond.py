"""Generation events -> an OpenAI chat.completion, or its chat.completion.chunk SSE stream."""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.http.errors import ApiError
from gateway.parsing.events import ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from gateway.ranks.generation import Finish, GenerationEvent, Ping, Usage

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "stop_sequence": "stop"}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.prompt_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def error_json(message: str, error_type: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def error_document(error: ApiError) -> dict[str, Any]:
    return error_json(error.message, error.kind, "overloaded" if error.status == 529 else None)


def too_large_document(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": "request_too_large"}}


class CompletionBuilder:
    def __init__(self, completion_id: str, model: str) -> None:
        self.id, self.model, self.created = completion_id, model, int(time.time())
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: Finish | None = None

    def add(self, event: GenerationEvent) -> None:
        if isinstance(event, TextDelta):
            self.content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            self.calls[event.index] = {
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
        elif isinstance(event, ToolCallArgumentsDelta):
            self.calls[event.index]["function"]["arguments"] += event.fragment
        elif isinstance(event, Finish):
            self.finish = event

    def result(self) -> dict[str, Any]:
        assert self.finish is not None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "finish_reason": FINISH_REASONS[self.finish.reason], "logprobs": None}
            ],
            "usage": usage_json(self.finish.usage),
        }


class ChunkStreamWriter:
    def __init__(self, completion_id: str, model: str, include_usage: bool) -> None:
        self.id, self.model, self.created = completion_id, model, int(time.time())
        self.include_usage = include_usage
        self._sent_role = False

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        if not self._sent_role:
            delta = {"role": "assistant", **delta}
            self._sent_role = True
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        }
        return _data(body)

    def write(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Ping):
            return b": ping\n\n"  # an SSE comment: keeps the connection alive, ignored by clients
        if isinstance(event, TextDelta):
            return self._chunk({"content": event.text})
        if isinstance(event, ReasoningDelta):
            return self._chunk({"reasoning_content": event.text})
        if isinstance(event, ToolCallStart):
            call = {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            return self._chunk({"tool_calls": [call]})
        if isinstance(event, ToolCallArgumentsDelta):
            return self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]})
        if isinstance(event, ToolCallEnd):
            return b""
        if isinstance(event, Finish):
            out = self._chunk({}, FINISH_REASONS[event.reason])
            if self.include_usage:
                out += _data(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage_json(event.usage),
                    }
                )
            return out + b"data: [DONE]\n\n"
        raise TypeError(f"unexpected event {event!r}")

    def error(self, message: str, error_type: str) -> bytes:
        return _data(error_json(message, error_type)) + b"data: [DONE]\n\n"


def _data(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
