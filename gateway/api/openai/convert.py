"""OpenAI Chat Completions request -> the gateway's ChatRequest."""

from __future__ import annotations

from gateway.api.openai.schema import ChatCompletionRequest, ChatMessageIn
from gateway.http.errors import InvalidChat, InvalidDocument
from gateway.http.json_document import parse_document
from gateway.prompt.chat import ChatMessage, ChatRequest, Role, ToolCall, ToolChoice, ToolSpec

_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}


def to_chat(body: ChatCompletionRequest, session_header: str = "") -> ChatRequest:
    names: dict[str, str] = {}  # tool_call_id -> tool name, so results can name their tool
    messages = []
    for message in body.messages:
        converted = _convert(message, names)
        messages.append(converted)
    stop = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
    return ChatRequest(
        messages=messages,
        tools=[
            ToolSpec(t.function.name, t.function.description or "", t.function.parameters or {})
            for t in body.tools or []
        ],
        tool_choice=_tool_choice(body.tool_choice),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        stop=[s for s in stop if s],
        reasoning=None if body.reasoning_effort is None else body.reasoning_effort != "none",
        session_id=session_header or (body.user or ""),
        model=body.model,
    )


def _convert(message: ChatMessageIn, names: dict[str, str]) -> ChatMessage:
    role = _ROLES.get(message.role)
    if role is None:
        raise InvalidChat(f"messages: unknown role {message.role!r}")
    content = message.content
    if isinstance(content, list):
        content = "\n\n".join(part.text or "" for part in content if part.type == "text")
    out = ChatMessage(role, content or "", reasoning=message.reasoning_content or "")
    for call in message.tool_calls or []:
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = parse_document(arguments, "arguments") if arguments.strip() else {}
            except InvalidDocument as exc:
                raise InvalidChat(f"tool call {call.id[:64]}: {exc}") from exc
        out.tool_calls.append(ToolCall(call.id, call.function.name, arguments if isinstance(arguments, dict) else {}))
        names[call.id] = call.function.name
    if role == "tool":
        out.tool_call_id = message.tool_call_id or ""
        out.tool_name = names.get(out.tool_call_id, message.name or "")
    return out


def _tool_choice(choice: str | dict | None) -> ToolChoice:
    if choice is None or choice == "auto":
        return ToolChoice()
    if choice == "none":
        return ToolChoice("none")
    if choice == "required":
        return ToolChoice("any")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name", "")
        return ToolChoice("tool", name) if name else ToolChoice()
    raise InvalidChat(f"tool_choice {choice!r} is not one of none, auto, required or a function")
