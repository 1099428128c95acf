"""One streaming call to the gateway, Anthropic /v1/messages or OpenAI /v1/chat/completions, timed.

TTFT runs from sending the request to the first content delta (text, thinking or tool input); decode time
from that delta to the last one. Token counts come from the final usage: Anthropic input_tokens excludes
what was read from cache (cache_read_input_tokens), OpenAI prompt_tokens includes it (cached_tokens).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from loadgen.content import ASSISTANT_REPLY, Prompt

Api = Literal["anthropic", "openai"]


@dataclass
class CallOutcome:
    ttft_s: float | None = None
    decode_s: float = 0.0  # first content delta to the last one
    output_tokens: int = 0
    input_tokens: int = 0  # cached ones included
    cached_tokens: int = 0
    error: str | None = None  # "http 529", "overloaded_error", "ReadTimeout: ..."; None = answered


def request_body(
    api: Api, model: str, prompt: Prompt, max_tokens: int, ignore_eos: bool, session_id: str
) -> dict[str, Any]:
    """The streaming request body; the session id goes where each API's clients put it."""
    conversation = conversation_of(prompt)
    if api == "anthropic":
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "messages": conversation,
            "metadata": {"user_id": json.dumps({"session_id": session_id})},
        }
        if prompt.system:
            body["system"] = prompt.system
    else:
        messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [*messages, *conversation],
            "user": session_id,
        }
    if ignore_eos:
        body["ignore_eos"] = True  # the gateway's extension: generate exactly max_tokens
    return body


def conversation_of(prompt: Prompt) -> list[dict[str, str]]:
    """The prompt's messages after the system prompt: its user text, or with --messages one user message per turn
    and the fixed reply between them."""
    if not prompt.user_turns:
        return [{"role": "user", "content": prompt.user}]
    conversation: list[dict[str, str]] = []
    for part in prompt.user_turns:
        conversation += [{"role": "user", "content": part}, {"role": "assistant", "content": ASSISTANT_REPLY}]
    return conversation[:-1]


def endpoint(api: Api) -> str:
    return "/v1/messages" if api == "anthropic" else "/v1/chat/completions"


class _StreamState:
    """Folds SSE data payloads into a CallOutcome, remembering content delta times."""

    def __init__(self, api: Api, started: float) -> None:
        self.api = api
        self.started = started
        self.first: float | None = None
        self.last: float | None = None
        self.outcome = CallOutcome()

    def content_delta(self, now: float) -> None:
        if self.first is None:
            self.first = now
        self.last = now

    def feed(self, data: dict[str, Any], now: float) -> None:
        if self.api == "anthropic":
            self._anthropic(data, now)
        else:
            self._openai(data, now)

    def _anthropic(self, data: dict[str, Any], now: float) -> None:
        kind = data.get("type")
        if kind == "content_block_delta":
            self.content_delta(now)
        elif kind in ("message_start", "message_delta"):
            usage = (data.get("message") or {}).get("usage") if kind == "message_start" else data.get("usage")
            if usage:
                cached = int(usage.get("cache_read_input_tokens") or 0)
                self.outcome.cached_tokens = cached
                self.outcome.input_tokens = int(usage.get("input_tokens") or 0) + cached
                self.outcome.output_tokens = int(usage.get("output_tokens") or 0)
        elif kind == "error":
            self.outcome.error = str((data.get("error") or {}).get("type") or "error")

    def _openai(self, data: dict[str, Any], now: float) -> None:
        if "error" in data:
            self.outcome.error = str((data.get("error") or {}).get("type") or "error")
            return
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                self.content_delta(now)
        usage = data.get("usage")
        if usage:
            self.outcome.input_tokens = int(usage.get("prompt_tokens") or 0)
            self.outcome.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            self.outcome.output_tokens = int(usage.get("completion_tokens") or 0)

    def finish(self) -> CallOutcome:
        if self.first is not None:
            self.outcome.ttft_s = self.first - self.started
            self.outcome.decode_s = (self.last or self.first) - self.first
        elif self.outcome.error is None:
            self.outcome.error = "no content"
        return self.outcome


async def stream_call(
    client: httpx.AsyncClient, api: Api, body: dict[str, Any], headers: dict[str, str] | None = None
) -> CallOutcome:
    """Send one streaming request and time it; failures come back as CallOutcome.error, never raised."""
    started = time.monotonic()
    state = _StreamState(api, started)
    try:
        async with client.stream("POST", endpoint(api), json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return CallOutcome(error=f"http {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if not payload or payload == "[DONE]":
                    continue
                state.feed(json.loads(payload), time.monotonic())
    except (httpx.HTTPError, ValueError) as exc:
        outcome = state.finish()
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
        return outcome
    return state.finish()
