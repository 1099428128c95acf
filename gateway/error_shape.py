"""Error bodies in each API's own shape, chosen by the request's path (OpenAI's under /v1/chat/, Anthropic's
elsewhere), and rendered so that they can always be sent."""

from __future__ import annotations

import json
from typing import Any

from gateway.metrics import Api

OPENAI_PATH_PREFIX = "/v1/chat/"
CHAT_PATHS: dict[str, Api] = {"/v1/messages": "anthropic", "/v1/chat/completions": "openai"}


def api_for_path(path: str) -> Api:
    return "openai" if path.startswith(OPENAI_PATH_PREFIX) else "anthropic"


def chat_api(path: str) -> Api | None:
    """The API of a generation endpoint (a trailing slash allowed), None for any other path."""
    return CHAT_PATHS.get(path.rstrip("/") or "/")


def error_body(path: str, status: int, kind: str, message: str) -> dict[str, Any]:
    if api_for_path(path) == "openai":
        code = "overloaded" if status == 529 else None
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return {"type": "error", "error": {"type": kind, "message": message}}


def render_error(body: dict[str, Any]) -> bytes:
    # ASCII-escaped: a lone surrogate a client sent (echoed in a message) cannot make the answer unsendable.
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")
