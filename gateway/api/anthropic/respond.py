"""Generation events -> an Anthropic Message, or its SSE event stream, in the order the API defines:
message_start, per block (content_block_start, deltas, content_block_stop), message_delta, message_stop."""

from __future__ import annotations

import json
from typing import Any

from gateway.http.errors import ApiError
from gateway.parsing.events import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gateway.ranks.generation import Finish, GenerationEvent, Ping, Usage

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}


def usage_json(usage: Usage) -> dict[str, int]:
    """input_tokens excludes what was read from cache (cache_read_input_tokens carries that)."""
    return {
        "input_tokens": usage.uncached_tokens,
        "output_tokens": usage.output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def error_json(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_document(error: ApiError) -> dict[str, Any]:
    return error_json(error.kind, error.message)


def too_large_document(message: str) -> dict[str, Any]:
    return error_json("request_too_large", message)


def message_shell(message_id: str, model: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
    }


class MessageBuilder:
    """Collects events into the non-streaming response."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message = message_shell(message_id, model)
        self._args: dict[int, list[str]] = {}
        self._blocks: dict[int, dict[str, Any]] = {}

    def add(self, event: GenerationEvent) -> None:
        content = self.message["content"]
        last = content[-1] if content else None
        if isinstance(event, TextDelta):
            if last is None or last["type"] != "text":
                content.append({"type": "text", "text": ""})
            content[-1]["text"] += event.text
        elif isinstance(event, ReasoningDelta):
            if last is None or last["type"] != "thinking":
                content.append({"type": "thinking", "thinking": "", "signature": ""})
            content[-1]["thinking"] += event.text
        elif isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            content.append(block)
            self._blocks[event.index] = block
            self._args[event.index] = []
        elif isinstance(event, ToolCallArgumentsDelta):
            self._args[event.index].append(event.fragment)
        elif isinstance(event, ToolCallEnd):
            self._blocks[event.index]["input"] = _parse_arguments("".join(self._args[event.index]))
        elif isinstance(event, Finish):
            self.message["stop_reason"] = STOP_REASONS[event.reason]
            self.message["stop_sequence"] = event.stop_sequence
            self.message["usage"] = usage_json(event.usage)
            self.message["content"] = [b for b in content if b["type"] != "text" or b["text"]]

    def result(self) -> dict[str, Any]:
        return self.message


def _parse_arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class EventStreamWriter:
    """Turns generation events into SSE bytes; keeps at most one content block open at a time."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.started = False
        self._index = -1  # index of the current block
        self._open: str | None = None  # type of the open block

    def start(self, usage: Usage) -> bytes:
        self.started = True
        message = message_shell(self.message_id, self.model)
        message["usage"] = {**usage_json(usage), "output_tokens": 0}
        return sse("message_start", {"type": "message_start", "message": message})

    def write(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Ping):
            return sse("ping", {"type": "ping"})
        if isinstance(event, TextDelta):
            return self._ensure("text", {"type": "text", "text": ""}) + self._delta(
                {"type": "text_delta", "text": event.text}
            )
        if isinstance(event, ReasoningDelta):
            return self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""}) + self._delta(
                {"type": "thinking_delta", "thinking": event.text}
            )
        if isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            return self._close() + self._begin("tool_use", block)
        if isinstance(event, ToolCallArgumentsDelta):
            return self._delta({"type": "input_json_delta", "partial_json": event.fragment})
        if isinstance(event, ToolCallEnd):
            return self._close()
        if isinstance(event, Finish):
            delta = {"stop_reason": STOP_REASONS[event.reason], "stop_sequence": event.stop_sequence}
            return (
                self._close()
                + sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_json(event.usage)})
                + sse("message_stop", {"type": "message_stop"})
            )
        raise TypeError(f"unexpected event {event!r}")

    def error(self, error_type: str, message: str) -> bytes:
        return sse("error", error_json(error_type, message))

    def _ensure(self, kind: str, block: dict[str, Any]) -> bytes:
        if self._open == kind:
            return b""
        return self._close() + self._begin(kind, block)

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        self._index += 1
        self._open = kind
        return sse("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":
            out += self._delta({"type": "signature_delta", "signature": ""})
        self._open = None
        return out + sse("content_block_stop", {"type": "content_block_stop", "index": self._index})
