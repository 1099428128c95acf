"""The arena file: created at the budget's size, lowered when the reservation fails, stale ones removed."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest

from kvstore.arena import ARENA_PREFIX, ArenaError, create_arena, remove_stale_arenas
from kvstore.ram_budget import MIB


def test_create_sizes_reserves_and_removes(tmp_path: Path) -> None:
    arena = create_arena(tmp_path, 4 * MIB)
    assert arena.path.parent == tmp_path and arena.path.name == f"{ARENA_PREFIX}{arena.arena_id}"
    assert arena.path.stat().st_size == arena.size_bytes == 4 * MIB
    assert arena.lowered_reason == ""
    assert arena.path.stat().st_blocks * 512 >= 4 * MIB  # really reserved, not sparse
    assert [p.name for p in tmp_path.iterdir()] == [arena.path.name]  # no leftover temp name
    arena.remove()
    arena.remove()  # idempotent
    assert not arena.path.exists()


def test_each_arena_has_a_fresh_id(tmp_path: Path) -> None:
    first, second = create_arena(tmp_path, 1 * MIB), create_arena(tmp_path, 1 * MIB)
    try:
        assert first.arena_id != second.arena_id and first.path != second.path
    finally:
        first.remove()
        second.remove()


def test_a_failed_reservation_lowers_the_size(tmp_path: Path) -> None:
    def fallocate(fd: int, offset: int, length: int) -> None:
        if length > 2 * MIB:
            raise OSError(errno.ENOSPC, "No space left on device")

    arena = create_arena(tmp_path, 8 * MIB, fallocate=fallocate)
    try:
        assert arena.size_bytes == 2 * MIB
        assert arena.path.stat().st_size == 2 * MIB
        assert "lowered to 2.0 MiB" in arena.lowered_reason
    finally:
        arena.remove()


def test_no_room_at_all_is_an_error_and_leaves_no_file(tmp_path: Path) -> None:
    def fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ArenaError, match="cannot reserve"):
        create_arena(tmp_path, 1 * MIB, fallocate=fallocate)
    assert list(tmp_path.iterdir()) == []


def test_a_filesystem_without_fallocate_keeps_a_sparse_file(tmp_path: Path) -> None:
    def fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    arena = create_arena(tmp_path, 2 * MIB, fallocate=fallocate)
    try:
        assert arena.size_bytes == 2 * MIB and arena.lowered_reason == ""
    finally:
        arena.remove()


def test_stale_arenas_are_removed_but_live_ones_and_others_files_kept(tmp_path: Path) -> None:
    live = create_arena(tmp_path, 1 * MIB)  # holds its lock, like a running kvstore
    stale = tmp_path / f"{ARENA_PREFIX}deadbeef"  # nobody holds it: a killed kvstore's
    stale.write_bytes(b"\0" * 4096)
    unrelated = tmp_path / "torch_shm_1234"
    unrelated.write_bytes(b"x")
    try:
        assert remove_stale_arenas(tmp_path) == [stale]
        assert live.path.exists() and unrelated.exists() and not stale.exists()
    finally:
        live.remove()


def test_a_file_locked_elsewhere_counts_as_live(tmp_path: Path) -> None:
    other = tmp_path / f"{ARENA_PREFIX}other-kvstore"
    other.write_bytes(b"\0")
    fd = os.open(other, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert remove_stale_arenas(tmp_path) == []
        assert other.exists()
    finally:
        os.close(fd)
    assert remove_stale_arenas(tmp_path) == [other]


def test_remove_stale_in_a_missing_dir_is_a_no_op(tmp_path: Path) -> None:
    assert remove_stale_arenas(tmp_path / "absent") == []
