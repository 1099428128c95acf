"""Tools, calls and results in DeepSeek's DSML form (V3.2 and later), as plain messages for the template.

DeepSeek's own encoder (encoding_dsv32.py) puts tool schemas after the system text, writes calls as a
DSML block after the assistant's text, and returns results in <function_results>. A Jinja template has
no slot for results after an assistant turn, so here they form the next user turn."""

from __future__ import annotations

from typing import Any

from gateway.chat import ChatMessage, ChatRequest, ToolCall, ToolSpec
from gateway.prompt.conversation import (
    function_schema,
    join_sections,
    split_system,
    to_json,
    tool_choice_line,
    tool_result_text,
    tools_in_force,
)

DSML = "｜DSML｜"


def dsml_messages(chat: ChatRequest) -> list[dict[str, Any]]:
    system, rest = split_system(chat.messages)
    tools = tools_in_force(chat)
    system_text = join_sections(system, dsml_tools_section(tools, tool_choice_line(chat.tool_choice, tools)))
    messages: list[dict[str, Any]] = []
    if system is not None or system_text:
        messages.append({"role": "system", "content": system_text})
    pending_results: list[str] = []
    for message in rest:
        if message.role == "tool":
            pending_results.append(f"<result>{tool_result_text(message)}</result>")
            continue
        if pending_results:
            messages.append(_results_message(pending_results))
            pending_results = []
        if message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": dsml_assistant_text(message)}
            if message.reasoning:
                entry["reasoning_content"] = message.reasoning  # for templates that render past thinking
            messages.append(entry)
        else:
            messages.append({"role": message.role, "content": message.content})
    if pending_results:
        messages.append(_results_message(pending_results))
    return messages


def dsml_tools_section(tools: list[ToolSpec], choice_line: str = "") -> str:
    if not tools:
        return ""
    schemas = "\n".join(to_json(function_schema(tool)) for tool in tools)
    section = (
        "## Tools\n\n"
        "You can use tools to answer the user. To call them, write a block like this in your reply:\n"
        f"<{DSML}function_calls>\n"
        f'<{DSML}invoke name="$FUNCTION_NAME">\n'
        f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
        "...\n"
        f"</{DSML}invoke>\n"
        f'<{DSML}invoke name="$FUNCTION_NAME2">\n'
        "...\n"
        f"</{DSML}invoke>\n"
        f"</{DSML}function_calls>\n\n"
        'Write strings as they are, without quotes or escaping, with string="true". Write numbers, booleans, '
        'arrays and objects as JSON, with string="false".\n\n'
        "The results come back inside <function_results></function_results>, one <result> per call, in order.\n\n"
        f"The functions available, as JSON schemas:\n<functions>\n{schemas}\n</functions>"
    )
    return join_sections(section, choice_line)


def dsml_assistant_text(message: ChatMessage) -> str:
    if not message.tool_calls:
        return message.content
    invokes = "\n".join(_invoke(call) for call in message.tool_calls)
    return join_sections(message.content, f"<{DSML}function_calls>\n{invokes}\n</{DSML}function_calls>")


def _invoke(call: ToolCall) -> str:
    parameters = []
    for key, value in call.arguments.items():
        is_string = isinstance(value, str)
        text = value if is_string else to_json(value)
        parameters.append(
            f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">{text}</{DSML}parameter>'
        )
    return "\n".join([f'<{DSML}invoke name="{call.name}">', *parameters, f"</{DSML}invoke>"])


def _results_message(results: list[str]) -> dict[str, Any]:
    return {"role": "user", "content": "<function_results>\n" + "\n".join(results) + "\n</function_results>"}
