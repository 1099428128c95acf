"""What the Claude Code CLI end-to-end tests share (test_claude_code_e2e.py: the current CLI;
test_claude_code_older_e2e.py: the older one, in a file of its own so that its cold prefill of ~23K tokens runs
on one xdist worker while the current CLI's ~12K runs on the other): the CLIs `make setup` installs, the stack
`make up` serves from config/local.yaml, the exports `kvserve up` prints, and reading the answers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
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


@contextlib.contextmanager
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A rank worker and a gateway started from config/local.yaml: exactly what `make up` serves."""
    tmp = tmp_path_factory.mktemp("claude-code-stack")
    settings = {"KVSERVE_CONFIG": str(LOCAL_CONFIG_FILE)}
    with gateway_stack(tmp, settings, settings) as url:
        yield Stack(url, tmp / "gateway.log")


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
