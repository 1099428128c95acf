"""What every prompt format takes from a ChatRequest the same way: the system text, the tools in force,
the tool-choice instruction, tool results as text."""

from __future__ import annotations

import json
from typing import Any

from gateway.chat import ChatMessage, ChatRequest, ToolCall, ToolChoice, ToolSpec


def split_system(messages: list[ChatMessage]) -> tuple[str | None, list[ChatMessage]]:
    """The leading system messages as one text (None without any), and the rest of the conversation.

    Templates only treat the first message as the system prompt, so several leading ones are joined."""
    count = 0
    while count < len(messages) and messages[count].role == "system":
        count += 1
    if count == 0:
        return None, messages
    return "\n\n".join(message.content for message in messages[:count]), messages[count:]


def tools_in_force(chat: ChatRequest) -> list[ToolSpec]:
    """tool_choice "none" means the model is not shown any tool."""
    return [] if chat.tool_choice.mode == "none" else chat.tools


def tool_choice_line(choice: ToolChoice, tools: list[ToolSpec]) -> str:
    """An instruction for tool_choice "any"/"tool" (a model cannot be forced otherwise); "" for auto/none."""
    if not tools:
        return ""
    if choice.mode == "any":
        return "In this reply you must call at least one of the tools."
    if choice.mode == "tool" and choice.name:
        return f"In this reply you must call the tool {choice.name}."
    return ""


def join_sections(*sections: str | None) -> str:
    return "\n\n".join(section for section in sections if section)


def tool_result_text(message: ChatMessage) -> str:
    return f"Error: {message.content}" if message.is_error else message.content


def function_schema(tool: ToolSpec) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "parameters": tool.parameters}


def to_json(value: Any) -> str:
    # Not sorted: the schema's own key order is what the client sent, the same on every request.
    return json.dumps(value, ensure_ascii=False)


def call_json(call: ToolCall) -> str:
    return to_json({"name": call.name, "arguments": call.arguments})
