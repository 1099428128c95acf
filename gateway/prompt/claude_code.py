"""What Claude Code sends that must be normalised before templating."""

from __future__ import annotations

import re

from gateway.chat import Role

# "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=cli; cch=1a2b3;" changes on every
# request: left in, it makes every prompt differ from its first token and no prefix is ever cached.
_ATTRIBUTION_LINE = re.compile(r"[ \t]*x-anthropic-billing-header:", re.IGNORECASE)

_ROLES: dict[str, Role] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "ctx": "user",  # newer Claude Code versions send context and side messages under their own roles
    "msg": "user",
}


def strip_attribution(system_text: str) -> str:
    """The system prompt without Claude Code's per-request attribution line.

    Only lines that start with the billing header are removed, with the blank lines that separated them
    from what follows (the header may be a system block of its own, or the first line of the first one)."""
    lines = system_text.split("\n")
    kept: list[str] = []
    dropping_separator = False
    for line in lines:
        if _ATTRIBUTION_LINE.match(line):
            dropping_separator = True
            continue
        if dropping_separator and not line.strip():
            continue
        dropping_separator = False
        kept.append(line)
    if len(kept) == len(lines):
        return system_text
    return "\n".join(kept)


def strip_attribution_blocks(blocks: list[str]) -> list[str]:
    """strip_attribution over system blocks, leaving out a block that held nothing but the header."""
    stripped = (strip_attribution(block) for block in blocks)
    return [block for block, original in zip(stripped, blocks, strict=True) if block or not original]


def map_role(role: str) -> Role | None:
    """Our role for a message role Claude Code sent (ctx and msg are user turns); None for one we do not know."""
    return _ROLES.get(role)
