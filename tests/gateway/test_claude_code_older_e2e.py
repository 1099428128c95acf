"""The older Claude Code CLI (CLAUDE_CODE_OLDER_VERSION, installed by `make setup` beside the current one) in
print mode against the real gateway and rank worker started from config/local.yaml, with the exports `kvserve
up` prints. Its first request (~23K tokens) is another than the current CLI's (test_claude_code_e2e.py); this
file has its own stack so that the two cold prefills run on two xdist workers at once. Answer quality is not
judged; the protocol and the cache are."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from claude_code_cli import OLDER, Stack, answered, claude_env, installed_cli, local_stack, run_claude, token_counters


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with local_stack(tmp_path_factory) as stack:
        yield stack


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
