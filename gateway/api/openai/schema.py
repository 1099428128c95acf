"""OpenAI Chat Completions request bodies, parsed leniently (unknown fields accepted and ignored)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessageIn(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolIn(_Lenient):
    type: str = "function"
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    ignore_eos: bool = False  # an extension vLLM also accepts: generate exactly max_tokens
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1)
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    user: str | None = None
    reasoning_effort: str | None = None
