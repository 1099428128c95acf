"""What every prompt format takes from a ChatRequest the same way: the system text, the tools in force,
the tool-choice instruction, tool results as text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.prompt.chat import ChatMessage, ChatRequest, ToolCall, ToolChoice, ToolSpec
from gateway.prompt.claude_code import split_session_facts


def split_system(messages: list[ChatMessage]) -> tuple[str | None, list[ChatMessage]]:
    """The leading system messages as one text (None without any), and the rest of the conversation.

    Templates only treat the first message as the system prompt, so several leading ones are joined."""
    count = 0
    while count < len(messages) and messages[count].role == "system":
        count += 1
    if count == 0:
        return None, messages
    return "\n\n".join(message.content for message in messages[:count]), messages[count:]


@dataclass(frozen=True)
class SystemPrompt:
    """The system text in two parts, written tools first, then `shared`, then `session` (where a template writes
    the tools after the system text, `session` follows them), so that what every session of a client shares
    comes before what differs between projects and days: the prefix cache reuses only a common beginning. It is
    the order Anthropic's cache reads a request in (tools, system, messages), which Claude Code arranges its
    requests for."""

    shared: str | None  # None without any system message
    session: str  # "" or a section naming this session's project and day (Claude Code's working directory...)


def system_prompt(messages: list[ChatMessage]) -> tuple[SystemPrompt, list[ChatMessage]]:
    """The conversation's system prompt, and the rest of the conversation.

    The system prompt is made of the leading system messages and those right after the first user message:
    Claude Code (2.1.197 and later) sends its environment, agent and skill listing there, and they stay there for
    the whole session. Written in the system turn, the part of them every project shares (most of it) follows the
    shared instructions instead of the user's first message, which names the project (git status) and the task."""
    leading, rest = split_system(messages)
    following = 0
    if rest and rest[0].role == "user":
        while 1 + following < len(rest) and rest[1 + following].role == "system":
            following += 1
    texts = [message.content for message in rest[1 : 1 + following]]
    if following:
        rest = [rest[0], *rest[1 + following :]]
    if leading is None and not texts:
        return SystemPrompt(None, ""), rest
    split = [split_session_facts(text) for text in (leading or "", *texts)]
    shared = join_sections(*(text for text, _ in split))
    facts = [fact for _, found in split for fact in found]
    session = "# This session\n" + "\n".join(f" - {fact}" for fact in facts) if facts else ""
    return SystemPrompt(shared, session), rest


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
