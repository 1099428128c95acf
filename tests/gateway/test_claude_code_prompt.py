"""Claude Code's system prompt and roles, normalised before templating."""

from __future__ import annotations

import pytest

from gateway.prompt.claude_code import map_role, strip_attribution, strip_attribution_blocks

HEADER = "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=cli; cch=1a2b3;"
PROMPT = "You are Claude Code, Anthropic's official CLI for Claude.\n\nYou are an interactive CLI tool."


def test_header_as_its_own_block() -> None:
    assert strip_attribution(f"{HEADER}\n\n{PROMPT}") == PROMPT
    assert strip_attribution(f"{HEADER}\n{PROMPT}") == PROMPT


def test_header_as_first_line_of_the_first_block() -> None:
    assert strip_attribution(f"{HEADER}\nYou are Claude Code.\n\nMore.") == "You are Claude Code.\n\nMore."


def test_header_alone() -> None:
    assert strip_attribution(HEADER) == ""


def test_every_request_gives_the_same_text() -> None:
    other = HEADER.replace("cch=1a2b3", "cch=9f8e7").replace("2.1.332.abc", "2.1.332.def")
    assert strip_attribution(f"{HEADER}\n\n{PROMPT}") == strip_attribution(f"{other}\n\n{PROMPT}")


def test_only_that_line_goes() -> None:
    assert strip_attribution(PROMPT) == PROMPT
    text = "Intro.\n\nMention of x-anthropic-billing-header: in prose stays.\n\n  indented\n"
    assert strip_attribution(text) == text


def test_blocks() -> None:
    assert strip_attribution_blocks([HEADER, PROMPT]) == [PROMPT]
    assert strip_attribution_blocks([f"{HEADER}\n{PROMPT}", "second"]) == [PROMPT, "second"]
    assert strip_attribution_blocks(["", PROMPT]) == ["", PROMPT]


@pytest.mark.parametrize(
    ("role", "mapped"),
    [("ctx", "user"), ("msg", "user"), ("system", "system"), ("user", "user"), ("assistant", "assistant")],
)
def test_roles(role: str, mapped: str) -> None:
    assert map_role(role) == mapped


def test_unknown_roles() -> None:
    assert map_role("developer_notes") is None
    assert map_role("tool") is None  # tool results arrive as tool_result blocks, never as a role
