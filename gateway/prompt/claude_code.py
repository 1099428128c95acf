"""What Claude Code sends that must be normalised before templating."""

from __future__ import annotations

import re

from gateway.prompt.chat import Role

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


# What Claude Code writes into its system text that names the project or the day, amid text that reads the same in
# every session: the memory directory (under $HOME/.claude/projects/<project>/), and lines of its environment list.
_MEMORY_DIRECTORY = re.compile(r"(?<=persistent file-based memory at )`([^`\n]+)`")
_MEMORY_REFERENCE = "the memory directory named at the end of this system prompt"
_SESSION_LINE = re.compile(
    r"^(?: - (?:Primary working directory|Is a git repository): .*"
    r"| - Additional working directories:(?:\n {2,}.*)*"  # a list of directories, one indented line each
    r"|Today's date is .*\n?)\n?",  # a paragraph of its own: its blank line goes too
    re.MULTILINE,
)
# 2.1.197 ends its system prompt with the git status at the start of the session (branch, status, commits).
_GIT_STATUS = re.compile(r"^gitStatus: [\s\S]*\Z", re.MULTILINE)


def split_session_facts(system_text: str) -> tuple[str, list[str]]:
    """The system text without what names the project or the day, and what was taken out, one fact a line.

    Claude Code's system prompt reads the same for every project but for its memory directory, and its environment
    (a system message since 2.1.332) but for the working directory, whether it is a git repository, the date and
    (2.1.197) the git status: taken out, they can be written after the tool definitions and the fixed
    instructions, which every session then shares. The memory directory's sentence stays in place and points to
    where the directory is named. The git status runs to the end of `system_text`: pass one system message."""
    facts: list[str] = []

    def memory_reference(match: re.Match[str]) -> str:
        facts.append(f"Memory directory: {match.group(1)}")
        return _MEMORY_REFERENCE

    def session_line(match: re.Match[str]) -> str:
        facts.append(match.group(0).strip("\n").removeprefix(" - "))
        return ""

    text = _MEMORY_DIRECTORY.sub(memory_reference, system_text)
    text = _SESSION_LINE.sub(session_line, text)
    text = _GIT_STATUS.sub(session_line, text)
    return (text.rstrip("\n") if facts else text), facts
