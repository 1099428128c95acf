"""DeepSeek's DSML pieces (V3.2 and later): the tools section of the system text, the calls block an
assistant turn ends with, the <function_results> block that answers it. The turns around them are
deepseek_prompt's."""

from __future__ import annotations

from gateway.prompt.chat import ChatMessage, ToolCall, ToolSpec
from gateway.prompt.conversation import function_schema, to_json, tool_result_text

DSML = "｜DSML｜"


def dsml_tools_section(tools: list[ToolSpec]) -> str:
    if not tools:
        return ""
    schemas = "\n".join(to_json(function_schema(tool)) for tool in tools)
    return (
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


def dsml_calls(calls: list[ToolCall]) -> str:
    """The calls block; "" without calls."""
    if not calls:
        return ""
    invokes = "\n".join(_invoke(call) for call in calls)
    return f"<{DSML}function_calls>\n{invokes}\n</{DSML}function_calls>"


def dsml_results(results: list[ChatMessage]) -> str:
    """Tool results (role "tool" messages), in the order of the calls they answer."""
    lines = "".join(f"\n<result>{tool_result_text(message)}</result>" for message in results)
    return f"<function_results>{lines}\n</function_results>"


def _invoke(call: ToolCall) -> str:
    parameters = []
    for key, value in call.arguments.items():
        is_string = isinstance(value, str)
        text = value if is_string else to_json(value)
        parameters.append(
            f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">{text}</{DSML}parameter>'
        )
    return "\n".join([f'<{DSML}invoke name="{call.name}">', *parameters, f"</{DSML}invoke>"])
