"""Tool turns written into a real Claude Code session transcript, so that `claude -p --resume` resends a
conversation with tool history, as a tool loop does, without the embedded model having to emit tool calls.

Claude Code keeps each session as JSONL under $CLAUDE_CONFIG_DIR/projects/<cwd-slug>/<session-id>.jsonl, one
entry per message, chained by parentUuid. The entries below have the shape the CLI itself writes for a
tool_use and its tool_result (seen in transcripts of the 2.1.197 and 2.1.332 CLIs running Read and Edit)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Fields every message entry repeats from the session it belongs to.
_SESSION_FIELDS = ("sessionId", "cwd", "version", "gitBranch", "userType", "entrypoint")


@dataclass(frozen=True)
class ToolTurn:
    name: str
    input: dict[str, Any]
    result: str  # the tool_result text the model reads
    tool_use_result: dict[str, Any]  # what the CLI keeps of the tool's outcome beside it


def find_transcript(config_dir: Path, session_id: str) -> Path:
    found = list((config_dir / "projects").glob(f"*/{session_id}.jsonl"))
    assert len(found) == 1, f"no single transcript of session {session_id} under {config_dir}: {found}"
    return found[0]


def read_turn(path: Path) -> ToolTurn:
    """Read of a whole file, with its result numbered as the CLI numbers it ("1\\tline")."""
    content = path.read_text()
    lines = content.split("\n")
    numbered = "\n".join(f"{number}\t{line}" for number, line in enumerate(lines, 1))
    file = {"filePath": str(path), "content": content, "numLines": len(lines), "startLine": 1, "totalLines": len(lines)}
    return ToolTurn("Read", {"file_path": str(path)}, numbered, {"type": "text", "file": file})


def edit_turn(path: Path, old: str, new: str) -> ToolTurn:
    """Edit, applied to the file as the CLI would apply it."""
    original = path.read_text()
    assert original.count(old) == 1, f"{old!r} is not unique in {path}"
    path.write_text(original.replace(old, new))
    outcome = {
        "filePath": str(path),
        "oldString": old,
        "newString": new,
        "originalFile": original,
        "structuredPatch": [],
        "userModified": False,
        "replaceAll": False,
    }
    edit_input = {"replace_all": False, "file_path": str(path), "old_string": old, "new_string": new}
    return ToolTurn("Edit", edit_input, f"The file {path} has been updated successfully.", outcome)


def append_tool_turn(transcript: Path, turn: ToolTurn, model: str) -> None:
    """An assistant tool_use and the user's tool_result after the last message of the transcript."""
    entries = [json.loads(line) for line in transcript.read_text().splitlines() if line.strip()]
    messages = [entry for entry in entries if entry.get("type") in ("user", "assistant") and "uuid" in entry]
    session = {field: messages[-1][field] for field in _SESSION_FIELDS if field in messages[-1]}
    # The chain goes on from the leaf `--resume` starts at: the last prompt's, else the last entry in it.
    leaves = [entry["leafUuid"] for entry in entries if entry.get("type") == "last-prompt" and "leafUuid" in entry]
    leaf = leaves[-1] if leaves else [entry for entry in entries if "uuid" in entry][-1]["uuid"]
    tool_use_id = f"toolu_{uuid.uuid4().hex[:24]}"
    assistant_uuid, user_uuid = str(uuid.uuid4()), str(uuid.uuid4())
    assistant = {
        "parentUuid": leaf,
        "isSidechain": False,
        "message": {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "tool_use", "id": tool_use_id, "name": turn.name, "input": turn.input}],
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        },
        "type": "assistant",
        "uuid": assistant_uuid,
        "timestamp": _now(),
        **session,
    }
    user = {
        "parentUuid": assistant_uuid,
        "isSidechain": False,
        "type": "user",
        "message": {
            "role": "user",
            "content": [{"tool_use_id": tool_use_id, "type": "tool_result", "content": turn.result}],
        },
        "uuid": user_uuid,
        "timestamp": _now(),
        "toolUseResult": turn.tool_use_result,
        "sourceToolAssistantUUID": assistant_uuid,
        **session,
    }
    last_prompt = {"type": "last-prompt", "leafUuid": user_uuid, "sessionId": session.get("sessionId")}
    with transcript.open("a") as out:
        for entry in (assistant, user, last_prompt):
            out.write(json.dumps(entry) + "\n")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
