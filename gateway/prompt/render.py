"""A ChatRequest rendered into the prompt text its model was trained on, through the model's own template.

Three ways to show tools, calls, results and reasoning, by what the model knows:
- the DeepSeek family (V2, V3, V3.2...): DeepSeek's turns with DSML calls, written by deepseek_prompt
  without the template (its docstring says why);
- its template handles tools itself (Qwen2.5/Qwen3): Hugging Face structures, the template decides;
- anything else (SmolLM2): Hermes <tool_call> JSON, folded into plain messages (hermes_prompt).
The same request always renders to the same text, and a conversation that only grows renders to a
text that only grows: both are what lets the KV cache reuse earlier turns. Across sessions, the tool
definitions and the system text every session shares come first, what names the project and the day last in
the system turn (conversation.system_prompt): a new project's first request reads the rest from the cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from contracts.model_types import PROMPT_FAMILIES
from gateway.http.errors import ChatTemplateError
from gateway.prompt.chat import ChatMessage, ChatRequest
from gateway.prompt.chat_template import render_chat
from gateway.prompt.conversation import (
    function_schema,
    join_sections,
    system_prompt,
    tool_choice_line,
    tool_result_text,
    tools_in_force,
)
from gateway.prompt.deepseek_prompt import deepseek_prompt, markers_for
from gateway.prompt.family import family_for, prompt_opens_reasoning, thinks
from gateway.prompt.hermes_prompt import hermes_messages

__all__ = ["ModelTemplate", "family_for", "prompt_opens_reasoning", "render_prompt", "thinks"]

_MENTIONS_TOOLS = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ModelTemplate:
    chat_template: str  # Jinja source, from the model's tokenizer files
    bos_token: str = ""
    eos_token: str = ""
    family: str = "hermes"  # tool call markup: "hermes" or "deepseek_dsml"
    thinks: bool = False  # the model writes <think> reasoning

    def __post_init__(self) -> None:
        if self.family not in PROMPT_FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {', '.join(PROMPT_FAMILIES)}")

    @classmethod
    def for_model(
        cls,
        model_id: str,
        chat_template: str,
        bos_token: str = "",
        eos_token: str = "",
        vocab: set[str] | None = None,
        model_type: str = "",
    ) -> ModelTemplate:
        """Family and thinking detected from the model's architecture (config.json model_type), name, template
        and vocabulary."""
        family = family_for(model_id, chat_template, vocab, model_type)
        return cls(chat_template, bos_token, eos_token, family, thinks(model_id, chat_template, vocab, family))

    @property
    def handles_tools(self) -> bool:
        """The template renders tools, tool calls and tool results itself (Qwen2.5, Qwen3)."""
        return bool(_MENTIONS_TOOLS.search(self.chat_template)) and "tool_calls" in self.chat_template


def render_prompt(chat: ChatRequest, template: ModelTemplate) -> str:
    """The prompt text for `chat`, ending with the template's generation prompt.

    Raises gateway.http.errors.ChatTemplateError when the template refuses the conversation."""
    if template.family == "deepseek_dsml":
        markers = markers_for(template.chat_template)
        return deepseek_prompt(chat, markers, thinks=template.thinks, eos_token=template.eos_token)
    extra: dict[str, Any] = {}
    session = ""
    if template.handles_tools:
        messages, tools, session = _native_messages(chat, template)
        if tools:
            extra["tools"] = tools
    else:
        messages = hermes_messages(chat, thinks=template.thinks)
    if chat.reasoning is not None:
        # Qwen3 reads enable_thinking, some templates thinking; other templates ignore both.
        extra["enable_thinking"] = extra["thinking"] = chat.reasoning

    def render(messages: list[dict[str, Any]]) -> str:
        return render_chat(
            template.chat_template,
            messages,
            bos_token=template.bos_token,
            eos_token=template.eos_token,
            add_generation_prompt=True,
            **extra,
        )

    if session:
        # The template writes the tools after the first system message: the session's part follows them as a
        # system message of its own where the template takes a second one (Qwen2.5's and Qwen3's do).
        try:
            return render([messages[0], {"role": "system", "content": session}, *messages[1:]])
        except ChatTemplateError:
            messages[0]["content"] = join_sections(messages[0]["content"], session)
    return render(messages)


def _native_messages(
    chat: ChatRequest, template: ModelTemplate
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """Hugging Face conventions: tools as {"type": "function", "function": ...}, calls with dict arguments; and the
    system prompt's session part, apart."""
    system, rest = system_prompt(chat.messages)
    tools = tools_in_force(chat)
    system_text = join_sections(system.shared, tool_choice_line(chat.tool_choice, tools))
    messages: list[dict[str, Any]] = []
    if system.shared is not None or system_text:
        messages.append({"role": "system", "content": system_text})
    reasoning_key = "reasoning_content" in template.chat_template
    for message in rest:
        if message.role == "assistant":
            messages.append(_native_assistant(message, reasoning_key=reasoning_key, thinks=template.thinks))
        elif message.role == "tool":
            messages.append(
                {
                    "role": "tool",
                    "content": tool_result_text(message),
                    "tool_call_id": message.tool_call_id,
                    "name": message.tool_name,
                }
            )
        else:
            messages.append({"role": message.role, "content": message.content})
    return messages, [{"type": "function", "function": function_schema(tool)} for tool in tools], system.session


def _native_assistant(message: ChatMessage, *, reasoning_key: bool, thinks: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.reasoning:
        if reasoning_key:
            entry["reasoning_content"] = message.reasoning
        elif thinks:
            entry["content"] = f"<think>\n{message.reasoning}\n</think>\n\n{message.content}"
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls
        ]
    return entry
