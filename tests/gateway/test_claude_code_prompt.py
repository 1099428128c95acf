"""Claude Code's system prompt and roles, normalised before templating."""

from __future__ import annotations

import itertools
import json
import lzma
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from test_prompt_render import QWEN3
from tokenizers import Tokenizer

from gateway.api.anthropic.convert import to_chat
from gateway.api.anthropic.schema import MessagesRequest
from gateway.prompt.claude_code import map_role, split_session_facts, strip_attribution, strip_attribution_blocks
from gateway.prompt.render import ModelTemplate, render_prompt
from rank_worker.model_files.opener import open_model_source

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


# Request bodies the real CLIs sent over tool loops and resumes (tests/gateway/data/claude_code/): each
# request must render to a prompt that starts with the previous request's whole prompt, or the KV cache of
# the previous turn is lost. Claude Code moves its cache_control marks to the newest message, keeps a system
# turn after the first prompt (2.1.332: the environment; 2.1.197: the agent listing), adds
# <system-reminder> blocks, and rewrites tool inputs (Edit gains replace_all).
RECORDED = sorted((Path(__file__).parent / "data" / "claude_code").glob("*.json.xz"))


@pytest.fixture(scope="module")
def smollm2() -> tuple[ModelTemplate, Tokenizer]:
    bundle = open_model_source("").tokenizer
    assert bundle is not None
    template = ModelTemplate.for_model(
        "HuggingFaceTB/SmolLM2-135M-Instruct", bundle.chat_template, bundle.bos_token, bundle.eos_token
    )
    return template, Tokenizer.from_str(bundle.tokenizer_json)


def recorded_prompts(path: Path, template: ModelTemplate) -> list[str]:
    requests = json.loads(lzma.decompress(path.read_bytes()))["requests"]
    return [render_prompt(to_chat(MessagesRequest.model_validate(body)), template) for body in requests]


def test_recorded_sessions_are_there() -> None:
    names = [path.name for path in RECORDED]
    assert any("2.1.197" in name for name in names) and any("2.1.332" in name for name in names), names


@pytest.mark.parametrize("path", RECORDED, ids=lambda path: path.name.removesuffix(".json.xz"))
def test_each_recorded_request_extends_the_previous_prompt(
    path: Path, smollm2: tuple[ModelTemplate, Tokenizer]
) -> None:
    template, tokenizer = smollm2
    prompts = recorded_prompts(path, template)
    assert len(prompts) >= 3
    for number, (previous, current) in enumerate(itertools.pairwise(prompts), 1):
        assert current.startswith(previous), f"request {number + 1} diverges at {_shared_prefix(previous, current)}"
        previous_ids = tokenizer.encode(previous, add_special_tokens=False).ids
        current_ids = tokenizer.encode(current, add_special_tokens=False).ids
        assert _shared_prefix(previous_ids, current_ids) >= 0.998 * len(previous_ids), number


