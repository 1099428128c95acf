"""The Claude Code CLI (npm @anthropic-ai/claude-code, installed by `make setup`) in print mode against the
real gateway and rank worker with the embedded SmolLM2, run past its trained window (Claude Code's first
request alone is 12-15K tokens). Answer quality is not judged; the protocol and the cache are."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_processes import ROOT, gateway_stack

CLI = ROOT / ".claude-code" / "node_modules" / ".bin" / "claude"
MAX_MODEL_LEN = 32768


@pytest.fixture(scope="module")
def claude() -> Path:
    if not CLI.exists():
        if shutil.which("npm"):
            pytest.fail(f"the Claude Code CLI is missing at {CLI}: run `make setup`")
        pytest.skip("npm is not installed, so neither is the Claude Code CLI")
    return CLI


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    rank = {
        "KVSERVE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "KVSERVE_ALLOW_LONG_CONTEXT": "true",
        "KVSERVE_KV_CACHE_MEMORY_GB": "2.0",
        "KVSERVE_MAX_NUM_BATCHED_TOKENS": "2048",
        "KVSERVE_SERVED_MODEL_NAME": "smollm2-135m-instruct",
    }
    with gateway_stack(tmp_path_factory.mktemp("claude-code-stack"), rank, {}) as url:
        yield url


def run_claude(claude: Path, base_url: str, home: Path, *args: str) -> dict:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "local-test-key",
        "ANTHROPIC_MODEL": "smollm2-135m-instruct",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "smollm2-135m-instruct",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(MAX_MODEL_LEN * 9 // 10),
        # SmolLM2 past its trained window rambles; on 2 CPU cores every token over a 20K context costs.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    result = subprocess.run(
        [str(claude), "-p", "--output-format", "json", "--max-turns", "1", *args],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, (
        f"claude failed ({result.returncode}): {result.stdout[-2000:]} {result.stderr[-2000:]}"
    )
    report = json.loads(result.stdout)
    assert report.get("is_error") is False, report
    return report


@pytest.mark.timeout(1800)  # the first call prefills ~20K tokens on the CPU: minutes
def test_claude_code_completes_and_its_second_call_is_mostly_cached(
    claude: Path, base_url: str, tmp_path: Path
) -> None:
    session = str(uuid.uuid4())
    first = run_claude(claude, base_url, tmp_path, "--session-id", session, "Reply with the single word: ready")
    usage = first["usage"]
    first_input = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert first_input > 8000  # system prompt + tool definitions: beyond SmolLM2's trained window
    second = run_claude(claude, base_url, tmp_path, "--resume", session, "And again: ready")
    usage = second["usage"]
    total = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert usage["cache_read_input_tokens"] / total > 0.8, usage
