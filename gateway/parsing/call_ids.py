"""Ids for the tool calls a model makes: the Anthropic layer sends them as is, so they look like Anthropic's."""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable

_ALPHABET = string.ascii_letters + string.digits

ToolCallIdFactory = Callable[[], str]


def new_tool_call_id() -> str:
    """ "toolu_" and 24 random alphanumerics."""
    return "toolu_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))
