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

import httpx
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
    gateway = {"KVSERVE_DEFAULT_TEMPERATURE": "0.2", "KVSERVE_DEFAULT_TOP_P": "0.9"}  # as config/local.yaml
    with gateway_stack(tmp_path_factory.mktemp("claude-code-stack"), rank, gateway) as url:
        yield url


def run_claude(claude: Path, base_url: str, home: Path, *args: str, max_output_tokens: int = 64) -> dict:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "local-test-key",
        "ANTHROPIC_MODEL": "smollm2-135m-instruct",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "smollm2-135m-instruct",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(MAX_MODEL_LEN * 9 // 10),
        # every token over a 20K context costs on 2 CPU cores
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # the first 20K-token prefill takes minutes on 2 busy CPU cores; Claude Code gives up on a stream
        # with no content for 5 minutes (pings do not count)
        "API_TIMEOUT_MS": "1800000",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
    }
    result = subprocess.run(
        [str(claude), "-p", "--output-format", "json", "--max-turns", "1", *args],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.stdout.strip(), f"claude printed nothing ({result.returncode}): {result.stderr[-2000:]}"
    return json.loads(result.stdout)


def cache_share(report: dict) -> float:
    usage = report["usage"]
    return usage["cache_read_input_tokens"] / (usage["input_tokens"] + usage["cache_read_input_tokens"])


def test_compact_session_completes_without_error_and_resumes_from_cache(
    claude: Path, base_url: str, tmp_path: Path
) -> None:
    """Within SmolLM2's trained window (no tools, a short system prompt), so the model ends its turn."""
    session = str(uuid.uuid4())
    compact = ["--tools", "", "--system-prompt", "You are a terse assistant. Answer with one word."]
    first = run_claude(claude, base_url, tmp_path, *compact, "--session-id", session, "Say: ready")
    assert first["is_error"] is False and first["subtype"] == "success", first
    second = run_claude(claude, base_url, tmp_path, *compact, "--resume", session, "Say it again.")
    assert second["is_error"] is False, second
    assert cache_share(second) > 0.6, second["usage"]  # the whole first turn is read back from the cache


def token_counters(base_url: str) -> tuple[float, float]:
    """(prompt tokens, cached tokens) served so far, from the gateway's /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    prompt = sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvserve_gateway_prompt_tokens_total{")
    )
    cached = sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvserve_gateway_cached_tokens_total{")
    )
    return prompt, cached


@pytest.mark.timeout(1800)  # the first call prefills ~20K tokens on the CPU: minutes
def test_default_claude_code_past_the_trained_window(claude: Path, base_url: str, tmp_path: Path) -> None:
    """Claude Code as installed: ~20K tokens of system prompt and tool definitions on the first call, past
    SmolLM2's 8K window. Every call must be answered (no API error); the model, past its window, may not
    end its turn within the output cap, which Claude Code reports as its own error (and then reports no
    usage): tolerated, named. Token counts are read from the gateway's metrics instead."""
    session = str(uuid.uuid4())
    before = token_counters(base_url)
    first = run_claude(
        claude, base_url, tmp_path, "--session-id", session, "Reply with one word: ready", max_output_tokens=8
    )
    assert first.get("api_error_status") is None, first
    assert first["is_error"] is False or "output token maximum" in first["result"], first
    after_first = token_counters(base_url)
    assert after_first[0] - before[0] > 12_000  # system prompt + tool definitions: past the 8K window
    second = run_claude(claude, base_url, tmp_path, "--resume", session, "And again: ready", max_output_tokens=8)
    assert second.get("api_error_status") is None, second
    after_second = token_counters(base_url)
    prompt, cached = after_second[0] - after_first[0], after_second[1] - after_first[1]
    assert cached / prompt > 0.9, (prompt, cached)
