"""The stack's secrets as files: the internal plane's shared secret and Redis's password.

`kvserve up` makes both in its state dir (mode 0600) on first start and keeps them afterwards, and writes the
Redis config file that carries requirepass (so the password is not in redis-server's argv, which `ps` shows).
`kvserve secret create --file PATH` makes one for compose, where each is mounted as a compose secret.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from contracts.internal_auth import create_secret_file
from launcher.topology import INTERNAL_SECRET, LOCAL_REDIS_CONF, REDIS_PASSWORD, local_secret_path


def prepare_local_secrets(state_dir: Path) -> None:
    """The state dir's internal secret and Redis password (created when missing), and Redis's config file."""
    for secret in (INTERNAL_SECRET, REDIS_PASSWORD):
        create_secret_file(local_secret_path(state_dir, secret))
    password = local_secret_path(state_dir, REDIS_PASSWORD).read_text().strip()
    quoted = password.replace("\\", "\\\\").replace('"', '\\"')  # redis.conf's double-quoted string
    write_private(state_dir / LOCAL_REDIS_CONF, f'# written by kvserve up\nrequirepass "{quoted}"\n')


def write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by its owner only from the first byte on."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    temporary.replace(path)


def create_command(path: Path, err: TextIO = sys.stderr) -> int:
    """`kvserve secret create --file PATH`: a new random secret in PATH (0600), or PATH kept if it exists."""
    try:
        created = create_secret_file(path)
    except OSError as exc:
        print(f"error: cannot write {path}: {exc.strerror or exc}", file=err)
        return 1
    if created:
        print(f"wrote a new secret to {path} (mode 0600)", file=err)
    else:
        print(f"{path} exists: kept it (mode set to 0600); delete it first for a new secret", file=err)
    return 0
