"""The Claude Code exports `kvserve up` prints for config/local.yaml agree with what that stack does: the
client waits as long as the gateway lets a request run, the first cold prefill fits the gateway's deadline,
and the output cap leaves Claude Code room before it compacts."""

from __future__ import annotations

from pathlib import Path

from contracts.config import load_config
from launcher.claude_code_env import CLIENT_TIMEOUT_MARGIN_SECS, claude_code_environment, claude_command

LOCAL = load_config(Path(__file__).resolve().parents[2] / "config" / "local.yaml")
# Measured 2026-12-01 on the 2-core development machine, shared and busy: the 2.1.332 CLI's first request
# (12.3K tokens) took 400 s to its first token, then 64 tokens at 0.3-0.5 tokens/s; 2.1.197's is 23K tokens.
COLD_FIRST_TURN_SECS = 400 * 23 / 12 + 64 / 0.3
# Claude Code 2.1.332 compacts once the conversation passes its window minus the output cap minus ~13K
# (found by resuming sessions with the CLI against a stand-in endpoint reporting 12.3K and 25K input tokens).
COMPACT_RESERVE_TOKENS = 13_000
FIRST_REQUEST_TOKENS_2_1_332 = 12_302


def local_exports(on_cpu: bool = True) -> dict[str, str]:
    assert LOCAL.max_model_len is not None
    return claude_code_environment(
        "http://127.0.0.1:8080", LOCAL.served_model_name, LOCAL.max_model_len, LOCAL.request_timeout_secs, on_cpu=on_cpu
    )


def test_client_waits_for_the_gateway_deadline_and_no_longer() -> None:
    exports = local_exports()
    for variable in ("API_TIMEOUT_MS", "CLAUDE_STREAM_IDLE_TIMEOUT_MS"):
        waits_s = int(exports[variable]) / 1000
        assert LOCAL.request_timeout_secs <= waits_s <= LOCAL.request_timeout_secs + CLIENT_TIMEOUT_MARGIN_SECS


def test_the_local_deadline_covers_a_cold_first_turn_on_the_cpu() -> None:
    assert LOCAL.request_timeout_secs >= COLD_FIRST_TURN_SECS


def test_output_is_capped_and_leaves_room_before_compaction() -> None:
    exports = local_exports()
    cap, window = int(exports["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]), int(exports["CLAUDE_CODE_MAX_CONTEXT_TOKENS"])
    assert 0 < cap <= 64  # the CPU decodes about one token per second over this context
    assert window - cap - COMPACT_RESERVE_TOKENS > FIRST_REQUEST_TOKENS_2_1_332 + 2_000
    assert window <= 0.9 * (LOCAL.max_model_len or 0)


def test_a_gpu_gets_a_larger_cap_within_the_context() -> None:
    cap = int(local_exports(on_cpu=False)["CLAUDE_CODE_MAX_OUTPUT_TOKENS"])
    assert 64 < cap <= (LOCAL.max_model_len or 0) // 8


def test_claude_is_named_by_its_path_unless_path_finds_the_wrapper(tmp_path: Path, monkeypatch) -> None:
    wrapper = tmp_path / "claude"
    wrapper.write_text("#!/bin/sh\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert claude_command(tmp_path) == str(wrapper)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert claude_command(tmp_path) == "claude"
