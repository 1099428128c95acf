"""Anthropic Messages request bodies, parsed leniently: unknown fields and block types are accepted and
ignored (Claude Code sends many we do not implement; refusing them would break it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Lenient):
    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None


class Message(_Lenient):
    role: str
    content: str | list[ContentBlock]


class Tool(_Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # server tools (web_search, ...) carry a type and no input_schema


class ToolChoice(_Lenient):
    type: str = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Lenient):
    type: str = "disabled"
    budget_tokens: int | None = None


class CountTokensRequest(_Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)  # nothing to answer: the Messages API refuses it too
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(gt=0)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool = False  # our extension (load generators): generate exactly max_tokens
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