def test_attribution_and_cache_marks_leave_no_trace(smollm2: tuple[ModelTemplate, Tokenizer]) -> None:
    """The recorded first request again with another billing header and cache marks moved: the same prompt."""
    template, _ = smollm2
    body = json.loads(lzma.decompress(RECORDED[-1].read_bytes()))["requests"][0]
    moved = json.loads(json.dumps(body))
    moved["system"][0]["text"] = moved["system"][0]["text"].replace("cc_version=", "cc_version=9.9.9.fff-")
    for block in moved["system"]:
        block.pop("cache_control", None)
    moved["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}

    def render(request: dict[str, Any]) -> str:
        return render_prompt(to_chat(MessagesRequest.model_validate(request)), template)

    assert "x-anthropic-billing-header" in body["system"][0]["text"]
    assert render(moved) == render(body)


# What names the project or the day is taken out of Claude Code's system text, to be written after everything
# every session shares.

MEMORY = (
    "# Memory\n\nYou have a persistent file-based memory at `/home/u/.claude/projects/-src-app/memory/`. This "
    "directory already exists — write to it directly."
)
ENVIRONMENT = (
    "# Environment\nYou have been invoked in the following environment: \n - Primary working directory: /src/app\n"
    " - Is a git repository: true\n - Additional working directories:\n   - /src/lib\n   - /src/doc\n"
    " - Platform: linux\n\nSkills.\n\nToday's date is 2026-12-01."
)


def test_the_memory_directory_is_named_at_the_end() -> None:
    shared, facts = split_session_facts(MEMORY)
    assert shared == (
        "# Memory\n\nYou have a persistent file-based memory at the memory directory named at the end of this "
        "system prompt. This directory already exists — write to it directly."
    )
    assert facts == ["Memory directory: /home/u/.claude/projects/-src-app/memory/"]


def test_the_project_lines_and_the_date_leave_the_environment() -> None:
    shared, facts = split_session_facts(ENVIRONMENT)
    assert (
        shared == "# Environment\nYou have been invoked in the following environment: \n - Platform: linux\n\nSkills."
    )
    assert facts == [
        "Primary working directory: /src/app",
        "Is a git repository: true",
        "Additional working directories:\n   - /src/lib\n   - /src/doc",
        "Today's date is 2026-12-01.",
    ]
    assert split_session_facts("A.\n\nToday's date is 2026-12-01.\n\nB.") == (
        "A.\n\nB.",
        ["Today's date is 2026-12-01."],
    )


def test_the_git_status_at_the_end_of_the_older_system_prompt() -> None:
    text = "Instructions.\n\ngitStatus: This is the git status.\n\nCurrent branch: main\n\nRecent commits:\nabc init"
    assert split_session_facts(text) == (
        "Instructions.",
        ["gitStatus: This is the git status.\n\nCurrent branch: main\n\nRecent commits:\nabc init"],
    )


def test_text_without_them_is_left_as_it_is() -> None:
    for text in (PROMPT, "Trailing newline.\n", "A date: Today's date is in the middle of a line."):
        assert split_session_facts(text) == (text, [])


# A new project's first request (another working directory, HOME and memory directory, another git status) must
# find the tool definitions and the fixed instructions of any earlier project's prompt in the cache: they come
# first, what names the project last in the system turn. The two 2.1.332 recordings ran in two projects
# (/tmp/cc/loop-repo and /tmp/cc/craft-repo, each with a HOME of its own); 2.1.197's second project is made
# from its one.


def first_request(name: str) -> dict[str, Any]:
    return json.loads(lzma.decompress((RECORDED[0].parent / f"{name}.json.xz").read_bytes()))["requests"][0]


def another_project(request: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(request).replace("loop-repo", "second-project").replace("loop-home", "second-home")
    return json.loads(text.replace("14a08e2", "9f3c2d1"))


FIRST_CALLS_OF_TWO_PROJECTS = {
    "2.1.332": lambda: (first_request("tool-loop-2.1.332"), first_request("transcript-resume-2.1.332")),
    "2.1.197": lambda: (first_request("tool-loop-2.1.197"), another_project(first_request("tool-loop-2.1.197"))),
}
FAMILIES = {
    "smollm2": lambda smollm2: smollm2,  # the default model: ChatML, Hermes tools folded into the system turn
    "deepseek_v32": lambda _: ModelTemplate("", family="deepseek_dsml", thinks=True),
    "qwen3": lambda _: QWEN3,  # the template writes the tools after the first system message
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cli", FIRST_CALLS_OF_TWO_PROJECTS)
def test_a_new_project_shares_the_tools_and_the_fixed_instructions(
    cli: str, family: str, smollm2: tuple[ModelTemplate, Tokenizer]
) -> None:
    template, tokenizer = FAMILIES[family](smollm2[0]), smollm2[1]
    first, second = FIRST_CALLS_OF_TWO_PROJECTS[cli]()
    prompts = [render_prompt(to_chat(MessagesRequest.model_validate(body)), template) for body in (first, second)]
    ids = [tokenizer.encode(prompt, add_special_tokens=False).ids for prompt in prompts]
    shared = _shared_prefix(*ids)
    assert shared >= 10_000 and shared >= 0.9 * len(ids[0]), (shared, len(ids[0]))
    # All of it up to the section naming the project: tools, instructions, the environment but the project's lines.
    session = prompts[0].find("# This session\n")
    assert session > 0 and "/tmp/cc/" not in prompts[0][:session]
    before_session = len(tokenizer.encode(prompts[0][:session], add_special_tokens=False).ids)
    assert shared >= before_session - 2, (shared, before_session, len(ids[0]))
    assert "Primary working directory: /tmp/cc/" in prompts[0][session:].split("\n\n")[0]


def _shared_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items two sequences (characters, token ids) have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
