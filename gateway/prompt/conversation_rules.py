"""What every conversation must satisfy before it is rendered, whatever its API."""

from __future__ import annotations

from gateway.http.errors import InvalidChat
from gateway.prompt.chat import ChatRequest


def check_conversation(chat: ChatRequest) -> None:
    """A tool result answers a tool call: one before any assistant tool call (a conversation that starts
    with a result) is refused, as Anthropic and OpenAI refuse it; the prompt formats assume a call came first."""
    called = False
    for message in chat.messages:
        if message.role == "assistant" and message.tool_calls:
            called = True
        elif message.role == "tool" and not called:
            raise InvalidChat(
                "messages: a tool result must answer a tool call of an earlier assistant message, and this one "
                f"comes before any (tool_use_id / tool_call_id {message.tool_call_id[:64]!r})"
            )
