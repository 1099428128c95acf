"""The Claude Code CLI (npm @anthropic-ai/claude-code: the current version behind .venv/bin/claude, installed by
`make setup` with an older one, whose test is test_claude_code_older_e2e.py) in print mode against the real
gateway and rank worker started from config/local.yaml, as `make up` starts them, with the environment `kvserve
up` prints (launcher.claude_code_env). The embedded SmolLM2 runs past its trained window (Claude Code's first
request alone is 12-23K tokens). Answer quality is not judged; the protocol and the cache are."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
from claude_code_cli import (
    CURRENT,
    MODEL,
    OLDER,
    Stack,
    answered,
    cache_share,
    claude_env,
    installed_cli,
    local_stack,
    run_claude,
    token_counters,
)
from claude_code_transcript import append_tool_turn, edit_turn, find_transcript, read_turn


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with local_stack(tmp_path_factory) as stack:
        yield stack


CALC = "".join(f"def f{n}(x):\n    return x + {n}\n\n\n" for n in range(12)) + "def add(a, b):\n    return a - b\n"
TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@dataclass(frozen=True)
class Workspace:
    repo: Path  # the project Claude Code runs in: a git repo with a bug to fix
    home: Path  # its HOME (config, session transcripts)


def git_project(repo: Path, files: dict[str, str]) -> Path:
    """A git repository at `repo` holding `files`, in one commit."""
    repo.mkdir()
    for name, text in files.items():
        (repo / name).write_text(text)
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run([*git, *command], cwd=repo, check=True, capture_output=True)
    return repo


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """One project and HOME for the current CLI's first call, a second project's and the tool turns: after the
    first call's cold prefill of minutes, the others start warm (the tool definitions and fixed instructions are
    rendered before what names the project, so every project shares them)."""
    root = tmp_path_factory.mktemp("claude-code-project")
    home = root / "home"
    home.mkdir()
    return Workspace(git_project(root / "repo", {"calc.py": CALC, "test_calc.py": TEST_CALC}), home)


def test_make_setup_installs_both_versions_and_puts_the_current_one_in_the_venv() -> None:
    for version in (CURRENT, OLDER):
        result = subprocess.run([str(installed_cli(version)), "--version"], capture_output=True, text=True, timeout=120)
        assert result.stdout.startswith(f"{version} "), (version, result.stdout, result.stderr[-500:])


def test_compact_session_completes_without_error_and_resumes_from_cache(stack: Stack, tmp_path: Path) -> None:
    """Within SmolLM2's trained window (no tools, a short system prompt), with the printed exports: every request
    is answered (2.1.332's compact turn often runs into the 64-token cap at the local temperature, which Claude
    Code reports as its own message, not an API error), and the resumed turn reads the first from the cache."""
    cli, env, session = installed_cli(CURRENT), claude_env(stack, tmp_path), str(uuid.uuid4())
    compact = ["--tools", "", "--system-prompt", "You are a terse assistant. Answer with one word."]
    first = run_claude(cli, env, tmp_path, *compact, "--session-id", session, "Say: ready")
    assert answered(first), first
    second = run_claude(cli, env, tmp_path, *compact, "--resume", session, "Say it again.")
    assert answered(second), second
    assert cache_share(second) > 0.6, second["usage"]  # the whole first turn is read back from the cache


@pytest.mark.timeout(3000)  # a cold prefill of ~12K tokens on two CPU cores, then up to 4 x 64 output tokens
def test_first_call_with_the_printed_exports_is_answered(stack: Stack, workspace: Workspace) -> None:
    """What a new user does after `make up`: paste the exports, run the current CLI. Its ~12K tokens of system
    prompt and tool definitions are past SmolLM2's window; every request must be answered within the
    gateway's deadline and the client's timeouts."""
    before = token_counters(stack.url)
    env = claude_env(stack, workspace.home)
    report = run_claude(installed_cli(CURRENT), env, workspace.repo, "Reply with one word: ready")
    assert answered(report), report
    assert token_counters(stack.url)[0] - before[0] > 10_000  # system prompt + tool definitions


@pytest.mark.timeout(3000)  # cold only when run alone: the first project's call prefills ~12K tokens then
def test_a_second_projects_first_call_reads_the_tools_and_instructions_from_the_cache(
    stack: Stack, workspace: Workspace
) -> None:
    """The same user in another project (another working directory, memory directory, git status): its first
    call must find the ~12K tokens of tool definitions and fixed instructions that the first project's call left
    in the cache, and prefill only what names the project and the user's prompt."""
    cli, sessions = installed_cli(CURRENT), {"first": str(uuid.uuid4()), "second": str(uuid.uuid4())}
    env = claude_env(stack, workspace.home, CLAUDE_CODE_MAX_OUTPUT_TOKENS="8")  # short turns; only the prompts matter
    second_project = git_project(workspace.repo.parent / "second-project", {"notes.py": "NOTES = []\n"})
    assert answered(
        run_claude(cli, env, workspace.repo, "--session-id", sessions["first"], "Reply with one word: ready")
    )
    report = run_claude(cli, env, second_project, "--session-id", sessions["second"], "Reply with one word: ready")
    assert answered(report), report
    prompt, cached = stack.requests_of(sessions["second"])[0]
    print(f"second project's first request: {prompt} prompt tokens, {cached} read from the cache")
    assert cached >= 10_000, (prompt, cached)
    assert report["usage"]["cache_read_input_tokens"] >= 10_000, report["usage"]  # what Claude Code was told


@pytest.mark.timeout(3000)
def test_prefix_stays_cached_over_tool_turns(stack: Stack, workspace: Workspace) -> None:
    """The current CLI over several tool-using turns (Read, Edit, Read of a temp git repo): each turn's tool
    use and result are written into the session's transcript, the tool run for real, and `--resume`
    resends the whole conversation as a tool loop does. Every request must find >= 95% of the previous
    request's prompt in the cache: Claude Code's habits (system reminders, a system turn after the first
    prompt, moving cache_control marks, retries after the output cap) must not break the prefix."""
    cli, repo, home, session = installed_cli(CURRENT), workspace.repo, workspace.home, str(uuid.uuid4())
    env = claude_env(stack, home, CLAUDE_CODE_MAX_OUTPUT_TOKENS="8")  # short turns; only the prompts matter
    assert answered(run_claude(cli, env, repo, "--session-id", session, "Fix the bug in add() in calc.py."))
    turns = [
        lambda: read_turn(repo / "calc.py"),
        lambda: edit_turn(repo / "calc.py", "return a - b", "return a + b"),
        lambda: read_turn(repo / "test_calc.py"),
    ]
    growth: list[int] = []  # prompt tokens a resume's first request adds to the request before it
    for make_turn in turns:
        sent = len(stack.requests_of(session))
        append_tool_turn(find_transcript(home / ".claude", session), make_turn(), MODEL)
        assert answered(run_claude(cli, env, repo, "--resume", session, "Go on.")), session
        requests = stack.requests_of(session)
        growth.append(requests[sent][0] - requests[sent - 1][0])
    assert "return a + b" in (repo / "calc.py").read_text()
    assert growth[0] > 150, growth  # the Read result of calc.py (~200 tokens) reached the model

    requests = stack.requests_of(session)
    coverage = [cached / previous for (previous, _), (_, cached) in pairwise(requests)]
    print(f"per-request (prompt, cached): {requests}; cached / previous prompt: {[f'{c:.3f}' for c in coverage]}")
    assert len(requests) >= 1 + len(turns), requests
    assert min(coverage) >= 0.95, (coverage, requests)
