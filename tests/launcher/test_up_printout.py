"""What `kvserve up` prints once the stack is ready, for the user to paste: the exports as one block and the
Claude Code command apart (pasting the block must not start it), and, when the gateway takes keys, a placeholder
key and where keys come from instead of a key the gateway refuses."""

from __future__ import annotations

import io
from pathlib import Path

from contracts.config import KvServeConfig
from launcher.claude_code_env import API_KEY_PLACEHOLDER
from launcher.topology import StackPlan, build_topology
from launcher.up import UpOptions, _print_ready


def printout(tmp_path: Path, **values: object) -> str:
    config = KvServeConfig(**values)  # type: ignore[arg-type]
    state_dir = tmp_path / "state"
    specs = build_topology(config, 1, StackPlan(mode="local", state_dir=state_dir))
    out = io.StringIO()
    _print_ready(specs, "smollm2", 1024, config, UpOptions(None, state_dir=state_dir), out)
    return out.getvalue()


def paragraphs(text: str) -> list[list[str]]:
    return [block.strip("\n").splitlines() for block in text.split("\n\n") if block.strip()]


def test_the_exports_are_one_block_and_the_command_comes_apart(tmp_path: Path) -> None:
    blocks = paragraphs(printout(tmp_path))
    with_exports = [block for block in blocks if any(line.strip().startswith("export ") for line in block)]
    assert len(with_exports) == 1
    exports = with_exports[0]
    assert all(line.startswith("  export ") for line in exports), exports  # nothing else runs when pasted
    assert any(line.startswith("  export ANTHROPIC_BASE_URL=http://") for line in exports)
    after = blocks[blocks.index(exports) + 1 :]
    assert after[0] == ["then run:"] and after[1][0].strip().endswith("claude")


def test_an_open_gateway_gets_any_key(tmp_path: Path) -> None:
    assert "  export ANTHROPIC_API_KEY=local\n" in printout(tmp_path)


def test_a_gateway_with_keys_gets_a_placeholder_and_where_keys_come_from(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    text = printout(tmp_path, api_keys_file=str(keys))
    assert "ANTHROPIC_API_KEY=local" not in text  # the gateway answers that key with 401
    assert f"  export ANTHROPIC_API_KEY={API_KEY_PLACEHOLDER}\n" in text
    assert f"api_keys_file {keys}" in text and f"keys create --name NAME --file {keys}" in text
    # said before the exports, where the user reads it before pasting them
    assert text.index("keys create") < text.index("export ANTHROPIC_API_KEY")


def test_the_logs_line_names_where_the_previous_run_went(tmp_path: Path) -> None:
    text = printout(tmp_path)
    logs = (tmp_path / "state" / "logs").resolve()
    assert f"  logs: {logs} (the previous run's: {logs.parent / 'logs.prev'})\n" in text


def test_ranks_name_their_expert_parallel_group(tmp_path: Path) -> None:
    config = KvServeConfig()
    state_dir = tmp_path / "state"
    specs = build_topology(config, 2, StackPlan(mode="local", state_dir=state_dir), expert_parallel=2)
    out = io.StringIO()
    _print_ready(specs, "smollm2", 1024, config, UpOptions(None, ranks=2, state_dir=state_dir), out)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("  rank-worker-")]
    assert len(lines) == 2 and all(line.endswith("(gRPC, expert-parallel group ep-0)") for line in lines)
    assert "expert-parallel" not in printout(tmp_path)  # without groups, as before
