"""The Claude Code CLI (npm @anthropic-ai/claude-code: the current version behind .venv/bin/claude and an
older one, both installed by `make setup`) in print mode against the real gateway and rank worker started
from config/local.yaml, as `make up` starts them, with the environment `kvserve up` prints
(launcher.claude_code_env). The embedded SmolLM2 runs past its trained window (Claude Code's first request
alone is 12-23K tokens). Answer quality is not judged; the protocol and the cache are."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
from claude_code_transcript import append_tool_turn, edit_turn, find_transcript, read_turn
from service_processes import ROOT, gateway_stack

from contracts.config import load_config
from launcher.claude_code_env import claude_code_environment

LOCAL_CONFIG_FILE = ROOT / "config" / "local.yaml"
LOCAL = load_config(LOCAL_CONFIG_FILE)
MODEL = LOCAL.served_model_name
WRAPPER = ROOT / ".venv" / "bin" / "claude"  # what users run: the current version
# The test machine talks to no one but our gateway; none of these changes what reaches it.
OFFLINE = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}
# Claude Code's own message when the model did not end its turn within the output cap (after its three
# retries): not an API error. SmolLM2 past its trained window often does not end its turn.
OUTPUT_CAP_HIT = "output token maximum"
_REQUEST_LINE = re.compile(r"kvserve\.gateway\.requests: .*\bsession=(\S+) .*\bprompt_tokens=(\d+) cached_tokens=(\d+)")


def makefile_value(name: str) -> str:
    found = re.search(rf"^{name} \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, f"{name} is not set in the Makefile"
    return found.group(1)


CURRENT = makefile_value("CLAUDE_CODE_VERSION")
OLDER = makefile_value("CLAUDE_CODE_OLDER_VERSION")


def installed_cli(version: str) -> Path:
    cli = WRAPPER if version == CURRENT else ROOT / ".claude-code" / version / "node_modules" / ".bin" / "claude"
    if not cli.exists():
        if shutil.which("npm"):
            pytest.fail(f"the Claude Code CLI {version} is missing at {cli}: run `make setup`")
        pytest.skip("npm is not installed, so neither is the Claude Code CLI")
    return cli


@dataclass(frozen=True)
class Stack:
    url: str
    gateway_log: Path

    def requests_of(self, session: str) -> list[tuple[int, int]]:
        """(prompt tokens, cached tokens) of each request of `session`, in order, from the gateway's log."""
        found = (_REQUEST_LINE.search(line) for line in self.gateway_log.read_text(errors="replace").splitlines())
        return [(int(m.group(2)), int(m.group(3))) for m in found if m and m.group(1) == session]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("claude-code-stack")
    settings = {"KVSERVE_CONFIG": str(LOCAL_CONFIG_FILE)}  # exactly what `make up` serves
    with gateway_stack(tmp, settings, settings) as url:
        yield Stack(url, tmp / "gateway.log")


CALC = "".join(f"def f{n}(x):\n    return x + {n}\n\n\n" for n in range(12)) + "def add(a, b):\n    return a - b\n"
TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@dataclass(frozen=True)
class Workspace:
    repo: Path  # the project Claude Code runs in: a git repo with a bug to fix
    home: Path  # its HOME (config, session transcripts)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """One project and HOME for the current CLI's first call and its tool turns: 2.1.332's system prompt names
    the project's memory path, so calls from the same project share its ~12K-token prefix and the tool-turn
    test starts warm instead of paying a second cold prefill of minutes."""
    root = tmp_path_factory.mktemp("claude-code-project")
    repo, home = root / "repo", root / "home"
    repo.mkdir()
    home.mkdir()
    (repo / "calc.py").write_text(CALC)
    (repo / "test_calc.py").write_text(TEST_CALC)
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "calc"]):
        subprocess.run([*git, *command], cwd=repo, check=True, capture_output=True)
    return Workspace(repo, home)


def claude_env(stack: Stack, home: Path, **overrides: str) -> dict[str, str]:
    """The exports `kvserve up` prints for this stack (its rank on the CPU), and `overrides` where a test says."""
    assert LOCAL.max_model_len is not None
    exports = claude_code_environment(stack.url, MODEL, LOCAL.max_model_len, LOCAL.request_timeout_secs, on_cpu=True)
    return {"PATH": os.environ["PATH"], "HOME": str(home), **exports, **OFFLINE, **overrides}


def run_claude(cli: Path, env: dict[str, str], cwd: Path, *args: str) -> dict:
    result = subprocess.run(
        [str(cli), "-p", "--output-format", "json", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert result.stdout.strip(), f"claude printed nothing ({result.returncode}): {result.stderr[-2000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def answered(report: dict) -> bool:
    """No API error: the gateway answered every request, and the turn ended or ran into the output cap."""
    return report.get("api_error_status") is None and (
        report["is_error"] is False or OUTPUT_CAP_HIT in report["result"]
    )


def cache_share(report: dict) -> float:
    usage = report["usage"]
    return usage["cache_read_input_tokens"] / (usage["input_tokens"] + usage["cache_read_input_tokens"])


def token_counters(base_url: str) -> tuple[float, float]:
    """(prompt tokens, cached tokens) served so far, from the gateway's /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name}{{"))

    return total("kvserve_gateway_prompt_tokens_total"), total("kvserve_gateway_cached_tokens_total")


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


@pytest.mark.timeout(3000)  # the first call prefills ~23K tokens on the CPU: minutes
def test_older_cli_past_the_trained_window_resumes_from_cache(stack: Stack, tmp_path: Path) -> None:
    """The older CLI sends another first request (~23K tokens: more tools, another system prompt). Output is
    capped lower than the exports do, to keep the test short."""
    cli, env, session = (
        installed_cli(OLDER),
        claude_env(stack, tmp_path, CLAUDE_CODE_MAX_OUTPUT_TOKENS="8"),
        str(uuid.uuid4()),
    )
    before = token_counters(stack.url)
    first = run_claude(cli, env, tmp_path, "--session-id", session, "Reply with one word: ready")
    assert answered(first), first
    after_first = token_counters(stack.url)
    assert after_first[0] - before[0] > 20_000
    second = run_claude(cli, env, tmp_path, "--resume", session, "And again: ready")
    assert answered(second), second
    after_second = token_counters(stack.url)
    prompt, cached = after_second[0] - after_first[0], after_second[1] - after_first[1]
    assert cached / prompt > 0.9, (prompt, cached)


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
