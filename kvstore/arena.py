"""The L1 arena: one file in shared memory (/dev/shm) that ranks map; the kvstore only sizes and owns it.

The kvstore never reads or writes block data. It creates the file with a fresh arena_id per process
start, reserves its RAM (posix_fallocate, so a full /dev/shm fails here rather than as a SIGBUS in a
rank's copy later), holds an exclusive flock on it while alive, and deletes it on a clean stop. A file
of ours that nobody holds a lock on was left by a killed kvstore and is removed at the next start; the
lock (not a pid) decides, because kvstores in other containers sharing the same /dev/shm have other pid
namespaces.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.ram_budget import PAGE_BYTES, format_bytes

log = logging.getLogger(__name__)

ARENA_PREFIX = "kvserve-l1-"
# Errors that mean "not this much room": try a smaller arena. Anything else is a real failure.
_NO_ROOM = {errno.ENOSPC, errno.ENOMEM, errno.EFBIG}
# The filesystem cannot reserve space: keep the sparse file (pages are taken on first write).
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}

Fallocate = Callable[[int, int, int], None]


class ArenaError(RuntimeError):
    """The arena could not be created."""


@dataclass
class Arena:
    arena_id: str
    path: Path
    size_bytes: int
    lowered_reason: str  # why size_bytes is below the budget asked for; empty if it is not
    _fd: int

    def remove(self) -> None:
        """Delete the file and drop our lock (idempotent). Ranks that still map it keep their mapping."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def ensure_arena_dir(arena_dir: str | Path) -> bool:
    """Make arena_dir (mode 0700: the arena holds cached prompts) when it is missing; True if it was made.
    ArenaError names the directory when it cannot be made."""
    directory = Path(arena_dir)
    if directory.is_dir():
        return False
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        if directory.is_dir():
            return False  # made meanwhile by another kvstore
        raise ArenaError(f"l1_arena_dir {directory} exists and is not a directory") from None
    except OSError as exc:
        raise ArenaError(
            f"l1_arena_dir {directory} does not exist and cannot be created ({exc.strerror}): create it, or set "
            "l1_arena_dir (KVSERVE_L1_ARENA_DIR) to a writable directory such as /dev/shm"
        ) from exc
    return True


def create_arena(
    arena_dir: str | Path,
    size_bytes: int,
    *,
    fallocate: Fallocate | None = None,
    min_bytes: int = PAGE_BYTES,
) -> Arena:
    """Create and reserve a new arena file of size_bytes in arena_dir, halving the size while the
    reservation fails for lack of room (down to min_bytes)."""
    reserve = fallocate if fallocate is not None else getattr(os, "posix_fallocate", None)
    arena_id = uuid.uuid4().hex
    directory = Path(arena_dir)
    path = directory / f"{ARENA_PREFIX}{arena_id}"
    # Created under a hidden name and locked before it gets its real name, so a kvstore starting at the
    # same moment never sees our file unlocked and removes it as stale.
    creating = directory / f".{ARENA_PREFIX}{arena_id}.creating"
    fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(creating, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            creating.unlink()
        raise
    arena = Arena(arena_id=arena_id, path=path, size_bytes=0, lowered_reason="", _fd=fd)
    try:
        arena.size_bytes, arena.lowered_reason = _reserve(fd, size_bytes, min_bytes, reserve)
    except BaseException:
        arena.remove()
        raise
    return arena


def _reserve(fd: int, size_bytes: int, min_bytes: int, reserve: Fallocate | None) -> tuple[int, str]:
    size, reason = size_bytes, ""
    while True:
        os.ftruncate(fd, size)
        if reserve is None:
            return size, reason
        try:
            reserve(fd, 0, size)
            return size, reason
        except OSError as exc:
            if exc.errno in _NO_FALLOCATE:
                log.warning("cannot reserve the arena's RAM up front (%s); pages are taken on first write", exc)
                return size, reason
            if exc.errno not in _NO_ROOM:
                raise
            smaller = size // 2 - (size // 2) % PAGE_BYTES
            if smaller < min_bytes:
                raise ArenaError(f"cannot reserve even {format_bytes(size)} for the arena: {exc}") from exc
            log.warning("reserving %s for the arena failed (%s); trying %s", format_bytes(size), exc, smaller)
            reason = f"reserving {format_bytes(size_bytes)} failed ({exc.strerror}); lowered to {format_bytes(smaller)}"
            os.ftruncate(fd, 0)  # give back what the failed attempt may have kept
            size = smaller


def remove_stale_arenas(arena_dir: str | Path) -> list[Path]:
    """Delete arena files of ours in arena_dir that no live kvstore holds locked; returns them."""
    removed: list[Path] = []
    directory = Path(arena_dir)
    if not directory.is_dir():
        return removed
    for path in sorted(directory.glob(f"{ARENA_PREFIX}*")):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:  # gone meanwhile, another user's file, a symlink: not ours to judge
            log.debug("skipping %s: %s", path, exc)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live kvstore's arena
            path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
