"""The API-neutral conversation the gateway works on: both Anthropic Messages and OpenAI Chat Completions
requests are converted into a ChatRequest, and every response is built from OutputEvents."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]  # the tool input, as a JSON object


@dataclass
class ChatMessage:
    role: Role
    content: str = ""  # text (for role "tool": the tool's result)
    reasoning: str = ""  # assistant thinking, when the conversation carries it back
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant only
    tool_call_id: str = ""  # role "tool": which call this answers
    tool_name: str = ""  # role "tool": the called tool's name, when known
    is_error: bool = False  # role "tool": the tool failed


@dataclass
class ToolChoice:
    mode: Literal["auto", "any", "none", "tool"] = "auto"
    name: str = ""  # mode "tool": the tool that must be called


@dataclass
class ChatRequest:
    messages: list[ChatMessage]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    max_tokens: int | None = None  # an upper bound; clamped to what the context leaves
    temperature: float | None = None  # None: the deployment's default (default_temperature, else 1.0)
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False  # benchmark extension: no stop at EOS, exactly max_tokens
    stop: list[str] = field(default_factory=list)
    reasoning: bool | None = None  # thinking on/off; None = the model's default
    session_id: str = ""
    model: str = ""
