"""`kvserve up`'s state dir (default .kvserve/run): the secrets, Redis's config and data (redis/), the services'
logs (logs/, the run before in logs.prev/) and services.json.

Logs and Redis's dump and append-only files hold session ids, so all of it is its user's alone: directories
0700, files 0600 (the services run with umask 077 for what they write themselves).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LOGS = "logs"
PREVIOUS_LOGS = "logs.prev"
REDIS_DATA = "redis"  # redis-server's --dir (launcher/topology.py)
IGNORE_EVERYTHING = "# kvserve up's logs and local state\n*\n"  # the state dir ignores itself


def prepare_state_dir(state_dir: Path) -> Path:
    """Make the state dir private, with a private redis/ and a fresh, empty logs/ (the last run's go to
    logs.prev/, replacing the run before); returns logs/. A directory kvserve did not make (`--state-dir
    /tmp`) keeps its own mode: what kvserve puts in it is private."""
    ignore = state_dir / ".gitignore"
    made_by_kvserve = not state_dir.exists() or (ignore.is_file() and ignore.read_text() == IGNORE_EVERYTHING)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    redis_data = state_dir / REDIS_DATA
    redis_data.mkdir(mode=0o700, exist_ok=True)
    make_private_tree(state_dir if made_by_kvserve else redis_data)  # what an earlier version left readable
    if not ignore.exists():
        descriptor = os.open(ignore, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(IGNORE_EVERYTHING)
    return rotate_logs(state_dir / LOGS, state_dir / PREVIOUS_LOGS)


def rotate_logs(logs: Path, previous: Path) -> Path:
    """Move the last run's logs to `previous` (a restart must not lose why the last run ended) and make `logs`
    again, empty and private."""
    if logs.is_dir() and any(logs.iterdir()):
        shutil.rmtree(previous, ignore_errors=True)
        logs.rename(previous)
        make_private_tree(previous)
    logs.mkdir(mode=0o700, exist_ok=True)
    logs.chmod(0o700)
    return logs


def make_private_tree(root: Path) -> None:
    """Directories under `root` (itself included) 0700, files 0600; symbolic links are left alone."""
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o700)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, 0o600)
