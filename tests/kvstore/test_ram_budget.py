"""The arena budget: l1_host_gb lowered by MemAvailable minus headroom and by the arena dir's free space."""

from __future__ import annotations

from pathlib import Path

from kvstore.ram_budget import (
    DIR_MARGIN_BYTES,
    GIB,
    PAGE_BYTES,
    MachineReadings,
    parse_mem_available,
    plan_ram_budget,
    read_machine,
)


def test_plenty_of_ram_grants_the_request_in_full() -> None:
    budget = plan_ram_budget(2.0, 4.0, MachineReadings(mem_available_bytes=100 * GIB, dir_free_bytes=50 * GIB))
    assert budget.requested_bytes == budget.granted_bytes == 2 * GIB
    assert budget.reason == ""
    assert "as requested" in budget.describe()


def test_memory_minus_headroom_lowers_the_budget() -> None:
    budget = plan_ram_budget(32.0, 4.0, MachineReadings(mem_available_bytes=20 * GIB, dir_free_bytes=64 * GIB))
    assert budget.requested_bytes == 32 * GIB
    assert budget.granted_bytes == 16 * GIB
    assert "MemAvailable" in budget.reason and "l1_headroom_gb 4" in budget.reason


def test_arena_dir_free_space_lowers_the_budget_with_a_margin() -> None:
    readings = MachineReadings(mem_available_bytes=100 * GIB, dir_free_bytes=8 * GIB)
    budget = plan_ram_budget(32.0, 4.0, readings, arena_dir="/dev/shm")
    assert budget.granted_bytes == 8 * GIB - DIR_MARGIN_BYTES
    assert "/dev/shm" in budget.reason


def test_the_tighter_limit_wins_and_names_itself() -> None:
    memory_bound = plan_ram_budget(32.0, 4.0, MachineReadings(10 * GIB, 20 * GIB))
    assert memory_bound.granted_bytes == 6 * GIB and "MemAvailable" in memory_bound.reason
    dir_bound = plan_ram_budget(32.0, 4.0, MachineReadings(30 * GIB, 5 * GIB))
    assert dir_bound.granted_bytes == 5 * GIB - DIR_MARGIN_BYTES and "free" in dir_bound.reason


def test_a_machine_without_room_grants_zero_never_negative() -> None:
    budget = plan_ram_budget(32.0, 4.0, MachineReadings(mem_available_bytes=3 * GIB, dir_free_bytes=10 * GIB))
    assert budget.granted_bytes == 0
    assert "leaves 0.0 MiB" in budget.reason


def test_missing_readings_do_not_limit() -> None:
    budget = plan_ram_budget(1.5, 4.0, MachineReadings(None, None))
    assert budget.granted_bytes == budget.requested_bytes == int(1.5 * GIB)
    assert budget.reason == ""


def test_the_grant_is_whole_pages() -> None:
    budget = plan_ram_budget(0.05, 0.0, MachineReadings(GIB + 123, None))
    assert budget.granted_bytes % PAGE_BYTES == 0
    assert 0 < budget.granted_bytes <= 0.05 * GIB


def test_parse_mem_available() -> None:
    text = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n"
    assert parse_mem_available(text) == 20_000_000 * 1024
    assert parse_mem_available("MemTotal: 5 kB\n") is None


def test_read_machine_reads_this_machine(tmp_path: Path) -> None:
    readings = read_machine(tmp_path)
    assert readings.dir_free_bytes is not None and readings.dir_free_bytes > 0
    assert readings.mem_available_bytes is not None and readings.mem_available_bytes > 0


def test_read_machine_tolerates_missing_sources(tmp_path: Path) -> None:
    readings = read_machine(tmp_path / "absent", meminfo_path=tmp_path / "no-meminfo")
    assert readings == MachineReadings(None, None)
