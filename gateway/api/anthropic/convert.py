"""Anthropic Messages request -> the gateway's ChatRequest."""

from __future__ import annotations

from typing import Any

from gateway.api.anthropic.schema import ContentBlock, CountTokensRequest, Message, MessagesRequest
from gateway.http.errors import InvalidChat, InvalidDocument
from gateway.http.json_document import parse_document
from gateway.prompt.chat import ChatMessage, ChatRequest, ToolCall, ToolChoice, ToolSpec
from gateway.prompt.claude_code import map_role, strip_attribution


def to_chat(body: CountTokensRequest, session_header: str = "") -> ChatRequest:
    messages: list[ChatMessage] = []
    system = _system_text(body.system)
    if system:
        messages.append(ChatMessage("system", system))
    for message in body.messages:
        messages.extend(_convert_message(message))
    chat = ChatRequest(
        messages=messages,
        tools=[_tool(t) for t in body.tools or [] if t.input_schema is not None or t.type in (None, "custom")],
        tool_choice=_tool_choice(body),
        reasoning=_reasoning(body),
        model=body.model,
    )
    if isinstance(body, MessagesRequest):
        chat.max_tokens = body.max_tokens
        chat.temperature = body.temperature
        chat.top_p = body.top_p
        chat.top_k = body.top_k or 0
        chat.ignore_eos = body.ignore_eos
        chat.stop = [s for s in body.stop_sequences or [] if s]
        chat.session_id = session_header or session_from_metadata(body.metadata)
    else:
        chat.session_id = session_header
    return chat


def session_from_metadata(metadata: dict[str, Any] | None) -> str:
    """Claude Code puts a JSON string {device_id, account_uuid, session_id} in metadata.user_id."""
    user_id = (metadata or {}).get("user_id")
    if not isinstance(user_id, str) or not user_id:
        return ""
    try:
        parsed = parse_document(user_id, "metadata.user_id")
    except InvalidDocument:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
        return parsed["session_id"]
    marker = "_session_"  # older Claude Code: user_<hash>_account_<uuid>_session_<uuid>
    return user_id.split(marker, 1)[1] if marker in user_id else user_id


def _system_text(system: str | list[ContentBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return strip_attribution(system)
    texts = [strip_attribution(block.text or "") for block in system if block.type == "text"]
    return "\n\n".join(t for t in texts if t)


def _convert_message(message: Message) -> list[ChatMessage]:
    role = map_role(message.role)
    if role is None:
        raise InvalidChat(f"messages: unknown role {message.role!r}")
    if isinstance(message.content, str):
        return [ChatMessage(role, message.content)]
    out: list[ChatMessage] = []
    current = ChatMessage(role)
    texts: list[str] = []

    def flush() -> None:
        nonlocal current, texts
        current.content = "\n\n".join(texts)
        if current.content or current.tool_calls or current.reasoning:
            out.append(current)
        current, texts = ChatMessage(role), []

    for block in message.content:
        kind = block.type
        if kind == "text":
            texts.append(block.text or "")
        elif kind == "tool_use" and role == "assistant":
            arguments = block.input if isinstance(block.input, dict) else {}
            current.tool_calls.append(ToolCall(block.id or "", block.name or "", arguments))
        elif kind == "tool_result":
            flush()
            out.append(
                ChatMessage(
                    "tool",
                    _flatten(block.content),
                    tool_call_id=block.tool_use_id or "",
                    is_error=bool(block.is_error),
                )
            )
        elif kind == "thinking" and role == "assistant":
            current.reasoning += block.thinking or ""
        elif kind == "image":
            texts.append("[image]")
        elif kind == "document":
            texts.append(_document_text(block))
        # redacted_thinking, server tool blocks, tool_reference, ...: nothing the model can read
    flush()
    return out


def _flatten(content: str | list[ContentBlock] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if block.type == "text":
            parts.append(block.text or "")
        elif block.type == "image":
            parts.append("[image]")
    return "\n\n".join(parts)


def _document_text(block: ContentBlock) -> str:
    source = getattr(block, "source", None)
    if isinstance(source, dict) and source.get("type") == "text":
        return str(source.get("data", ""))
    return "[document]"


def _tool(tool: Any) -> ToolSpec:
    return ToolSpec(tool.name, tool.description or "", tool.input_schema or {"type": "object", "properties": {}})


def _tool_choice(body: CountTokensRequest) -> ToolChoice:
    choice = body.tool_choice
    if choice is None:
        return ToolChoice()
    if choice.type == "tool":
        return ToolChoice("tool", choice.name or "")
    if choice.type in ("auto", "any", "none"):
        return ToolChoice(choice.type)  # type: ignore[arg-type]
    return ToolChoice()


def _reasoning(body: CountTokensRequest) -> bool | None:
    if body.thinking is None:
        return None
    return body.thinking.type in ("enabled", "adaptive")
