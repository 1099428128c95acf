"""The environment Claude Code needs to use a kvserve gateway: what `kvserve up` prints for the user to paste,
and what the Claude Code end-to-end test runs the real CLI with, so that the test runs what users get."""

from __future__ import annotations

import shutil
from pathlib import Path

# Claude Code asks for 32,000 output tokens unless told otherwise and reserves them, plus ~13K, from the
# context window before it compacts: against a 32K window the 2.1.3xx CLI then compacts on every turn.
MAX_OUTPUT_TOKENS = 8192
# On a CPU the embedded model decodes at 0.3-2 tokens/s over Claude Code's 12-23K-token context, and past its
# trained window it often does not end its turn; Claude Code then asks three more times to go on (each
# request up to the cap), so a cap of 64 keeps a turn within minutes.
CPU_MAX_OUTPUT_TOKENS = 64
# The client waits this much longer than the gateway's own deadline, so that a request that runs out of time
# ends with the gateway's error rather than with the client abandoning it and retrying the same cold prefill.
CLIENT_TIMEOUT_MARGIN_SECS = 60
OPEN_GATEWAY_KEY = "local"  # any value: a gateway without an api_keys_file takes no keys (loopback only)
API_KEY_PLACEHOLDER = "YOUR_KVSERVE_API_KEY"  # with an api_keys_file: the user's key goes here


def max_output_tokens(max_model_len: int, on_cpu: bool) -> int:
    """Claude Code's output cap: an eighth of the context at most, and what a CPU decodes in minutes."""
    return min(CPU_MAX_OUTPUT_TOKENS if on_cpu else MAX_OUTPUT_TOKENS, max_model_len // 8)


def claude_code_environment(
    base_url: str,
    model: str,
    max_model_len: int,
    request_timeout_secs: float,
    *,
    on_cpu: bool,
    api_key: str = OPEN_GATEWAY_KEY,
) -> dict[str, str]:
    """Variables for Claude Code against `base_url`. It must compact before our context is full (it assumes
    1M tokens for a model it does not know), keep its output within what the context and the device allow,
    and wait for the first prefill (12-23K tokens: minutes on a CPU; Claude Code's defaults give up after 5,
    and SSE pings do not count as activity) for as long as the gateway lets a request run."""
    client_timeout_ms = str(int((request_timeout_secs + CLIENT_TIMEOUT_MARGIN_SECS) * 1000))
    return {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(max_model_len * 9 // 10),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens(max_model_len, on_cpu)),
        "API_TIMEOUT_MS": client_timeout_ms,
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": client_timeout_ms,
    }


def paste_instructions(environment: dict[str, str], claude: str, keys_note: str = "") -> str:
    """The exports as one block to paste, and the command apart: a block ending in the command would start
    Claude Code as it is pasted, before the user has read (or replaced) anything. `keys_note` comes first."""
    exports = "".join(f"  export {name}={value}\n" for name, value in environment.items())
    note = f"{keys_note}\n" if keys_note else ""
    header = f"\nUse it from Claude Code.\n{note}Paste these exports into your shell:\n\n"
    return f"{header}{exports}\nthen run:\n\n  {claude}\n"


def claude_command(bin_dir: Path) -> str:
    """How the user runs the Claude Code CLI that `make setup` wraps in the virtual environment's `bin_dir`:
    plain `claude` only when PATH finds that one."""
    wrapper = bin_dir / "claude"
    on_path = shutil.which("claude")
    if not wrapper.exists() or (on_path and Path(on_path).resolve() == wrapper.resolve()):
        return "claude"
    return str(wrapper)
