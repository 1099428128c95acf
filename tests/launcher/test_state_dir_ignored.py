"""`kvserve up`'s state dir (.kvserve/run: logs, Redis data, services.json, secrets) never shows as
untracked, so it cannot be committed by accident."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
@pytest.mark.parametrize(
    "path", [".kvserve/run/gateway.log", ".kvserve/run/redis/appendonly.aof", ".kvserve/run/services.json"]
)
def test_the_state_dir_is_ignored(path: str) -> None:
    result = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False)
    assert result.returncode == 0, f"{path} is not ignored by .gitignore"
