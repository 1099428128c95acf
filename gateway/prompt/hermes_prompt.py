"""Tools, calls, results and reasoning folded into plain messages, Hermes style, for chat templates that
know nothing of tools (SmolLM2's ChatML): the template then only sees system/user/assistant text."""

from __future__ import annotations

from typing import Any

from gateway.prompt.chat import ChatMessage, ChatRequest, ToolSpec
from gateway.prompt.conversation import (
    call_json,
    function_schema,
    join_sections,
    system_prompt,
    to_json,
    tool_choice_line,
    tool_result_text,
    tools_in_force,
)


def hermes_messages(chat: ChatRequest, *, thinks: bool) -> list[dict[str, Any]]:
    system, rest = system_prompt(chat.messages)
    tools = tools_in_force(chat)
    choice = tool_choice_line(chat.tool_choice, tools)
    system_text = join_sections(hermes_tools_section(tools), system.shared, system.session, choice)
    messages: list[dict[str, Any]] = []
    if system.shared is not None or system_text:
        messages.append({"role": "system", "content": system_text})
    results_at: int | None = None  # index of the user message collecting the latest run of tool results
    for message in rest:
        if message.role == "tool":
            block = f"<tool_response>\n{tool_result_text(message)}\n</tool_response>"
            if messages and results_at == len(messages) - 1:
                messages[-1]["content"] += "\n" + block
            else:
                messages.append({"role": "user", "content": block})
                results_at = len(messages) - 1
        elif message.role == "assistant":
            messages.append({"role": "assistant", "content": hermes_assistant_text(message, thinks=thinks)})
        else:
            messages.append({"role": message.role, "content": message.content})
    return messages


def hermes_tools_section(tools: list[ToolSpec]) -> str:
    if not tools:
        return ""
    listing = "\n".join(to_json({"type": "function", "function": function_schema(tool)}) for tool in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request.\n\n"
        "The functions you can call are described by their JSON signatures inside <tools></tools>:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> "
        "tags, one block per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n\n'
        "Each result comes back inside <tool_response></tool_response> tags."
    )


def hermes_assistant_text(message: ChatMessage, *, thinks: bool) -> str:
    text = message.content
    if thinks and message.reasoning:
        text = f"<think>\n{message.reasoning}\n</think>\n\n{text}"
    calls = [f"<tool_call>\n{call_json(call)}\n</tool_call>" for call in message.tool_calls]
    return "\n".join(part for part in (text, *calls) if part)
